"""Faults injected for the tests, at points the trainer names: a test hook inside the real code path, not a mock of
it. Read from the environment variable DIFFTUNE_TEST_FAULTS, which no real run sets (then every method is a no-op).

`DIFFTUNE_TEST_FAULTS="nan_loss@5,nan_loss@6,oom@sampling"`:
- `nan_loss@N`: the loss of the run's N-th micro-batch is NaN. N counts from 1 over the whole run by data position
  (epoch x micro-batches per epoch + micro-batch), so a resumed run meets it at the same batch;
- `oom@PHASE` or `oom@PHASE:K`: torch.OutOfMemoryError where the trainer enters PHASE (`Faults.phase`; the phases
  are toolkit.run.out_of_memory.PHASES) for the first time, or the K-th (training enters once per micro-batch);
- `memory@PHASE[:K]`: the host's MemoryError there instead."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

ENV = "DIFFTUNE_TEST_FAULTS"


@dataclass
class Faults:
    nan_losses: frozenset[int] = frozenset()
    #: (phase, entry) -> the error class raised there
    errors: dict[tuple[str, int], type[BaseException]] = field(default_factory=dict)
    #: how many times each phase was entered
    entered: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> Faults:
        return cls.parse(os.environ.get(ENV, ""))

    @classmethod
    def parse(cls, spec: str) -> Faults:
        nan: set[int] = set()
        errors: dict[tuple[str, int], type[BaseException]] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, where = item.partition("@")
            phase, _, entry = where.partition(":")
            if kind == "nan_loss" and where.isdigit():
                nan.add(int(where))
            elif kind in ("oom", "memory") and phase and (not entry or entry.isdigit()):
                errors[phase, int(entry or 1)] = torch.OutOfMemoryError if kind == "oom" else MemoryError
            else:
                raise ValueError(f"{ENV}: {item!r} is not nan_loss@N, oom@PHASE[:K] or memory@PHASE[:K]")
        return cls(frozenset(nan), errors)

    def loss(self, loss: torch.Tensor, micro_batch_number: int) -> torch.Tensor:
        """`loss`, made NaN at the listed micro-batches (on the device: nothing waits)."""
        if micro_batch_number in self.nan_losses:
            return loss * float("nan")
        return loss

    def phase(self, name: str) -> None:
        """Raise the listed out-of-memory error where the trainer enters a phase for the listed time."""
        if not self.errors:
            return
        count = self.entered[name] = self.entered.get(name, 0) + 1
        error = self.errors.get((name, count))
        if error is not None:
            raise error(f"injected out of memory ({ENV}) in {name}")
