"""Checks of a validated process config against the file system, run before any model loads: the dataset
folders exist and hold images, and every configured path exists. Kept apart from the schema so that a config can be read and checked
for its shape anywhere (e.g. the shipped examples, which name folders of the user's)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from toolkit.data.media import IMAGE_EXTENSIONS, sample_files
from toolkit.errors import PathNotFound
from toolkit.paths import normalize_path

#: `model` keys (in any family) that name a file, a folder or a hub id
PATH_KEYS = ("name_or_path", "single_file_config", "image_encoder_path", "decoder_name_or_path",
             "assistant_lora_path", "vae_name_or_path")


def path_problems(process: BaseModel) -> list[str]:
    """Every missing dataset folder and local-looking configured path, each named by its key."""
    problems = []
    for index, dataset in enumerate(getattr(process, "datasets", None) or []):
        folder = Path(dataset.folder_path).expanduser()
        if not folder.is_dir():
            problems.append(f"datasets[{index}].folder_path: folder not found: {dataset.folder_path}")
        elif not sample_files(folder):
            problems.append(f"datasets[{index}].folder_path: no images ({', '.join(IMAGE_EXTENSIONS)}) in "
                            f"{dataset.folder_path}")
    model = getattr(process, "model", None)
    sections = [("model", model)] + [(f"model.{name}", getattr(model, name)) for name in ("sampling",)
                                      if isinstance(getattr(model, name, None), BaseModel)]
    for prefix, section in sections:
        for key in PATH_KEYS:
            value = getattr(section, key, None)
            if isinstance(value, str):
                try:
                    normalize_path(value, f"{prefix}.{key}")
                except PathNotFound as err:
                    problems.append(str(err))
    network = getattr(process, "network", None)
    lora = getattr(network, "pretrained_lora_path", None)
    if lora and not Path(lora).expanduser().exists():  # a file, or a peft adapter folder
        problems.append(f"network.pretrained_lora_path: file not found: {lora}")
    return problems
