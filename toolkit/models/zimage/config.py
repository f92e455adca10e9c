"""`model` keys of Z-Image (`arch: zimage`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from toolkit.models.config import FamilyFacts, ModelConfigBase, QuantizedBaseOptions, SamplingModelConfig

FACTS = FamilyFacts(title="Z-Image")


class ZImageModelConfig(QuantizedBaseOptions, ModelConfigBase):
    """`model` with `arch: zimage`: Z-Image (a single-stream DiT, Qwen3 text encoder, 16-channel VAE)."""

    arch: Literal["zimage"] = Field(..., description="zimage: Z-Image.",
                                    json_schema_extra={"aka": ["model_type", "base_model"]})
    single_file_config: str | None = Field(
        None, description="For a single-file transformer: the folder or hub id that gives the transformer config, "
        "text encoder, tokenizer, VAE and scheduler; default Tongyi-MAI/Z-Image-Turbo.")
    sampling: SamplingModelConfig | None = Field(
        None, description="A separate transformer (e.g. Turbo) for sample images; the LoRA being trained is applied "
        "to it through shared tensors.")

    facts: ClassVar[FamilyFacts] = FACTS
