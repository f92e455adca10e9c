"""Helpers for tests: image folders and job files."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_DATA = REPO / "config" / "examples" / "quickstart_data"


def make_image(path: Path, size: tuple[int, int], color=(120, 60, 200), caption: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def trainer_process(tmp_path: Path, **overrides) -> dict:
    """An sd_trainer process config on the tiny model and the shipped quickstart images."""
    process = {
        "type": "sd_trainer",
        "training_folder": str(tmp_path / "output"),
        "device": "cpu",
        "trigger_word": "shp",
        "network": {"type": "lora", "linear": 4, "linear_alpha": 4},
        "save": {"dtype": "float32", "save_every": 0, "max_step_saves_to_keep": 2},
        "datasets": [{"folder_path": str(QUICKSTART_DATA), "resolution": [64]}],
        "train": {"batch_size": 2, "steps": 4, "lr": 1e-3, "dtype": "fp32", "seed": 42},
        "model": {"arch": "sd15", "name_or_path": "tiny"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(process.get(key), dict):
            process[key] = {**process[key], **value}
        else:
            process[key] = value
    return process


def write_job(path: Path, name: str, *processes: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": name, "process": list(processes)}}))
    return path



def copy_quickstart_data(dest: Path) -> Path:
    shutil.copytree(QUICKSTART_DATA, dest)
    return dest
