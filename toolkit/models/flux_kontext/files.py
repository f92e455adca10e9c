"""FLUX.1 Kontext's parts as single files: FLUX.1's (toolkit/models/flux/files.py), the transformer's known
variants being Kontext's. Kontext [dev]'s transformer has FLUX.1 [dev]'s names and shapes: `arch` says which it is.
Free of torch."""

from __future__ import annotations

from pathlib import Path

from toolkit.models.flux.files import family_files
from toolkit.models.single_files import FamilyFiles

VARIANTS = Path(__file__).parent / "variants.json"


def kontext_files() -> FamilyFiles:
    from toolkit.models.flux_kontext.tiny import TINY_FLUX_KONTEXT, ensure_tiny_flux_kontext

    return family_files(VARIANTS, {"tiny": (TINY_FLUX_KONTEXT, ensure_tiny_flux_kontext)},
                        "FLUX.1 Kontext transformer", hint="kontext")
