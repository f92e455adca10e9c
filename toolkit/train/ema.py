"""An exponential moving average of the trained LoRA weights (`train.ema`).

The average is a float32 copy of every trained parameter, on the parameter's device, on every process (the
weights are the same on all of them, so the averages are too; only the main process writes them). When it moves
is a pure function of the update index, so a resumed run (which loads the average from its checkpoint) keeps
exactly the average an uninterrupted run has. Written by swapping it into the trained parameters for the length of
a write or a sampling pass (`applied`), so every file form the LoRA has is written for the average too, by the same
code; the trained weights are copied back bit for bit afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from toolkit.config.sections import EMAConfig
from toolkit.train.weights import weights_restored

log = logging.getLogger("difftune")


class LoraEMA:
    """ema = decay x ema + (1 - decay) x weights after every `update_every`-th update from `start_step` on; before
    that (and at `start_step` itself) the average is a copy of the weights."""

    def __init__(self, cfg: EMAConfig, params: list[torch.nn.Parameter]):
        self.cfg = cfg
        self.params = params
        #: the average, one float32 tensor per parameter; None until `start_step`
        self.average: list[torch.Tensor] | None = None

    @property
    def started(self) -> bool:
        return self.average is not None

    def begin(self, step: int) -> None:
        """At the start of training (a fresh run at step 0): the average starts now when `start_step` is 0."""
        if step >= self.cfg.start_step and self.average is None:
            self.capture()

    def after_update(self, step: int) -> None:
        """After optimizer update number `step` (1-based)."""
        start = self.cfg.start_step
        if step < start:
            return
        if self.average is None:
            self.capture()
        elif (step - start) % self.cfg.update_every == 0:
            live = [param.detach().float() for param in self.params]
            torch._foreach_lerp_(self.average, live, 1.0 - self.cfg.decay)

    def capture(self) -> None:
        """The average becomes a copy of the weights as they are now."""
        self.average = [param.detach().float().clone() for param in self.params]

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The trained parameters hold the average inside the block (to write or render it), their own values
        again after it, exactly."""
        if self.average is None:
            raise RuntimeError("the EMA has not started yet (train.ema.start_step is ahead)")
        with weights_restored(self.params):
            with torch.no_grad():
                for param, value in zip(self.params, self.average):
                    param.copy_(value)
            yield

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Inside the block, whatever is loaded into the trained parameters becomes the average; they hold their own
        values again after it (a resume reads the checkpoint's average with the code that reads its LoRA)."""
        with weights_restored(self.params):
            yield
            self.capture()
