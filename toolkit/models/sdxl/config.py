"""`model` keys of Stable Diffusion XL (`arch: sdxl`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from toolkit.models.config import DDPMOptions, FamilyFacts, ModelConfigBase, PartFilesOptions

FACTS = FamilyFacts(title="Stable Diffusion XL", conv_layers=True, ddpm_noise=True, guidance_rescale=True,
                    text_encoder_lora=True, size_conditioning=True)


class SDXLModelConfig(PartFilesOptions, ModelConfigBase, DDPMOptions):
    """`model` with `arch: sdxl`: Stable Diffusion XL and its fine-tunes (UNet, CLIP-L and bigG text encoders,
    VAE), from a diffusers folder, a hub id or a single-file checkpoint."""

    arch: Literal["sdxl"] = Field(..., description="sdxl: Stable Diffusion XL (base 1.0 and fine-tunes such as Pony, "
                                  "Illustrious, NoobAI).", json_schema_extra={"aka": ["model_type", "base_model"]})
    single_file_config: str | None = Field(
        None, description="For a single-file checkpoint: a diffusers SDXL folder or hub id whose configs describe it "
        "(for a file of no variant difftune knows) and which gives the parts neither the file holds nor a file is "
        "named for. Default: SDXL 1.0's configs ship with difftune; such parts come from "
        "stabilityai/stable-diffusion-xl-base-1.0.")

    facts: ClassVar[FamilyFacts] = FACTS
