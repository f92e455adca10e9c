"""run.py, except that the main process sends itself SIGINT right after update N.

A real Ctrl-C through the real signal handler, timed deterministically: DIFFTUNE_TEST_INTERRUPT_AFTER=N.
Used with `accelerate launch` for multi-process resume tests.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import run  # noqa: E402
from jobs.process.base_sd_train_process import BaseSDTrainProcess  # noqa: E402


@contextmanager
def interrupt_after(step: int):
    original = BaseSDTrainProcess.after_update

    def after_update(self, record, progress):
        original(self, record, progress)
        if record["step"] == step and self.is_main:
            os.kill(os.getpid(), signal.SIGINT)

    BaseSDTrainProcess.after_update = after_update
    try:
        yield
    finally:
        BaseSDTrainProcess.after_update = original


if __name__ == "__main__":
    with interrupt_after(int(os.environ["DIFFTUNE_TEST_INTERRUPT_AFTER"])):
        sys.exit(run.main(sys.argv[1:]))
