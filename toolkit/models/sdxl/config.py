"""`model` keys of Stable Diffusion XL (`arch: sdxl`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from toolkit.config.base import Problem
from toolkit.models.config import DDPMOptions, FamilyFacts, ModelConfigBase, is_single_file

FACTS = FamilyFacts(title="Stable Diffusion XL", conv_layers=True, ddpm_noise=True, guidance_rescale=True,
                    text_encoder_lora=True, size_conditioning=True)


class SDXLModelConfig(ModelConfigBase, DDPMOptions):
    """`model` with `arch: sdxl`: Stable Diffusion XL and its fine-tunes (UNet, CLIP-L and bigG text encoders,
    VAE), from a diffusers folder, a hub id or a single-file checkpoint."""

    arch: Literal["sdxl"] = Field(..., description="sdxl: Stable Diffusion XL (base 1.0 and fine-tunes such as Pony, "
                                  "Illustrious, NoobAI).", json_schema_extra={"aka": ["model_type", "base_model"]})
    single_file_config: str | None = Field(
        None, description="For a single-file checkpoint: a diffusers SDXL folder or hub id whose component configs "
        "(and tokenizers) describe it. Default: diffusers picks one from the checkpoint's keys and fetches its "
        "configs from the hub; give a local folder to load offline.")
    vae_name_or_path: str | None = Field(
        None, description="Another VAE: a diffusers folder or hub id (e.g. madebyollin/sdxl-vae-fp16-fix), or a "
        "single-file .safetensors. The stock SDXL VAE overflows in float16, so it runs in float32 when `dtype` is "
        "float16 (as its config's `force_upcast` says); the fp16-fix VAE runs in float16.",
        json_schema_extra={"aka": ["vae", "vae_path"]})

    facts: ClassVar[FamilyFacts] = FACTS

    def problems(self) -> list[Problem]:
        """A single-file VAE takes its config from the base model's folder: a single-file base has none."""
        if (is_single_file(self.vae_name_or_path) and is_single_file(self.name_or_path)
                and self.single_file_config is None):
            return [("vae_name_or_path", "a single-file VAE beside a single-file model needs model.single_file_config "
                     "(a diffusers SDXL folder or hub id) for its config")]
        return []

