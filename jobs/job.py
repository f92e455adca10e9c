"""A job: the processes of one config file, run in order."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.schema import JobConfig

from .registry import ProcessRegistry

log = logging.getLogger("difftune")


@dataclass(frozen=True)
class JobContext:
    """What every process of a job may read: the whole validated config and where it came from."""

    config: JobConfig
    config_path: Path

    @property
    def name(self) -> str:
        return self.config.config.name


class Job:
    def __init__(self, config: JobConfig, config_path: Path, registry: ProcessRegistry):
        self.context = JobContext(config, config_path)
        self.processes = [
            registry.process_class(process_cfg.type)(self.context, index, process_cfg)
            for index, process_cfg in enumerate(config.config.process)
        ]

    def run(self) -> None:
        for process in self.processes:
            log.info("job '%s': process %d (%s)", self.context.name, process.index, process.config.type)
            process.run()
