"""A job: the processes of one config file, run in order."""

from __future__ import annotations

import logging
from pathlib import Path

from jobs.context import JobContext
from jobs.registry import ProcessRegistry
from toolkit.config.schema import JobConfig

log = logging.getLogger("difftune")


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


def get_job(config: JobConfig, config_path: Path, registry: ProcessRegistry) -> Job:
    return Job(config, config_path, registry)
