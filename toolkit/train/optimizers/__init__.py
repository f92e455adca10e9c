"""Optimizers from `train.optimizer` and `train.optimizer_params`."""

from __future__ import annotations

import inspect

import torch

from ...config.schema import TrainConfig

OPTIMIZERS = {"adamw": torch.optim.AdamW}


def accepted_params(name: str) -> set[str]:
    """The keyword arguments `train.optimizer_params` may give the optimizer `name`."""
    return set(inspect.signature(OPTIMIZERS[name]).parameters) - {"params", "lr"}


def build_optimizer(train: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer over the trained parameters; `optimizer_params` were checked with the config."""
    return OPTIMIZERS[train.optimizer](params, lr=train.lr, **train.optimizer_params)
