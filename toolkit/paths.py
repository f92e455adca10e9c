"""Path helpers."""

from __future__ import annotations

import os
from pathlib import Path


def normalize_path(value: str) -> str:
    """Expand `~` and environment variables; keep hub ids (`owner/name`) as they are."""
    expanded = os.path.expandvars(os.path.expanduser(value))
    return str(Path(expanded)) if Path(expanded).exists() else expanded
