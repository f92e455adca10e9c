"""Which files a dataset folder's samples are (torch-free: the config check uses it before any library loads)."""

from __future__ import annotations

from pathlib import Path

#: still images, the samples of every family (a `.webp` may be animated: a clip in a video family, its first frame
#: in an image family)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
#: video clips (containers PyAV decodes, and GIF), samples of video families only; toolkit/data/clips.py reads them
CLIP_EXTENSIONS = (".mp4", ".webm", ".mov", ".gif")
#: a dataset's cache folder (latents, text embeddings) when it names none: inside its image folder
CACHE_FOLDER = "_difftune_cache"


def cache_root(folder_path: str, cache_dir: str | None) -> Path:
    """Where a dataset's disk caches go (`datasets[].cache_dir`, else <folder_path>/_difftune_cache)."""
    return Path(cache_dir) if cache_dir else Path(folder_path) / CACHE_FOLDER


def sample_extensions(video: bool) -> tuple[str, ...]:
    """The extensions of a dataset folder's samples: images, and clips too for a video family."""
    return IMAGE_EXTENSIONS + CLIP_EXTENSIONS if video else IMAGE_EXTENSIONS


def sample_files(folder: Path, video: bool = False) -> list[Path]:
    """The sample files of a dataset folder, sorted by name: its images, and with `video` its clips too (unreadable
    ones are found when read)."""
    extensions = sample_extensions(video)
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in extensions)


def clip_files(folder: Path) -> list[Path]:
    """A folder's clip files (`CLIP_EXTENSIONS`), sorted by name: what an image family leaves out."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in CLIP_EXTENSIONS)


def images_by_name(folder: Path) -> dict[str, Path]:
    """A folder's images by base name (`IMAGE_EXTENSIONS`), the first by name where several share a base name: a
    dataset's masks (`datasets[].mask_path`) and reference images (`datasets[].control_path`), found by their
    targets' base names."""
    found: dict[str, Path] = {}
    for path in sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS):
        found.setdefault(path.stem, path)
    return found
