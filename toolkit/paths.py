"""Model paths from configs: a local file or folder, a hub id, or a preset name, told apart up front.

A value that looks like a local path (`/...`, `./...`, `../...`, `~...`, a drive letter, a file name with a
weights extension, or more than one `/`) must exist: otherwise loaders would quietly ask the hub for it
and fail later with a confusing "repository not found".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from toolkit.errors import PathNotFound

#: `owner/name` as the hub spells repository ids
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
WEIGHT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".gguf")


def looks_local(value: str) -> bool:
    """Whether a (expanded) value can only mean a local path."""
    return (value.startswith(("/", "./", "../", "~", "\\"))
            or bool(re.match(r"^[A-Za-z]:[\\/]", value))
            or value.lower().endswith(WEIGHT_SUFFIXES)
            or value.count("/") > 1)


def normalize_path(value: str, key: str = "model.name_or_path") -> str:
    """The value with surrounding whitespace removed and `~` / `$VARS` expanded: an existing local path as an
    absolute-free normal path, a hub id or preset name unchanged. `key` names the config key in errors."""
    text = value.strip()
    expanded = os.path.expandvars(os.path.expanduser(text))
    if Path(expanded).exists():
        return str(Path(expanded))
    if looks_local(text) or looks_local(expanded):
        raise PathNotFound(f"{key}: {value.strip()!r} looks like a local path but does not exist"
                                + (f" (expanded to {expanded})" if expanded != text else ""))
    return expanded
