"""Model adapters by `model.arch`. Adapters are imported on first use so that config validation
stays fast and one family's heavy imports never slow another."""

from __future__ import annotations

import importlib
from typing import Any

from .base import ModelAdapter

ADAPTERS: dict[str, str] = {
    "sd15": "toolkit.models.sd:SD15Adapter",
    "wuerstchen": "toolkit.models.wuerstchen:WuerstchenAdapter",
    "zimage": "toolkit.models.zimage:ZImageAdapter",
}

#: `model` keys that only some families use, and which families use them
FAMILY_MODEL_KEYS: dict[str, set[str]] = {
    "single_file_config": {"sd15", "zimage"},
    "image_encoder_path": {"wuerstchen"},
    "decoder_name_or_path": {"wuerstchen"},
    "quantize": {"zimage"},
    "qtype": {"zimage"},
    "quantize_te": {"zimage"},
    "qtype_te": {"zimage"},
    "sampling": {"zimage"},
    "assistant_lora_path": {"zimage"},
}

#: `model` keys a family cannot do without
REQUIRED_MODEL_KEYS: dict[str, set[str]] = {
    "wuerstchen": {"image_encoder_path"},
}


def available_archs() -> list[str]:
    return sorted(ADAPTERS)


def family_key_problems(arch: str, keys_set: set[str], values: dict[str, Any]) -> list[str]:
    """Config problems of `model` keys that belong to other families or that this family needs."""
    problems = [f"model.{key} is not used by arch {arch} (only by {', '.join(sorted(FAMILY_MODEL_KEYS[key]))})"
                for key in sorted(keys_set) if key in FAMILY_MODEL_KEYS and arch not in FAMILY_MODEL_KEYS[key]]
    problems += [f"arch {arch} needs model.{key}" for key in sorted(REQUIRED_MODEL_KEYS.get(arch, ()))
                 if values.get(key) is None]
    return problems


def get_adapter_class(arch: str) -> type[ModelAdapter]:
    if arch not in ADAPTERS:
        raise ValueError(f"unknown model.arch '{arch}' (known: {', '.join(available_archs())})")
    module_name, class_name = ADAPTERS[arch].split(":")
    return getattr(importlib.import_module(module_name), class_name)
