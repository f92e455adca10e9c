"""BaseProcess: one named step of a job, with its typed config."""

from __future__ import annotations

from pydantic import BaseModel

from jobs.context import JobContext


class BaseProcess:
    def __init__(self, job: JobContext, index: int, config: BaseModel):
        self.job = job
        self.index = index
        self.config = config

    def run(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement run()")


class StopRequested(Exception):
    """The user asked the run to stop (Ctrl-C, SIGTERM); the process saved what it needed."""
