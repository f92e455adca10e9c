"""Optimizers from `train.optimizer` and `train.optimizer_params`."""

from __future__ import annotations

import inspect

import torch

from toolkit.config.sections import OptimizerSection
from toolkit.train.optimizer_params import uses_relative_step  # noqa: F401 (re-exported)


def _bitsandbytes(name: str):
    try:
        import bitsandbytes.optim as bnb_optim
    except Exception as err:  # missing, or no backend for this device
        raise RuntimeError(f"optimizer {name} needs bitsandbytes, which cannot run here ({err}); "
                           "use optimizer: adamw (or adafactor for less memory)") from err
    return {"adamw8bit": bnb_optim.AdamW8bit, "lion8bit": bnb_optim.Lion8bit}[name]


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    if name == "adamw":
        return torch.optim.AdamW
    if name in ("adamw8bit", "lion8bit"):
        return _bitsandbytes(name)
    if name == "adafactor":
        from toolkit.train.optimizers.adafactor import BoundedAdafactor

        return BoundedAdafactor
    raise ValueError(f"unknown optimizer '{name}'")


def accepted_params(name: str) -> set[str]:
    """The keyword arguments `train.optimizer_params` may give the optimizer `name`."""
    cls = optimizer_class(name)
    names = set(inspect.signature(cls).parameters)
    if name == "adafactor":  # the wrapper passes the rest on to transformers' Adafactor
        from transformers.optimization import Adafactor

        names |= set(inspect.signature(Adafactor).parameters)
    return names - {"params", "lr", "kwargs", "self"}


def build_optimizer(section: OptimizerSection, params: list[torch.nn.Parameter] | list[dict]) -> torch.optim.Optimizer:
    """The optimizer over the trained parameters, or over parameter groups (a group's own `lr` wins over `lr`);
    `optimizer_params` were checked with the config."""
    return optimizer_class(section.optimizer)(params, lr=section.lr, **section.optimizer_params)


def logged_lr(optimizer: torch.optim.Optimizer, scheduled_lr: float) -> float:
    """The LR an update used: the optimizer's own average when it picks LRs itself (relative-step
    Adafactor), else the scheduler's."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps optimizers
    average = getattr(inner, "get_avg_learning_rate", None)
    if average is not None and inner.param_groups[0].get("relative_step"):
        return average()
    return scheduled_lr


def update_rms(optimizer: torch.optim.Optimizer) -> float | None:
    return getattr(getattr(optimizer, "optimizer", optimizer), "last_update_rms", None)
