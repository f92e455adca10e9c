"""A full disk or a write error (ENOSPC, EDQUOT, EFBIG, EIO, EROFS), told as one message naming the path, what was
being written and the space it needs against the space free; and the free-space check at the start of a run.

Every file of a run is written under a temporary name and renamed when whole (toolkit.files, checkpoints as
`.tmp_step_*` folders completed last), so a failed write never leaves a partial file under a final name: the
message can say so, and that the same command resumes from the last complete checkpoint."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from toolkit.errors import UserError

#: the errors of a file system that cannot take the write
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})
#: the same errors as libraries report them without an errno (safetensors' Rust writer, torch's zip writer)
DISK_TEXTS = ("no space left", "storagefull", "storage full", "file too large", "filetoolarge", "disk quota",
              "read-only file system", "readonlyfilesystem", "input/output error", "file write failed")
#: what torch's writer says when its stream fails, whatever the cause: a disk error only where the file system is
#: full or read-only at that moment (`disk_error` with a folder)
STREAM_TEXTS = ("iostream error", "unexpected pos", "pytorchstreamwriter failed")
#: below this, a file system counts as full
FULL_BELOW = 2**20


class DiskProblem(UserError):
    """A write the file system refused; the message names the path and the space needed."""


def disk_error(error: BaseException, folder: Path | None = None) -> BaseException | None:
    """The file-system error behind `error` (itself, or its cause or context), if it is one; a writer's stream error
    counts where `folder`'s file system is full or read-only now."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
            return error
        text = str(error).lower()
        if not isinstance(error, OSError) and any(t in text for t in DISK_TEXTS):
            return error
        if folder is not None and any(t in text for t in STREAM_TEXTS) and (unwritable(folder) or size_limited()):
            return error
        error = error.__cause__ or error.__context__
    return None


def size_limited() -> bool:
    """Whether this process may not write files past a size (RLIMIT_FSIZE, e.g. `ulimit -f`)."""
    import resource

    return resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY


def unwritable(folder: Path) -> bool:
    """Whether `folder`'s file system is full (under FULL_BELOW free) or mounted read-only."""
    return filesystem_state(folder) is not None


def filesystem_state(folder: Path) -> str | None:
    """"No space left on device" or "Read-only file system" where `folder`'s file system is so now, else None."""
    path = Path(folder).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    if stats.f_flag & os.ST_RDONLY:
        return os.strerror(errno.EROFS)
    return os.strerror(errno.ENOSPC) if stats.f_bavail * stats.f_frsize < FULL_BELOW else None


def tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (a file: its own)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def free_bytes(path: Path) -> int | None:
    """The bytes free to this user on the file system of `path` (or of its nearest existing folder)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB" if value < 2**30 else f"{value / 2**30:.2f} GiB"


def disk_message(error: BaseException, writing: str, folder: Path, needed: int | None, resume_step: int | None) -> str:
    """One message for a write that failed: the path, the reason, what was being written and its size against the
    free space, and what to do."""
    cause = disk_error(error, folder) or error
    path = getattr(cause, "filename", None) or folder
    if isinstance(cause, OSError) and cause.errno:
        reason = os.strerror(cause.errno)
    elif filesystem_state(folder):  # a writer's own words hide it: say what the file system is
        reason = filesystem_state(folder)
    elif size_limited():
        import resource

        reason = (f"{os.strerror(errno.EFBIG)} (this process may not write files past "
                  f"{mib(resource.getrlimit(resource.RLIMIT_FSIZE)[0])}: ulimit -f)")
    else:
        reason = str(cause).strip()
    free = free_bytes(folder)
    lines = [f"could not write {path}: {reason}.",
             f"  writing {writing}" + (f", which needs about {mib(needed)}" if needed else "")
             + ("" if free is None else f"; {mib(free)} free on the file system of {folder}") + "."]
    lines.append("  nothing partial is left under a final name (a checkpoint is complete only once its folder is "
                 "renamed).")
    again = (f"it resumes from the checkpoint of update {resume_step}" if resume_step else "it starts again")
    lines.append(f"  free space (or make {folder} writable) and run the same command again: {again}.")
    return "\n".join(lines)


def space_warning(folder: Path, checkpoint: int, keep: int, final: int) -> str | None:
    """A warning where the run's checkpoints (`keep` of about `checkpoint` bytes, one more while the next is written)
    and its final files (`final` bytes) cannot fit in the space free under `folder`; None where they can."""
    needed = checkpoint * (keep + 1) + final
    free = free_bytes(folder)
    if free is None or needed <= free:
        return None
    return (f"{folder}: the run's files need about {mib(needed)} ({keep} checkpoints of about {mib(checkpoint)} kept "
            f"by save.max_step_saves_to_keep, one more while a checkpoint is written, and the final files), and "
            f"{mib(free)} is free there: free space or keep fewer checkpoints, or the run will stop when the disk "
            "is full")
