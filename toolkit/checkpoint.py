"""Step checkpoints: written under a temporary name, renamed when complete, pruned oldest first."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

STEP_DIR = re.compile(r"^step_(\d{9})$")
COMPLETE_MARKER = "train_state.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Complete step folders, oldest first. A folder without its marker is never counted."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for path in checkpoints_dir.iterdir():
        match = STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def save_checkpoint(
    checkpoints_dir: Path, step: int, write_files: Callable[[Path], None], train_state: dict, keep: int
) -> Path:
    """Write a checkpoint folder atomically, then prune to the newest `keep` complete ones.

    `write_files(folder)` writes the payload; `train_state.json` is written last and marks completion.
    """
    final = checkpoints_dir / step_dir_name(step)
    tmp = checkpoints_dir / f".tmp_{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_files(tmp)
    (tmp / COMPLETE_MARKER).write_text(json.dumps(train_state, indent=2), encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in complete_checkpoints(checkpoints_dir)[:-keep]:
        shutil.rmtree(old)
    return final
