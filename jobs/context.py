"""What every process of a job may read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolkit.config.schema import JobConfig


@dataclass(frozen=True)
class JobContext:
    """What every process of a job may read: the whole validated config and where it came from."""

    config: JobConfig
    config_path: Path

    @property
    def name(self) -> str:
        return self.config.config.name
