"""Adafactor with bounded relative-step LRs, an honest average LR, and update-RMS tracking.

Built on transformers' Adafactor. It adds what that class lacks: `min_lr`/`max_lr` bounds on the LR it
picks in relative-step mode (per parameter, every update), `get_avg_learning_rate()` for logging, and
`last_update_rms`, the RMS of the weight change of the last step averaged over parameters.
"""

from __future__ import annotations

import math

import torch
from transformers.optimization import Adafactor

DEFAULT_MAX_LR = 1e-4
DEFAULT_MIN_LR = 0.0


class BoundedAdafactor(Adafactor):
    def __init__(self, params, lr: float | None = None, *, min_lr: float = DEFAULT_MIN_LR,
                 max_lr: float = DEFAULT_MAX_LR, relative_step: bool = True, **kwargs):
        if min_lr < 0 or max_lr <= 0 or min_lr > max_lr:
            raise ValueError(f"adafactor: need 0 <= min_lr <= max_lr and max_lr > 0 (got {min_lr}, {max_lr})")
        # relative-step mode computes its own LR and transformers refuses any `lr` with it; 0.0 keeps LR
        # schedulers (which scale group["lr"]) harmless.
        super().__init__(params, lr=None if relative_step else lr, relative_step=relative_step, **kwargs)
        for group in self.param_groups:
            group.update(min_lr=min_lr, max_lr=max_lr)
            if relative_step:
                group["lr"] = 0.0
        self.last_update_rms = 0.0

    @staticmethod
    def _get_lr(param_group, param_state):
        """transformers' Adafactor LR, with the parameter-RMS scale kept on the device: its
        `max(eps, RMS)` compares a device scalar on the host, a wait for the GPU once per parameter."""
        lr = param_group["lr"]
        if param_group["relative_step"]:
            min_step = 1e-6 * param_state["step"] if param_group["warmup_init"] else 1e-2
            lr = min(min_step, 1.0 / math.sqrt(param_state["step"]))
        if param_group["scale_parameter"]:
            rms, eps = param_state["RMS"], param_group["eps"][1]
            lr = (rms.clamp(min=eps) if torch.is_tensor(rms) else max(eps, rms)) * lr
        if param_group["relative_step"]:
            low, high = param_group["min_lr"], param_group["max_lr"]
            lr = lr.clamp(low, high) if torch.is_tensor(lr) else min(max(lr, low), high)
        param_state["effective_lr"] = lr  # kept as is: converting here would sync a GPU once per parameter
        return lr

    def get_avg_learning_rate(self) -> float:
        """The mean LR of the last step over parameters; before the first step, the configured LR
        (`lr`, or in relative-step mode the `max_lr` bound)."""
        lrs = [self.state[p]["effective_lr"] for g in self.param_groups for p in g["params"]
               if "effective_lr" in self.state.get(p, {})]
        if lrs:
            return float(sum(lrs) / len(lrs))
        group = self.param_groups[0]
        return group["max_lr"] if group["relative_step"] else group["lr"]

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        before = [p.detach().clone() for p in params]
        loss = super().step(closure)
        rms = [(p.detach() - old).float().pow(2).mean().sqrt() for p, old in zip(params, before)]
        # a device scalar: read only when the update is logged
        self.last_update_rms = torch.stack(rms).mean() if rms else torch.zeros(())
        return loss
