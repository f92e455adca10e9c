"""Noise drawn for a training example beyond the plain Gaussian."""

from __future__ import annotations

import torch


def noise_offset(noise: torch.Tensor, offset: float, generator: torch.Generator) -> torch.Tensor:
    """noise + offset * n, n ~ N(0, 1) of shape [batch, channels, 1, 1]: one shift per sample and channel,
    which lets the model learn overall brightness (Guttenberg 2023). n is drawn on the CPU generator so
    the draw does not depend on the device; offset 0 returns the noise unchanged and draws nothing."""
    if offset == 0:
        return noise
    shift = torch.randn(noise.shape[0], noise.shape[1], *([1] * (noise.dim() - 2)), generator=generator)
    return noise + offset * shift.to(device=noise.device, dtype=noise.dtype)
