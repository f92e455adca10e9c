"""Losses of one micro-batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mse_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error computed in float32 whatever the autocast dtype."""
    return F.mse_loss(prediction.float(), target.float(), reduction="mean")
