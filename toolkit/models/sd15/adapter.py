"""Stable Diffusion 1.x: UNet2DConditionModel + CLIP text encoder + VAE + DDPM noise."""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from toolkit.device import as_dtype, memory_debug, to_device
from toolkit.models.base import (
    Expert,
    LoraComponent,
    LoraFileFormat,
    PromptEmbeds,
    SamplingParts,
    text_encoder_component,
)
from toolkit.models.common import (
    ClipTextRules,
    ddpm_scheduler,
    encoder_identity,
    first_weight,
    place_frozen,
)
from toolkit.models.base_parts import CLIP_EXTRAS, BaseParts, ldm_vae_converter
from toolkit.models.sd15.config import FACTS, SD15ModelConfig
from toolkit.models.sd15.files import sd15_files
from toolkit.models.sd15.tiny import ensure_tiny_sd15
from toolkit.models.sd_common import StableDiffusionAdapter, ldm_unet_converter


class SD15Sampling(SamplingParts):
    def pipeline(self) -> StableDiffusionPipeline:
        a = self.adapter
        return StableDiffusionPipeline(
            vae=a.vae,
            text_encoder=a.text_encoder,
            tokenizer=a.tokenizer,
            unet=a.unet,
            scheduler=EulerDiscreteScheduler.from_config(a.scheduler.config),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )


#: where a single-file checkpoint's parts not found in it (nor named as files) come from, by default
DEFAULT_COMPONENTS = "stable-diffusion-v1-5/stable-diffusion-v1-5"


class SD15Adapter(StableDiffusionAdapter):
    arch = "sd15"
    facts = FACTS
    files = LoraFileFormat(prefix="unet", comfy_prefix="lora_unet", kohya_base_model="sd_v1",
                           modelspec_architecture="stable-diffusion-v1/lora")
    text_rules = ClipTextRules
    sampling_parts = SD15Sampling
    config_class = SD15ModelConfig
    tiny_preset = staticmethod(ensure_tiny_sd15)
    sharded_blocks = ("down_blocks.*.attentions", "down_blocks.*.resnets", "mid_block.attentions", "mid_block.resnets",
                      "up_blocks.*.attentions", "up_blocks.*.resnets")

    def __init__(self, unet, vae, text_encoder, tokenizer, scheduler, source: str):
        self.init_denoiser(unet, vae, scheduler, source)
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, model_cfg: SD15ModelConfig, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False, sampling_models: bool = True,
             empty_denoiser: bool = False) -> SD15Adapter:
        with memory_debug("model load", debug_memory):
            adapter = cls.assemble(model_cfg, cls.resolve_source(model_cfg.name_or_path), dtype, empty_denoiser)
        place_frozen(adapter.unet, [adapter.vae, adapter.text_encoder], device, model_cfg.low_vram)
        return adapter

    @classmethod
    def assemble(cls, model_cfg: SD15ModelConfig, source: str | None, dtype: torch.dtype, empty_denoiser: bool = False,
                 meta: bool = False) -> SD15Adapter:
        """The adapter over its parts, each from where the config says (toolkit/models/base_parts.py), unplaced."""
        parts = BaseParts(sd15_files(), model_cfg, source, cls.resolve_source, lambda _: DEFAULT_COMPONENTS, meta)
        unet = parts.denoiser(UNet2DConditionModel, "unet", dtype, empty_denoiser, converter=ldm_unet_converter)
        text_encoder = parts.text_encoders(
            {"clip_l": ("text_encoder", lambda c: CLIPTextModel(CLIPTextConfig(**c)), CLIPTextModel)},
            dtype, ignore={"clip_l": CLIP_EXTRAS})["clip_l"]
        vae = parts.vae(AutoencoderKL, dtype, converter=ldm_vae_converter)
        tokenizer = parts.tokenizers({"tokenizer": CLIPTokenizer})["tokenizer"]
        scheduler = ddpm_scheduler(parts.scheduler(DDPMScheduler), model_cfg.prediction_type)
        adapter = cls(unet, vae, text_encoder, tokenizer, scheduler, source or "")
        adapter.parts_from = parts.origins
        return adapter


    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        tokens = self.tokenize(self.tokenizer, prompts, self.tokenizer.model_max_length)
        with self.text_grad():
            embeds = self.text_encoder(to_device(tokens.input_ids, first_weight(self.text_encoder).device))[0]
        return PromptEmbeds(embeds, lengths=tokens.attention_mask.sum(dim=1))

    def text_encoder_components(self) -> list[LoraComponent]:
        return [text_encoder_component(self.text_encoder, "text_encoder", "lora_te")]

    def text_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.text_encoder]

    def encoder_identity(self, part: str) -> str:
        return encoder_identity(self.arch, part, self.source, {"image": self.vae, "text": self.text_encoder}[part])

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: torch.nn.Module | None = None, image_sizes: torch.Tensor | None = None,
                expert: Expert | None = None,
                references: list[torch.Tensor] | None = None) -> torch.Tensor:
        unet_dtype = self.compute_dtype
        denoiser = module if module is not None else self._denoiser
        return denoiser(as_dtype(noisy, unet_dtype), timesteps,
                        encoder_hidden_states=as_dtype(embeds.embeds, unet_dtype)).sample

    def lora_target_modules(self) -> list[str]:
        return ["to_q", "to_k", "to_v", "to_out.0"]
