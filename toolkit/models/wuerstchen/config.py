"""`model` keys of the Wuerstchen v2 prior (`arch: wuerstchen`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from toolkit.models.config import FamilyFacts, ModelConfigBase, TextFilesOptions

FACTS = FamilyFacts(title="Wuerstchen v2 prior", sampling_needs="decoder_name_or_path")


class WuerstchenModelConfig(TextFilesOptions, ModelConfigBase):
    """`model` with `arch: wuerstchen`: the Wuerstchen v2 prior (stage C) on EfficientNetV2-S image embeddings."""

    arch: Literal["wuerstchen"] = Field(..., description="wuerstchen: the Wuerstchen v2 prior.",
                                        json_schema_extra={"aka": ["model_type", "base_model"]})
    image_encoder_path: str = Field(
        ..., description="The EfficientNetV2-S image encoder's weights: Wuerstchen's stage-B checkpoint (its "
        "`effnet_state_dict` entry) or a .safetensors file with the same keys; `tiny` with the tiny model.")
    decoder_name_or_path: str | None = Field(
        None, description="The decoder pipeline (folder or hub id, e.g. warp-ai/wuerstchen) that turns the prior's "
        "image embeddings into sample images; needed only for `sample.prompts`.")

    facts: ClassVar[FamilyFacts] = FACTS
