"""TrainingPlan: the step arithmetic of a run, as a pure function of its sizes.

A step is one optimizer update. With N processes, the batches are sharded as accelerate shards them: every process
sees ceil(batches / N) micro-batches per epoch (a few batches repeated to even out the shards); an
update happens every `gradient_accumulation` micro-batches, and a trailing partial window still updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TrainingPlan:
    samples: int
    batches: int
    processes: int
    gradient_accumulation: int
    micro_batches_per_epoch: int
    updates_per_epoch: int
    total_updates: int
    warmup_updates: int
    epochs: int
    length_from: str  # "steps" or "epochs"
    requested_steps: int | None = None
    requested_epochs: int | None = None
    warmup_ratio: float | None = None
    requested_warmup: int = 0

    @classmethod
    def create(
        cls,
        samples: int,
        batches: int,
        processes: int,
        gradient_accumulation: int,
        steps: int | None,
        epochs: int | None,
        warmup_steps: int = 0,
        warmup_ratio: float | None = None,
    ) -> TrainingPlan:
        if steps is None and epochs is None:
            raise ValueError("give train.steps or train.epochs")
        plan = cls(
            samples=samples, batches=batches, processes=processes, gradient_accumulation=gradient_accumulation,
            micro_batches_per_epoch=0, updates_per_epoch=0, total_updates=0, warmup_updates=0, epochs=0,
            length_from="steps" if steps is not None else "epochs", requested_steps=steps,
            requested_epochs=epochs, warmup_ratio=warmup_ratio, requested_warmup=warmup_steps,
        )
        return plan.with_micro_batches(math.ceil(batches / processes))

    def with_micro_batches(self, micro_batches_per_epoch: int) -> TrainingPlan:
        """The plan for a given number of micro-batches per process per epoch."""
        updates_per_epoch = math.ceil(micro_batches_per_epoch / self.gradient_accumulation)
        if self.requested_steps is not None:
            total = self.requested_steps
        else:
            total = self.requested_epochs * updates_per_epoch
        warmup = self.requested_warmup
        if self.warmup_ratio is not None:
            warmup = math.floor(self.warmup_ratio * total)
        if warmup >= total:
            raise ValueError(
                f"train.lr_warmup_steps / train.lr_warmup_ratio give {warmup} warmup updates, but training has "
                f"only {total} updates; warmup must be shorter"
            )
        return replace(
            self,
            micro_batches_per_epoch=micro_batches_per_epoch,
            updates_per_epoch=updates_per_epoch,
            total_updates=total,
            warmup_updates=warmup,
            epochs=math.ceil(total / updates_per_epoch),
        )

    def ending_at(self, total_updates: int) -> TrainingPlan:
        """The same plan with its last update at `total_updates` (and the epochs that takes)."""
        return replace(self, total_updates=total_updates,
                       epochs=math.ceil(total_updates / self.updates_per_epoch))

    def ends_update(self, micro_batch: int) -> bool:
        """Whether micro-batch `micro_batch` (0-based, in its epoch) is the last of its accumulation window: every
        `gradient_accumulation`-th, and an epoch's last (a short window still updates)."""
        return (micro_batch + 1) % self.gradient_accumulation == 0 or micro_batch + 1 == self.micro_batches_per_epoch

    @property
    def repeated_batches(self) -> int:
        """accelerate repeats the first few batches so that every process gets as many as the others."""
        return self.micro_batches_per_epoch * self.processes - self.batches

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("samples", self.samples),
            ("batches per epoch (all processes)", self.batches),
            ("processes", self.processes),
            ("micro-batches per process per epoch", self.micro_batches_per_epoch),
            ("gradient accumulation", self.gradient_accumulation),
            ("updates per epoch", self.updates_per_epoch),
            ("total updates", self.total_updates),
            ("warmup updates", self.warmup_updates),
            ("epochs", self.epochs),
            ("batches repeated to even shards", self.repeated_batches),
        ]

    def as_dict(self) -> dict[str, int]:
        return dict(self.rows())

    def describe(self) -> str:
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        lines = ["training plan (a step is one optimizer update):"]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        if self.requested_steps is not None and self.requested_epochs is not None:
            lines.append(f"  train.steps ({self.requested_steps}) wins over train.epochs ({self.requested_epochs})")
        return "\n".join(lines)


def accumulation_window(micro_batch: int, micro_batches_per_epoch: int, gradient_accumulation: int) -> int:
    """How many micro-batches the update that `micro_batch` (0-based, in its epoch) belongs to has.

    Every window is full except, possibly, an epoch's last; a short window's gradient must be the mean over
    its own micro-batches, not shrunk by the missing ones.
    """
    start = micro_batch // gradient_accumulation * gradient_accumulation
    return min(gradient_accumulation, micro_batches_per_epoch - start)


@dataclass
class Position:
    """Where training is: updates done, and the data position of the next micro-batch."""

    global_step: int = 0
    epoch: int = 0
    micro_batch_in_epoch: int = 0
    #: updates dropped for non-finite values so far (`train.on_nan: skip`), resumes included
    skipped_updates: int = 0


def resumed_position(saved: Position, saved_world_size: int, world_size: int, micro_batches_per_epoch: int,
                     gradient_accumulation: int) -> Position:
    """Where a resumed run continues. On another process count the micro-batches consumed in the epoch are
    re-counted for the new count (whole accumulation windows), so the LR continues at the saved update."""
    epoch, consumed = saved.epoch, saved.micro_batch_in_epoch
    if saved_world_size != world_size:
        consumed = consumed * saved_world_size // world_size // gradient_accumulation * gradient_accumulation
    if consumed >= micro_batches_per_epoch:
        epoch, consumed = epoch + 1, 0
    return Position(saved.global_step, epoch, consumed, saved.skipped_updates)
