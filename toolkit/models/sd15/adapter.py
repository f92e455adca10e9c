"""Stable Diffusion 1.x: UNet2DConditionModel + CLIP text encoder + VAE + DDPM noise."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextModel, CLIPTokenizer

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
    pretrained_denoiser,
)
from toolkit.models.sd15.config import FACTS, SD15ModelConfig
from toolkit.models.sd15.tiny import ensure_tiny_sd15
from toolkit.models.sd_common import StableDiffusionAdapter
from toolkit.paths import normalize_path


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


class SD15Adapter(StableDiffusionAdapter):
    arch = "sd15"
    facts = FACTS
    files = LoraFileFormat(prefix="unet", comfy_prefix="lora_unet", kohya_base_model="sd_v1",
                           modelspec_architecture="stable-diffusion-v1/lora")
    text_rules = ClipTextRules
    sampling_parts = SD15Sampling
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
        source = normalize_path(model_cfg.name_or_path)
        if source == "tiny":
            source = str(ensure_tiny_sd15())
        with memory_debug("model load", debug_memory):
            if source.endswith((".safetensors", ".ckpt")):
                parts = cls._load_single_file(source, model_cfg.single_file_config, dtype)
            else:
                parts = cls._load_folder(source, model_cfg, dtype, empty_denoiser)
        unet, vae, text_encoder, tokenizer, scheduler = parts
        adapter = cls(unet, vae, text_encoder, tokenizer, ddpm_scheduler(scheduler, model_cfg.prediction_type), source)
        place_frozen(adapter.unet, [adapter.vae, adapter.text_encoder], device, model_cfg.low_vram)
        return adapter

    @staticmethod
    def _load_folder(source: str, model_cfg: SD15ModelConfig, dtype: torch.dtype, empty_denoiser: bool = False) -> tuple:
        kw: dict[str, Any] = {"variant": model_cfg.variant, "revision": model_cfg.revision}
        unet = pretrained_denoiser(UNet2DConditionModel, source, "unet", dtype, empty_denoiser, **kw)
        vae = AutoencoderKL.from_pretrained(source, subfolder="vae", torch_dtype=dtype, **kw)
        text_encoder = CLIPTextModel.from_pretrained(source, subfolder="text_encoder", dtype=dtype, **kw)
        tokenizer = CLIPTokenizer.from_pretrained(source, subfolder="tokenizer", revision=model_cfg.revision)
        scheduler = DDPMScheduler.from_pretrained(source, subfolder="scheduler", revision=model_cfg.revision)
        return unet, vae, text_encoder, tokenizer, scheduler

    @classmethod
    def _load_single_file(cls, source: str, config: str | None, dtype: torch.dtype) -> tuple:
        pipe, scheduler = cls.single_file_pipeline(StableDiffusionPipeline, source, config, dtype)
        return pipe.unet, pipe.vae, pipe.text_encoder, pipe.tokenizer, scheduler

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
