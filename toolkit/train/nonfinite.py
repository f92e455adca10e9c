"""Non-finite losses and gradients (`train.on_nan`).

- `stop` (default): each update's finite flags stay on the device; they are read, all at once, only where the run
  reads the device anyway: at a logged update, before a checkpoint or samples, at the end. The first non-finite
  update found stops the run before anything is written over the last good checkpoint.
- `skip`: the flags are read before each optimizer step (one wait for the device per update); a non-finite update is
  dropped as fp16's GradScaler drops an overflowed one: no optimizer step, no LR step, not counted toward
  `train.steps`. After `train.max_skipped_updates` skips in total the run stops.

fp16's own overflow skips are not events here: with a GradScaler the gradient norm is the scaler's business, and
only a non-finite loss counts. The message names the update, the batch's files, the values that went non-finite and
what usually causes that for the run's configuration (`likely_causes`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.errors import UserError


class NonFiniteError(UserError):
    """The run stopped on a non-finite loss or gradient; the message says where and what to try."""


@dataclass
class Watched:
    """One update's values as the watch keeps them until they are read: on the device."""

    step: int
    files: list[str]
    names: list[str]
    finite: torch.Tensor  # bool per name, on the device


@dataclass(frozen=True)
class RunFacts:
    """What the causes depend on: the run's configuration, as plain values."""

    lr: float
    optimizer: str
    max_grad_norm: float
    train_dtype: str
    model_dtype: str
    arch: str
    resumed_at: int


def likely_causes(facts: RunFacts, step: int, bad: list[str]) -> list[str]:
    """What usually makes these values non-finite for this configuration, most likely first."""
    losses_bad = [name for name in bad if name != "grad_norm"]
    causes = []
    if "fp16" in (facts.train_dtype, facts.model_dtype):
        causes.append("fp16 overflows where bf16 does not: train in bf16 (model.dtype and train.dtype) on a GPU that "
                      "has it")
    if not losses_bad:
        causes.append(f"the gradients overflowed while the loss was finite: lower train.lr (now {facts.lr:g}) or clip "
                      f"them (train.max_grad_norm, now {facts.max_grad_norm:g})")
    elif step <= facts.resumed_at + 1:
        causes.append("the first update of this run is non-finite: the model's output or the data is, not the "
                      "training; check the base model file, model.dtype (an fp16 SDXL VAE makes NaN latents) and the "
                      "files named above (a cached latent or caption that is non-finite)")
    else:
        causes.append(f"the weights diverged: lower train.lr (now {facts.lr:g})"
                      + (" (Prodigy estimates its own step: lower optimizer_params d_coef)"
                         if facts.optimizer == "prodigy" else ""))
    if facts.optimizer in ("adamw", "adamw8bit", "lion8bit", "schedulefree_adamw") and facts.lr > 1e-3:
        causes.append(f"train.lr {facts.lr:g} is high for {facts.optimizer} on a LoRA (1e-4 is usual)")
    if not facts.max_grad_norm:
        causes.append("train.max_grad_norm is 0: gradients are not clipped")
    return causes


class NonFiniteWatch:
    """The `train.on_nan` rule for one run."""

    def __init__(self, mode: str, max_skipped: int, facts: RunFacts, skipped: int = 0):
        self.mode, self.max_skipped, self.facts = mode, max_skipped, facts
        #: updates skipped so far in the run (carried across resumes by the checkpoint)
        self.skipped = skipped
        self.pending: list[Watched] = []

    @property
    def skipping(self) -> bool:
        return self.mode == "skip"

    #: at most this many updates wait to be read: a run logging rarely reads them once per this many updates
    MAX_PENDING = 1000

    def watch(self, step: int, names: list[str], values: torch.Tensor, files: list[str]) -> None:
        """`stop`: keep the update's finite flags (a device operation: nothing waits) until `check`."""
        if not self.skipping:
            self.pending.append(Watched(step, files, names, torch.isfinite(values)))
            if len(self.pending) >= self.MAX_PENDING:
                self.check(step)

    def flags(self) -> torch.Tensor | None:
        """Whether each watched update was finite, as one device tensor (nothing waits) for a transfer the run
        makes anyway (a logged update's); None where nothing is watched."""
        if not self.pending:
            return None
        return torch.stack([w.finite.all() for w in self.pending])

    def read(self, flags: list[float] | None, now: int) -> None:
        """`flags` (from `flags()`) on the host: raise for the first non-finite update, else forget them."""
        if flags is None:
            return
        pending, self.pending = self.pending[:len(flags)], self.pending[len(flags):]
        if all(flags):
            return
        self.raise_first(pending[[bool(f) for f in flags].index(False)], now)

    def check(self, now: int) -> None:
        """Read every watched update's flags in one transfer; raise for the first non-finite one (`now`: the
        update the run has reached, for the message)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        every = torch.stack([w.finite.all() for w in pending]).tolist()
        if all(every):
            return
        self.raise_first(pending[every.index(False)], now)

    def raise_first(self, first: Watched, now: int) -> None:
        bad = [name for name, ok in zip(first.names, first.finite.tolist()) if not ok]
        raise NonFiniteError(self.message(first.step, bad, first.files, stopped=True)
                             + ("" if now <= first.step else f"\n  (found at update {now}, the first read of the "
                                "device since: train.on_nan: stop does not wait for it at every update)"))

    def non_finite(self, names: list[str], values: torch.Tensor) -> list[str]:
        """The names whose values are non-finite (reads the device: one wait)."""
        finite = torch.isfinite(values).tolist()
        return [name for name, ok in zip(names, finite) if not ok]

    def skipped_one(self, step: int, bad: list[str], files: list[str]) -> str:
        """Count a skipped update; the warning to log. Raises once the run has skipped its allowance."""
        self.skipped += 1
        if self.skipped > self.max_skipped:
            raise NonFiniteError(self.message(step, bad, files, stopped=False)
                                 + f"\n{self.skipped} updates were skipped in this run, more than "
                                 f"train.max_skipped_updates ({self.max_skipped}): the run stops")
        return (f"update {step}: non-finite {', '.join(bad)}; skipped (train.on_nan: skip; {self.skipped} of at most "
                f"{self.max_skipped} in this run). Files: {', '.join(files)}")

    def message(self, step: int, bad: list[str], files: list[str], stopped: bool) -> str:
        lines = [f"update {step}: non-finite {', '.join(bad)} (train.on_nan: {self.mode})."
                 + (" The run stops; nothing was written over the last checkpoint, which the same command resumes "
                    "from." if stopped else ""),
                 f"  the batch's files: {', '.join(files) or '(none recorded)'}",
                 "  what usually causes this here:"]
        lines += [f"  - {cause}" for cause in likely_causes(self.facts, step, bad)]
        if stopped:
            lines.append("  train.on_nan: skip drops such updates instead (at most train.max_skipped_updates)")
        return "\n".join(lines)
