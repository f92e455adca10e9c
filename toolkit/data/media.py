"""Which files a dataset folder's samples are (torch-free: the config check uses it before any library loads)."""

from __future__ import annotations

from pathlib import Path

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")


def sample_files(folder: Path) -> list[Path]:
    """The image files of a dataset folder, sorted by name (unreadable ones are found when read)."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
