"""Jobs: a config file's processes, built from the process registry."""

from __future__ import annotations

from pathlib import Path

from toolkit.config.schema import JobConfig

from .job import Job, JobContext
from .registry import ProcessRegistry, build_registry


def get_job(config: JobConfig, config_path: Path, registry: ProcessRegistry) -> Job:
    return Job(config, config_path, registry)


__all__ = ["Job", "JobContext", "ProcessRegistry", "build_registry", "get_job"]
