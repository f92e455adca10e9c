"""The names of a run's checkpoint folders, and which of them are complete: file names only, no torch, so that
`--status` and the dashboard read them without loading the training libraries."""

from __future__ import annotations

import re
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{9})$")
TMP_PREFIX = ".tmp_"
COMPLETE_MARKER = "train_state.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def scan_checkpoints(checkpoints_dir: Path) -> tuple[list[Path], list[Path]]:
    """(complete step folders oldest first, incomplete ones: no marker, or a temporary folder)."""
    if not checkpoints_dir.is_dir():
        return [], []
    complete, incomplete = [], []
    for path in sorted(checkpoints_dir.iterdir()):
        match = STEP_DIR.match(path.name)
        if path.is_dir() and match and (path / COMPLETE_MARKER).is_file():
            complete.append((int(match.group(1)), path))
        elif path.is_dir() and (match or path.name.startswith(TMP_PREFIX)):
            incomplete.append(path)
    return [path for _, path in sorted(complete)], incomplete
