"""Device choice and memory housekeeping."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """A config dtype name as a torch dtype; `auto` is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def mixed_precision(name: str, device: torch.device) -> str:
    """accelerate's mixed_precision value for `train.dtype`."""
    dtype = torch_dtype(name, device)
    if dtype == torch.float16 and device.type != "cuda":
        raise ValueError("train.dtype fp16 needs a CUDA device; use bf16 or fp32 on the CPU")
    return {torch.float32: "no", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def flush() -> None:
    """Free cached memory (before saving, after sampling)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def modules_on(modules: list[torch.nn.Module], device: torch.device):
    """Bring modules that were moved off the accelerator back for a while (e.g. to render samples)."""
    homes = [next(module.parameters()).device for module in modules]
    for module in modules:
        module.to(device)
    try:
        yield
    finally:
        for module, home in zip(modules, homes):
            module.to(home)
        flush()
