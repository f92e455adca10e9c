"""run.py with test instruments, for `accelerate launch` tests:

- DIFFTUNE_TEST_INTERRUPT_AFTER=N: the main process sends itself SIGINT right after update N (a real
  Ctrl-C through the real signal handler, timed deterministically);
- DIFFTUNE_TEST_FAIL_RANK=R: process R raises an error in its second micro-batch;
- DIFFTUNE_TEST_RECORD_INDICES=DIR: every process appends the sample indices of each micro-batch to
  DIR/rank<R>.jsonl as {"epoch": e, "indices": [...]}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from contextlib import ExitStack, contextmanager
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


@contextmanager
def fail_on_rank(rank: int):
    from jobs.process.sd_trainer import SDTrainer

    original = SDTrainer.train_step

    def train_step(self, batch, epoch, micro_batch):
        if self.accelerator.process_index == rank and micro_batch == 1:
            raise RuntimeError(f"injected failure on rank {rank}")
        return original(self, batch, epoch, micro_batch)

    SDTrainer.train_step = train_step
    try:
        yield
    finally:
        SDTrainer.train_step = original


@contextmanager
def record_indices(folder: Path):
    from jobs.process.sd_trainer import SDTrainer

    original = SDTrainer.train_step

    def train_step(self, batch, epoch, micro_batch):
        line = json.dumps({"epoch": epoch, "indices": batch["indices"].tolist()})
        with (folder / f"rank{self.accelerator.process_index}.jsonl").open("a") as handle:
            handle.write(line + "\n")
        return original(self, batch, epoch, micro_batch)

    SDTrainer.train_step = train_step
    try:
        yield
    finally:
        SDTrainer.train_step = original


if __name__ == "__main__":
    with ExitStack() as instruments:
        if "DIFFTUNE_TEST_INTERRUPT_AFTER" in os.environ:
            instruments.enter_context(interrupt_after(int(os.environ["DIFFTUNE_TEST_INTERRUPT_AFTER"])))
        if "DIFFTUNE_TEST_FAIL_RANK" in os.environ:
            instruments.enter_context(fail_on_rank(int(os.environ["DIFFTUNE_TEST_FAIL_RANK"])))
        if "DIFFTUNE_TEST_RECORD_INDICES" in os.environ:
            instruments.enter_context(record_indices(Path(os.environ["DIFFTUNE_TEST_RECORD_INDICES"])))
        sys.exit(run.main(sys.argv[1:]))
