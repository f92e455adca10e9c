"""`model` keys of Stable Diffusion 1.x (`arch: sd15`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from toolkit.models.config import DDPMOptions, FamilyFacts, ModelConfigBase

FACTS = FamilyFacts(title="Stable Diffusion 1.x", conv_layers=True, ddpm_noise=True, guidance_rescale=True,
                    text_encoder_lora=True)


class SD15ModelConfig(ModelConfigBase, DDPMOptions):
    """`model` with `arch: sd15`: Stable Diffusion 1.x (UNet, CLIP text encoder, VAE)."""

    arch: Literal["sd15"] = Field(..., description="sd15: Stable Diffusion 1.x.",
                                  json_schema_extra={"aka": ["model_type", "base_model"]})
    single_file_config: str | None = Field(
        None, description="For a single-file checkpoint: a diffusers folder or hub id whose component configs "
        "(and tokenizer) describe it. Default: diffusers picks one from the checkpoint's keys and fetches its "
        "configs from the hub; give a local folder to load offline.")

    facts: ClassVar[FamilyFacts] = FACTS
