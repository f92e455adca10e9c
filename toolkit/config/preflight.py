"""Checks of a validated process config against the file system, run before any model loads: the dataset
folders exist and hold samples (images; for video families clips too), and every configured path exists. Kept apart from the schema so that a config can be read and checked
for its shape anywhere (e.g. the shipped examples, which name folders of the user's)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from pydantic import BaseModel

from toolkit.data.media import cache_root, clip_files, sample_extensions, sample_files
from toolkit.errors import PathNotFound
from toolkit.paths import normalize_path

#: `model` keys (in any family) that name a file, a folder or a hub id
PATH_KEYS = ("name_or_path", "single_file_config", "image_encoder_path", "decoder_name_or_path",
             "assistant_lora_path", "vae_name_or_path", "text_encoder_path", "tokenizer")


def path_problems(process: BaseModel, written: Sequence[Path] = ()) -> list[str]:
    """Every missing dataset folder (images and masks) and local-looking configured path, each named by its key;
    not those inside a folder of `written` (an earlier process of the job writes there). `process` may be partly
    typed (`toolkit.config.loader.partly_typed`): a section or dataset that did not parse is not looked at."""
    return [message for message, value in _path_problems(process) if not _inside(value, written)]


def _inside(value: str, written: Sequence[Path]) -> bool:
    where = Path(value).expanduser().absolute()
    return any(where == folder.absolute() or folder.absolute() in where.parents for folder in written)


def reference_folder_problems(key: str, folders: list[str]) -> list[tuple[str, str]]:
    """(message, folder) for each reference folder that is not there (`control_path`: one, or one per slot)."""
    named = [(key if len(folders) == 1 else f"{key}[{slot}]", folder) for slot, folder in enumerate(folders)]
    return [(f"{at}: folder not found: {folder}", folder) for at, folder in named if not Path(folder).is_dir()]


def sample_reference_problems(key: str, files: list[str]) -> list[tuple[str, str]]:
    """(message, file) for each sample reference image that is not there or does not open as an image."""
    from PIL import Image

    problems = []
    for slot, file in enumerate(files):
        at = f"{key}[{slot}]"
        if not Path(file).is_file():
            problems.append((f"{at}: file not found: {file}", file))
            continue
        try:
            with Image.open(file) as image:
                image.verify()
        except Exception as err:  # PIL raises many types for files it cannot read
            problems.append((f"{at}: not a readable image: {file} ({err})", file))
    return problems


def _path_problems(process: BaseModel) -> list[tuple[str, str]]:
    """(message, the path it names) for each path problem."""
    problems: list[tuple[str | None, str]] = []
    model = getattr(process, "model", None)
    facts = getattr(model, "facts", None)  # the family's FamilyFacts (a class attribute of its config)
    video = bool(facts is None or facts.video)  # a `model` that did not parse: clips are not held against a folder
    family = getattr(facts, "title", "")
    for index, dataset in enumerate(getattr(process, "datasets", None) or []):
        if dataset is None:  # did not parse: its own errors are reported
            continue
        problems.append((sample_folder_problem(f"datasets[{index}].folder_path", dataset.folder_path, video, family),
                         dataset.folder_path))
        if dataset.mask_path is not None and not Path(dataset.mask_path).expanduser().is_dir():
            problems.append((f"datasets[{index}].mask_path: folder not found: {dataset.mask_path}", dataset.mask_path))
        problems += reference_folder_problems(f"datasets[{index}].control_path", dataset.reference_folders)
    sample = getattr(process, "sample", None)
    for index, references in enumerate(getattr(sample, "references", None) or []):
        problems += sample_reference_problems(f"sample.prompts[{index}].references", references)
    validation = getattr(process, "validation", None)
    held_out = getattr(validation, "folder_path", None)
    if held_out:
        problems.append((sample_folder_problem("validation.folder_path", held_out, video, family), held_out))
        problems += reference_folder_problems("validation.control_path", validation.reference_folders)
    sections = [("model", model)] + [(f"model.{name}", getattr(model, name)) for name in ("sampling",)
                                      if isinstance(getattr(model, name, None), BaseModel)]
    for prefix, section in sections:
        for key in PATH_KEYS:
            value = getattr(section, key, None)
            named = [(f"{prefix}.{key}", value)] if isinstance(value, str) else []
            if isinstance(value, list):  # one path per part (`text_encoder_path`)
                named = [(f"{prefix}.{key}[{i}]", item) for i, item in enumerate(value) if isinstance(item, str)]
            for at, item in named:
                try:
                    normalize_path(item, at)
                except PathNotFound as err:
                    problems.append((str(err), item))
    network = getattr(process, "network", None)
    lora = getattr(network, "pretrained_lora_path", None)
    if lora and not Path(lora).expanduser().exists():  # a file, or a peft adapter folder
        problems.append((f"network.pretrained_lora_path: file not found: {lora}", lora))
    return [(message, value) for message, value in problems if message]


def sample_folder_problem(key: str, value: str, video: bool, family: str) -> str | None:
    """Why the folder `key` names cannot give samples (missing, or without images, or clips for a video family)."""
    folder = Path(value).expanduser()
    if not folder.is_dir():
        return f"{key}: folder not found: {value}"
    if sample_files(folder, video):
        return None
    problem = f"{key}: no {'images or clips' if video else 'images'} ({', '.join(sample_extensions(video))}) in {value}"
    clips = [] if video else clip_files(folder)
    if clips:
        problem += f" (its {len(clips)} clip file(s) are not used: {family or 'this model family'} trains on images)"
    return problem


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
        if dataset is not None and (dataset.cache_latents_to_disk or text_cache):
            key = f"datasets[{index}].cache_dir"
            found.append((key, cache_root(dataset.folder_path, dataset.cache_dir)))
    return found
