"""What a finished LoRA file says about itself, for the tools that read it.

- kohya's `ss_*` keys (A1111/Forge show them: name, network, base model, resolution, images, tag cloud) and the
  `sshs_*` hashes they trust, computed as kohya sd-scripts computes them (`precalculate_safetensors_hashes`);
- Stability AI's model spec (`modelspec.*`), as kohya writes it for a LoRA;
- difftune's own keys: the job config and the base model.

Safetensors metadata values are strings. By default (`save.metadata: private`) no value holds an absolute local
path or the user's home folder: local paths are reduced to their last component, hub ids stay. `full` keeps the
config verbatim (private use), `minimal` writes only what loading needs (nothing beyond the tensors and, in the
diffusers form, peft's config, which the writer adds).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from toolkit.config.preflight import PATH_KEYS as MODEL_PATH_KEYS
from toolkit.paths import looks_local

#: the model spec version kohya sd-scripts writes
MODELSPEC_VERSION = "1.0.1"
#: kohya's names for the network modules
NETWORK_MODULES = {"lora": "networks.lora", "lokr": "lycoris.kohya", "loha": "lycoris.kohya"}
METADATA_LEVELS = ("private", "full", "minimal")


@dataclass(frozen=True)
class TrainingFacts:
    """Everything the metadata says, as plain values (the trainer gathers them; nothing here reads a model)."""

    name: str
    arch: str
    base_model: str
    network_type: str
    rank: int
    alpha: float
    conv_rank: int | None
    conv_alpha: float | None
    use_dora: bool
    kohya_base_model: str
    modelspec_architecture: str
    prediction_type: str
    resolution: int
    num_train_images: int
    num_reg_images: int
    num_epochs: int
    epoch: int
    steps: int
    learning_rate: float
    tag_frequency: dict[str, dict[str, int]]
    started_at: float
    finished_at: float
    trigger_word: str | None
    config: dict[str, Any] = field(default_factory=dict)
    zero_terminal_snr: bool = False
    #: the text encoders' LR when they trained too (None: the LoRA is the denoiser's alone)
    text_encoder_lr: float | None = None


def lora_metadata(facts: TrainingFacts, level: str = "private") -> dict[str, str]:
    """The header of a finished LoRA file at `level` (private, full or minimal), all values strings."""
    if level not in METADATA_LEVELS:
        raise ValueError(f"save.metadata must be one of {', '.join(METADATA_LEVELS)}, got {level!r}")
    if level == "minimal":
        return {}
    private = level == "private"
    config = private_config(facts.config) if private else facts.config
    base_model = reduce_path(facts.base_model) if private else facts.base_model
    return {**kohya_keys(facts, base_model), **modelspec_keys(facts),
            "difftune_config": json.dumps(config, sort_keys=True), "difftune_name": facts.name,
            "difftune_step": str(facts.steps), "difftune_arch": facts.arch, "difftune_base_model": base_model}


def kohya_keys(facts: TrainingFacts, base_model: str) -> dict[str, str]:
    """kohya sd-scripts' training metadata (train_network.py), every value a string as kohya stringifies it."""
    args: dict[str, Any] = {}
    if facts.conv_rank is not None:
        args |= {"conv_dim": str(facts.conv_rank), "conv_alpha": str(facts.conv_alpha or facts.conv_rank)}
    if facts.network_type != "lora":
        args["algo"] = facts.network_type
    if facts.use_dora:  # kohya's networks.lora has no DoRA: LyCORIS's module, which applies dora_scale
        args |= {"algo": "locon" if facts.conv_rank is not None else "lora", "dora_wd": "True"}
    keys = {
        "ss_output_name": facts.name,
        "ss_network_module": "lycoris.kohya" if facts.use_dora else NETWORK_MODULES[facts.network_type],
        "ss_network_dim": str(facts.rank),
        "ss_network_alpha": str(float(facts.alpha)),
        "ss_base_model_version": facts.kohya_base_model,
        "ss_v2": "False",
        "ss_v_parameterization": str(facts.prediction_type == "v_prediction"),
        "ss_zero_terminal_snr": str(facts.zero_terminal_snr),
        "ss_sd_model_name": reduce_path(base_model),  # kohya: a local checkpoint's file name, or the hub id
        "ss_resolution": f"({facts.resolution}, {facts.resolution})",
        "ss_num_train_images": str(facts.num_train_images),
        "ss_num_reg_images": str(facts.num_reg_images),
        "ss_num_epochs": str(facts.num_epochs),
        "ss_epoch": str(facts.epoch),
        "ss_steps": str(facts.steps),
        "ss_learning_rate": str(facts.learning_rate),
        "ss_unet_lr": str(facts.learning_rate),
        "ss_text_encoder_lr": str(facts.text_encoder_lr),
        "ss_tag_frequency": json.dumps(facts.tag_frequency),
        "ss_training_started_at": str(facts.started_at),
        "ss_training_finished_at": str(facts.finished_at),
    }
    if args:
        keys["ss_network_args"] = json.dumps(args)
    return keys


def modelspec_keys(facts: TrainingFacts) -> dict[str, str]:
    """Stability AI's model spec for a LoRA (kohya's sai_model_spec.py): architecture, title, date, resolution."""
    keys = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": facts.modelspec_architecture,
        "modelspec.implementation": "diffusers",
        "modelspec.title": facts.name,
        # kohya: local time, seconds, no timezone
        "modelspec.date": datetime.fromtimestamp(int(facts.finished_at)).isoformat(),
        "modelspec.resolution": f"{facts.resolution}x{facts.resolution}",
        "modelspec.prediction_type": {"v_prediction": "v", "flow_matching": "flow"}.get(facts.prediction_type,
                                                                                          facts.prediction_type),
    }
    if facts.trigger_word:
        keys["modelspec.trigger_phrase"] = facts.trigger_word
    return keys


def tag_frequency(captions_by_dataset: Iterable[tuple[str, Iterable[str]]]) -> dict[str, dict[str, int]]:
    """kohya's `ss_tag_frequency`: per dataset folder name, each comma-separated tag (stripped, lower-cased) and
    how many captions hold it (once per image, not per repeat)."""
    out: dict[str, dict[str, int]] = {}
    for folder, captions in captions_by_dataset:
        counts = Counter(out.get(folder, {}))
        for caption in captions:
            counts.update(tag.strip().lower() for tag in caption.split(",") if tag.strip())
        out[folder] = dict(counts)
    return out


def kohya_hashes(state: dict, metadata: dict[str, str]) -> dict[str, str]:
    """`sshs_model_hash` and `sshs_legacy_hash` as kohya's precalculate_safetensors_hashes computes them: the file
    serialised with its `ss_*` keys only; the model hash is the sha256 of the tensor bytes (after the header), so
    editing metadata does not change it; the legacy hash reads 64 KiB at 1 MiB of that serialisation."""
    from safetensors.torch import save

    serialised = save(state, {k: v for k, v in metadata.items() if k.startswith("ss_")})
    header = int.from_bytes(serialised[:8], "little")
    return {"sshs_model_hash": hashlib.sha256(serialised[8 + header:]).hexdigest(),
            "sshs_legacy_hash": hashlib.sha256(serialised[0x100000:0x110000]).hexdigest()[:8]}


def reduce_path(value: str) -> str:
    """A local path reduced to its last component (a hub id, a preset name or a word stays as it is)."""
    text = value.strip()
    expanded = os.path.expanduser(text)
    if looks_local(text) or looks_local(expanded) or (os.sep in text and Path(expanded).exists()):
        return re.split(r"[\\/]", expanded.rstrip("/\\"))[-1]  # Windows paths too, wherever the file is read
    return _without_home(text)


#: config keys whose values are paths (in any section): reduced to their last component in private headers
PATH_KEYS = frozenset({*MODEL_PATH_KEYS, "folder_path", "cache_dir", "training_folder", "pretrained_lora_path",
                       "resume"})


def private_config(config: Any, key: str | None = None) -> Any:
    """The config with the values of path keys reduced (`reduce_path`) and the home folder gone from every other
    string (prompts and captions stay as written, slashes included)."""
    if isinstance(config, dict):
        return {name: private_config(value, name) for name, value in config.items()}
    if isinstance(config, list):
        return [private_config(value, key) for value in config]
    if isinstance(config, str):
        return reduce_path(config) if key in PATH_KEYS else _without_home(config)
    return config


def _without_home(text: str) -> str:
    home = str(Path.home())
    return re.sub(re.escape(home) + r"[/\\]?", "", text) if home not in ("", "/") else text
