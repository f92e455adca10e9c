"""Timestep samplers: draw u in (0, 1) per sample; each model family maps u to its own timestep."""

from __future__ import annotations

import torch


def sample_uniform(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(batch_size, generator=generator)
