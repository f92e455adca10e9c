"""A tiny random FLUX.1 Kontext, built offline and saved as a normal diffusers FluxKontextPipeline folder: the tiny
FLUX.1 [dev] layout (toolkit/models/flux/tiny.py) with weights of its own, and black-forest-labs/FLUX.1-Kontext-dev's
scheduler config (the same as [dev]'s)."""

from __future__ import annotations

from pathlib import Path

from toolkit.models.flux.tiny import TINY_FLUX_DEV, flux_parts
from toolkit.models.tiny import ensure_tiny

TINY_FLUX_KONTEXT = {**TINY_FLUX_DEV, "seed": 10}


def build_flux_kontext(folder: Path, preset: dict) -> None:
    from diffusers import FluxKontextPipeline

    FluxKontextPipeline(**flux_parts(preset)).save_pretrained(folder, safe_serialization=True)


def ensure_tiny_flux_kontext(preset: dict = TINY_FLUX_KONTEXT) -> Path:
    """The folder of the tiny FLUX.1 Kontext model, built on first use."""
    return ensure_tiny("flux_kontext", preset, build_flux_kontext)
