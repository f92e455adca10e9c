"""Optimizers from `train.optimizer` and `train.optimizer_params`."""

from __future__ import annotations

import inspect

import torch

from ...config.schema import TrainConfig

OPTIMIZERS = {"adamw": torch.optim.AdamW}


def build_optimizer(train: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    cls = OPTIMIZERS[train.optimizer]
    accepted = set(inspect.signature(cls).parameters) - {"params", "lr"}
    unknown = sorted(set(train.optimizer_params) - accepted)
    if unknown:
        raise ValueError(
            f"train.optimizer_params: {', '.join(unknown)} not accepted by {train.optimizer} "
            f"(valid: {', '.join(sorted(accepted))})"
        )
    return cls(params, lr=train.lr, **train.optimizer_params)
