"""Losses of one micro-batch, and the per-sample weights applied to them.

Losses come back per sample (shape [batch]) so that timestep weights, min-SNR weights and masks can be
applied per sample before the batch mean. Everything is computed in float32 whatever the autocast dtype,
because the small differences of a late-training loss vanish in bf16.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F

from toolkit.device import to_device

LossType = Literal["mse", "mae", "pseudo_huber"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)


def mse_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error computed in float32 whatever the autocast dtype."""
    return F.mse_loss(prediction.float(), target.float(), reduction="mean")


def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor, loss_type: LossType = "mse",
                    huber_c: float = 0.1) -> torch.Tensor:
    """Element loss of residual r = prediction - target, averaged over all but the batch dim: [batch].

    mse: r^2. mae: |r|. pseudo_huber: 2c (sqrt(r^2 + c^2) - c) with c = huber_c (kohya's form): about
    r^2 for |r| << c, so it keeps MSE's scale and learning rate, and about 2c|r| for |r| >> c, so
    outliers pull linearly instead of quadratically.
    """
    if prediction.shape != target.shape:
        shapes = f"{tuple(prediction.shape)} and target {tuple(target.shape)}"
        raise ValueError(f"prediction {shapes} differ in shape")
    residual = prediction.float() - target.float()
    if loss_type == "mse":
        element = residual**2
    elif loss_type == "mae":
        element = residual.abs()
    elif loss_type == "pseudo_huber":
        if not huber_c > 0:
            raise ValueError(f"huber_c must be > 0, got {huber_c}")
        element = 2.0 * huber_c * (torch.sqrt(residual**2 + huber_c**2) - huber_c)
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    return element.reshape(element.shape[0], -1).mean(dim=1)


def weighted_mean(per_sample: torch.Tensor, *weights: torch.Tensor | None) -> torch.Tensor:
    """mean_i(loss_i * prod_k weight_k,i): the micro-batch loss; None weights are skipped."""
    total = per_sample.float()
    for weight in weights:
        if weight is not None:
            total = total * to_device(weight, total.device, torch.float32)
    return total.mean()
