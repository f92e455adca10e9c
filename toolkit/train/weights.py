"""What the trained modules hold for a while: other weights (the EMA, schedule-free's average), or eval mode, with
everything as it was afterwards. Samples, the validation loss and the final files use these; training goes on
from exactly the weights it left."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def weights_restored(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Whatever the block puts in `params`, they hold their own values again after it, bit for bit (copied back, not
    recomputed: a resumed run must see the same weights as an uninterrupted one)."""
    kept = [param.detach().clone() for param in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(params, kept):
                param.copy_(value)


@contextmanager
def in_eval_mode(modules: list[torch.nn.Module]) -> Iterator[None]:
    """The modules in eval mode (no dropout) inside the block, in train mode after it."""
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module in modules:
            module.train()
