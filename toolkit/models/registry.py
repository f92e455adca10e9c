"""Model adapters by `model.arch`. Adapters are imported on first use so that config validation
stays fast and one family's heavy imports never slow another."""

from __future__ import annotations

import importlib

from .base import ModelAdapter

ADAPTERS: dict[str, str] = {
    "sd15": "toolkit.models.sd:SD15Adapter",
}


def available_archs() -> list[str]:
    return sorted(ADAPTERS)


def get_adapter_class(arch: str) -> type[ModelAdapter]:
    if arch not in ADAPTERS:
        raise ValueError(f"unknown model.arch '{arch}' (known: {', '.join(available_archs())})")
    module_name, class_name = ADAPTERS[arch].split(":")
    return getattr(importlib.import_module(module_name), class_name)
