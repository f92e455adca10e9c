"""Counter-based randomness: a fresh generator per (seed, purpose, counters...).

Every draw a training step makes (noise, timesteps, latent samples, data order) comes from a generator
seeded by what it is for and where it happens, not from one global stream. A resumed run therefore
needs no RNG snapshot to draw the same values, sampling images cannot shift training draws, and a test
can recompute any draw.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, purpose: str, *counters: int) -> int:
    key = ":".join([str(seed), purpose, *(str(int(c)) for c in counters)])
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


def seeded_generator(seed: int, purpose: str, *counters: int) -> torch.Generator:
    """A CPU generator: draws are identical whatever device the tensors end up on."""
    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, purpose, *counters))
