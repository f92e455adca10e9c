"""`model` keys of Stable Diffusion 1.x (`arch: sd15`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from toolkit.models.config import DDPMOptions, FamilyFacts, ModelConfigBase, PartFilesOptions

FACTS = FamilyFacts(title="Stable Diffusion 1.x", conv_layers=True, ddpm_noise=True, guidance_rescale=True,
                    text_encoder_lora=True)


class SD15ModelConfig(PartFilesOptions, ModelConfigBase, DDPMOptions):
    """`model` with `arch: sd15`: Stable Diffusion 1.x (UNet, CLIP text encoder, VAE)."""

    arch: Literal["sd15"] = Field(..., description="sd15: Stable Diffusion 1.x.",
                                  json_schema_extra={"aka": ["model_type", "base_model"]})
    single_file_config: str | None = Field(
        None, description="For a single-file checkpoint: a diffusers folder or hub id whose configs describe it (for "
        "a file of no variant difftune knows) and which gives the parts neither the file holds nor a file is named "
        "for. Default: SD 1.5's configs ship with difftune; such parts come from "
        "stable-diffusion-v1-5/stable-diffusion-v1-5.")

    facts: ClassVar[FamilyFacts] = FACTS
