"""Model families by `model.arch`: one line each. A family is a package under toolkit/models/ with its config
class (torch-free: read when a job file is checked) and its adapter (imported only when a model loads)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from toolkit.models.base import ModelAdapter
    from toolkit.models.config import FamilyFacts, ModelConfigBase
    from toolkit.models.single_files import FamilyFiles


@dataclass(frozen=True)
class Family:
    arch: str
    #: "module:Class" of the family's `model` config section
    config: str
    #: "module:Class" of its ModelAdapter
    adapter: str
    #: "module:function" giving its `FamilyFiles` (torch-free), for a family that takes every part as a single file
    files: str | None = None


FAMILIES: dict[str, Family] = {family.arch: family for family in (
    Family("flux", "toolkit.models.flux.config:FluxModelConfig", "toolkit.models.flux.adapter:FluxAdapter",
           "toolkit.models.flux.files:flux_files"),
    Family("flux_kontext", "toolkit.models.flux_kontext.config:FluxKontextModelConfig",
           "toolkit.models.flux_kontext.adapter:FluxKontextAdapter", "toolkit.models.flux_kontext.files:kontext_files"),
    Family("qwen_image", "toolkit.models.qwen_image.config:QwenImageModelConfig",
           "toolkit.models.qwen_image.adapter:QwenImageAdapter"),
    Family("qwen_image_edit", "toolkit.models.qwen_image_edit.config:QwenImageEditModelConfig",
           "toolkit.models.qwen_image_edit.adapter:QwenImageEditAdapter"),
    Family("sd15", "toolkit.models.sd15.config:SD15ModelConfig", "toolkit.models.sd15.adapter:SD15Adapter",
           "toolkit.models.sd15.files:sd15_files"),
    Family("sdxl", "toolkit.models.sdxl.config:SDXLModelConfig", "toolkit.models.sdxl.adapter:SDXLAdapter",
           "toolkit.models.sdxl.files:sdxl_files"),
    Family("wan", "toolkit.models.wan.config:WanModelConfig", "toolkit.models.wan.adapter:WanAdapter"),
    Family("wuerstchen", "toolkit.models.wuerstchen.config:WuerstchenModelConfig",
           "toolkit.models.wuerstchen.adapter:WuerstchenAdapter"),
    Family("zimage", "toolkit.models.zimage.config:ZImageModelConfig", "toolkit.models.zimage.adapter:ZImageAdapter",
           "toolkit.models.zimage.files:zimage_files"),
)}


def _load(reference: str) -> Any:
    module, name = reference.split(":")
    return getattr(importlib.import_module(module), name)


def available_archs() -> list[str]:
    return sorted(FAMILIES)


def family(arch: str) -> Family:
    if arch not in FAMILIES:
        raise ValueError(f"unknown model.arch '{arch}' (known: {', '.join(available_archs())})")
    return FAMILIES[arch]


def config_class(arch: str) -> type[ModelConfigBase]:
    return _load(family(arch).config)


def config_classes() -> list[type[ModelConfigBase]]:
    return [config_class(arch) for arch in available_archs()]


def family_facts(arch: str) -> FamilyFacts:
    return config_class(arch).facts


def model_config(**values: Any) -> ModelConfigBase:
    """A `model` section for `values["arch"]` (tools and tests that build one without a job file)."""
    return config_class(values.get("arch", "")).model_validate(values)


def family_files(arch: str) -> FamilyFiles | None:
    """What the family takes as single files (None: a family that reads only its denoiser from a file so far)."""
    reference = family(arch).files
    return _load(reference)() if reference else None


def get_adapter_class(arch: str) -> type[ModelAdapter]:
    return _load(family(arch).adapter)
