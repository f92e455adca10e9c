"""Faults injected for the tests, at points the trainer names: a test hook inside the real code path, not a mock of
it. Read from the environment variable DIFFTUNE_TEST_FAULTS, which no real run sets (then every method is a no-op).

`DIFFTUNE_TEST_FAULTS="nan_loss@5,nan_loss@6,oom@sampling"`:
- `nan_loss@N`: the loss of the run's N-th micro-batch is NaN. N counts from 1 over the whole run by data position
  (epoch x micro-batches per epoch + micro-batch), so a resumed run meets it at the same batch;
- `oom@PHASE`: torch.OutOfMemoryError where the trainer enters PHASE (`Faults.phase`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

ENV = "DIFFTUNE_TEST_FAULTS"


@dataclass(frozen=True)
class Faults:
    nan_losses: frozenset[int] = frozenset()
    oom_phases: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_env(cls) -> Faults:
        return cls.parse(os.environ.get(ENV, ""))

    @classmethod
    def parse(cls, spec: str) -> Faults:
        nan, oom = set(), set()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, where = item.partition("@")
            if kind == "nan_loss" and where.isdigit():
                nan.add(int(where))
            elif kind == "oom" and where:
                oom.add(where)
            else:
                raise ValueError(f"{ENV}: {item!r} is not nan_loss@N or oom@PHASE")
        return cls(frozenset(nan), frozenset(oom))

    def loss(self, loss: torch.Tensor, micro_batch_number: int) -> torch.Tensor:
        """`loss`, made NaN at the listed micro-batches (on the device: nothing waits)."""
        if micro_batch_number in self.nan_losses:
            return loss * float("nan")
        return loss

    def phase(self, name: str) -> None:
        """Raise the accelerator's out-of-memory error where the trainer enters a listed phase."""
        if name in self.oom_phases:
            raise torch.OutOfMemoryError(f"injected out of memory ({ENV}) in {name}")
