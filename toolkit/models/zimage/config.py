"""`model` keys of Z-Image (`arch: zimage`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from toolkit.models.config import (
    FamilyFacts,
    ModelConfigBase,
    PartFilesOptions,
    QuantizedBaseOptions,
    SamplingModelConfig,
)

FACTS = FamilyFacts(title="Z-Image")


class ZImageModelConfig(PartFilesOptions, QuantizedBaseOptions, ModelConfigBase):
    """`model` with `arch: zimage`: Z-Image (a single-stream DiT, Qwen3 text encoder, 16-channel VAE)."""

    arch: Literal["zimage"] = Field(..., description="zimage: Z-Image.",
                                    json_schema_extra={"aka": ["model_type", "base_model"]})
    single_file_config: str | None = Field(
        None, description="For a single-file transformer: a diffusers folder or hub id whose configs describe it (for "
        "a file of no variant difftune knows) and which gives the parts no file is named for. Default: Z-Image's and "
        "Z-Image-Turbo's configs ship with difftune; such parts come from Tongyi-MAI/Z-Image-Turbo.")
    sampling: SamplingModelConfig | None = Field(
        None, description="A separate transformer (e.g. Turbo) for sample images; the LoRA being trained is applied "
        "to it through shared tensors.")

    facts: ClassVar[FamilyFacts] = FACTS
