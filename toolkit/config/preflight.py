"""Checks of a validated process config against the file system, run before any model loads: the dataset
folders exist and hold samples (images; for video families clips too), and every configured path exists. Kept apart from the schema so that a config can be read and checked
for its shape anywhere (e.g. the shipped examples, which name folders of the user's)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from toolkit.data.media import cache_root, clip_files, sample_extensions, sample_files
from toolkit.errors import PathNotFound
from toolkit.paths import normalize_path

#: `model` keys (in any family) that name a file, a folder or a hub id
PATH_KEYS = ("name_or_path", "single_file_config", "image_encoder_path", "decoder_name_or_path",
             "assistant_lora_path", "vae_name_or_path")


def path_problems(process: BaseModel) -> list[str]:
    """Every missing dataset folder (images and masks) and local-looking configured path, each named by its key."""
    problems = []
    model = getattr(process, "model", None)
    facts = getattr(model, "facts", None)  # the family's FamilyFacts (a class attribute of its config)
    video = bool(facts is not None and facts.video)
    for index, dataset in enumerate(getattr(process, "datasets", None) or []):
        folder = Path(dataset.folder_path).expanduser()
        if not folder.is_dir():
            problems.append(f"datasets[{index}].folder_path: folder not found: {dataset.folder_path}")
        elif not sample_files(folder, video):
            kinds = "images or clips" if video else "images"
            problem = (f"datasets[{index}].folder_path: no {kinds} ({', '.join(sample_extensions(video))}) in "
                       f"{dataset.folder_path}")
            clips = [] if video else clip_files(folder)
            if clips:
                family = getattr(facts, "title", "") or "this model family"
                problem += f" (its {len(clips)} clip file(s) are not used: {family} trains on images)"
            problems.append(problem)
        if dataset.mask_path is not None and not Path(dataset.mask_path).expanduser().is_dir():
            problems.append(f"datasets[{index}].mask_path: folder not found: {dataset.mask_path}")
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
    validation = getattr(process, "validation", None)
    held_out = getattr(validation, "folder_path", None)
    if held_out:
        folder = Path(held_out).expanduser()
        if not folder.is_dir():
            problems.append(f"validation.folder_path: folder not found: {held_out}")
        elif not sample_files(folder, video):
            problems.append(f"validation.folder_path: no {'images or clips' if video else 'images'} "
                            f"({', '.join(sample_extensions(video))}) in {held_out}")
    network = getattr(process, "network", None)
    lora = getattr(network, "pretrained_lora_path", None)
    if lora and not Path(lora).expanduser().exists():  # a file, or a peft adapter folder
        problems.append(f"network.pretrained_lora_path: file not found: {lora}")
    return problems


def written_folders(process: BaseModel) -> list[tuple[str, Path]]:
    """Where a process writes, each with its key: its training folder, and the disk caches of its datasets (latents
    with `cache_latents_to_disk`, text embeddings with `train.cache_text_embeddings`); relative to the working
    folder, as the trainer reads them. (The tiny test models' own cache, DIFFTUNE_CACHE, is the tool's, not the
    job's.)"""
    found = []
    folder = getattr(process, "training_folder", None)
    if isinstance(folder, str):
        found.append(("training_folder", Path(folder).expanduser()))
    text_cache = bool(getattr(getattr(process, "train", None), "cache_text_embeddings", False))
    for index, dataset in enumerate(getattr(process, "datasets", None) or []):
        if dataset.cache_latents_to_disk or text_cache:
            key = f"datasets[{index}].cache_dir"
            found.append((key, cache_root(dataset.folder_path, dataset.cache_dir)))
    return found
