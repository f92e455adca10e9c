"""Writing a file so that a reader (or a crash) never sees half of it: write a temporary sibling, then rename.

Every file difftune writes in a run folder or a cache goes through `write_atomic`. The temporary name holds the
process id and a random part, so processes writing the same file at once (e.g. cache entries, a concurrent
`--report`), on one host or on several sharing a file system (where process ids repeat), never share one; whichever
rename comes last wins, and each of them is a whole file.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from toolkit.errors import UserError


def write_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` writes the content to a temporary path next to `path`, which then replaces `path` in one
    rename. On any failure the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    try:
        write(tmp)
        # some writers (safetensors) create their files private to the owner: every file of a run gets the
        # permissions a newly created file has here (the umask's)
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: the process umask, read once when this module is imported (the umask can only be read by setting it, which must
#: not race with other threads creating files)
UMASK = _umask()


def new_file_mode() -> int:
    """rw for whom the process umask allows (0644 under the usual umask 022)."""
    return 0o666 & ~UMASK


def write_text_atomic(path: Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(path: Path, data: dict, sort_keys: bool = True) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")


def write_folder_atomic(folder: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` fills a temporary folder next to `folder`, which then takes its place (an older one is moved
    aside first, removed only once the new one is in place, and put back if that fails). Files in it get the same
    permissions as `write_atomic`'s."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file; a folder is written there: choose another name")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    old = folder.with_name(f".{folder.name}.{os.getpid()}.old")
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    try:
        tmp.mkdir()
        write(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                os.chmod(path, new_file_mode())
        if folder.exists():
            folder.rename(old)
        try:
            tmp.rename(folder)
        except BaseException:
            if old.exists():
                old.rename(folder)
            raise
        if old.exists():
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder
