"""Stable Diffusion 1.x: UNet2DConditionModel + CLIP text encoder + VAE + DDPM noise."""

from __future__ import annotations

from pathlib import Path
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

from toolkit.device import memory_debug, to_device
from toolkit.diffusion.schedules import DDPMNoiseSchedule
from toolkit.models.base import (
    LatentDist,
    LoraComponent,
    LoraFileFormat,
    ModelAdapter,
    PromptEmbeds,
    SamplingParts,
    clip_text_model_renames,
)
from toolkit.models.common import (
    CLIP_TEXT_TARGETS,
    ClipTextRules,
    ddpm_scheduler,
    encoder_identity,
    place_frozen,
    vae_latent_dist,
    vae_latents,
)
from toolkit.models.sd15.config import FACTS, SD15ModelConfig
from toolkit.models.sd15.tiny import ensure_tiny_sd15
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


class SD15Adapter(ModelAdapter):
    arch = "sd15"
    facts = FACTS
    files = LoraFileFormat(prefix="unet", comfy_prefix="lora_unet", kohya_base_model="sd_v1",
                           modelspec_architecture="stable-diffusion-v1/lora")
    text_rules = ClipTextRules
    sampling_parts = SD15Sampling

    def __init__(self, unet, vae, text_encoder, tokenizer, scheduler, source: str):
        self.unet = unet
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.source = source
        self.noise_schedule = DDPMNoiseSchedule(scheduler)
        vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        unet_scale = 2 ** (len(unet.config.block_out_channels) - 1)
        self.divisor = vae_scale * unet_scale
        self._denoiser: torch.nn.Module = unet
        #: the UNet's dtype, read once (diffusers' `.dtype` walks every submodule on each call)
        self.compute_dtype = unet.dtype

    @classmethod
    def load(cls, model_cfg: SD15ModelConfig, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False, sampling_models: bool = True) -> SD15Adapter:
        source = normalize_path(model_cfg.name_or_path)
        if source == "tiny":
            source = str(ensure_tiny_sd15())
        with memory_debug("model load", debug_memory):
            if source.endswith((".safetensors", ".ckpt")):
                parts = cls._load_single_file(source, model_cfg.single_file_config, dtype)
            else:
                parts = cls._load_folder(source, model_cfg, dtype)
        unet, vae, text_encoder, tokenizer, scheduler = parts
        adapter = cls(unet, vae, text_encoder, tokenizer, ddpm_scheduler(scheduler, model_cfg.prediction_type), source)
        place_frozen(adapter.unet, [adapter.vae, adapter.text_encoder], device, model_cfg.low_vram)
        return adapter

    @staticmethod
    def _load_folder(source: str, model_cfg: SD15ModelConfig, dtype: torch.dtype) -> tuple:
        kw: dict[str, Any] = {"variant": model_cfg.variant, "revision": model_cfg.revision}
        unet = UNet2DConditionModel.from_pretrained(source, subfolder="unet", torch_dtype=dtype, **kw)
        vae = AutoencoderKL.from_pretrained(source, subfolder="vae", torch_dtype=dtype, **kw)
        text_encoder = CLIPTextModel.from_pretrained(source, subfolder="text_encoder", dtype=dtype, **kw)
        tokenizer = CLIPTokenizer.from_pretrained(source, subfolder="tokenizer", revision=model_cfg.revision)
        scheduler = DDPMScheduler.from_pretrained(source, subfolder="scheduler", revision=model_cfg.revision)
        return unet, vae, text_encoder, tokenizer, scheduler

    @staticmethod
    def _load_single_file(source: str, config: str | None, dtype: torch.dtype) -> tuple:
        if not Path(source).is_file():
            raise FileNotFoundError(f"model file not found: {source}")
        local_config = config is not None and Path(config).is_dir()
        pipe = StableDiffusionPipeline.from_single_file(
            source, config=config, local_files_only=local_config, torch_dtype=dtype
        )
        scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
        return pipe.unet, pipe.vae, pipe.text_encoder, pipe.tokenizer, scheduler

    def use_zero_terminal_snr(self) -> None:
        self.scheduler = ddpm_scheduler(self.scheduler, zero_terminal_snr=True)
        self.noise_schedule = DDPMNoiseSchedule(self.scheduler)

    @property
    def device(self) -> torch.device:
        # the first parameter: diffusers' `.device` walks every submodule (milliseconds per call, per step)
        return next(self.unet.parameters()).device

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        tokens = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        )
        with self.text_grad():
            embeds = self.text_encoder(to_device(tokens.input_ids, self.text_encoder.device))[0]
        return PromptEmbeds(embeds, lengths=tokens.attention_mask.sum(dim=1))

    def text_encoder_components(self) -> list[LoraComponent]:
        te = self.text_encoder
        return [LoraComponent(te, "text_encoder", "lora_te", clip_text_model_renames(te))]

    def text_lora_target_modules(self) -> list[str]:
        return list(CLIP_TEXT_TARGETS)

    def encode_latent_dist(self, pixels: torch.Tensor) -> LatentDist:
        return vae_latent_dist(self.vae, pixels)

    def latents_from_dist(self, dist: LatentDist, generator: torch.Generator | None = None) -> torch.Tensor:
        return vae_latents(dist, generator, self.vae.config.scaling_factor)

    def image_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.vae]

    def text_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.text_encoder]

    def encoder_identity(self, part: str) -> str:
        return encoder_identity(self.arch, part, self.source, {"image": self.vae, "text": self.text_encoder}[part])

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: torch.nn.Module | None = None, image_sizes: torch.Tensor | None = None) -> torch.Tensor:
        unet_dtype = self.compute_dtype
        denoiser = module if module is not None else self._denoiser
        return denoiser(noisy.to(unet_dtype), timesteps, encoder_hidden_states=embeds.embeds.to(unet_dtype)).sample

    def trainable_module(self) -> torch.nn.Module:
        return self.unet

    def lora_target_modules(self) -> list[str]:
        return ["to_q", "to_k", "to_v", "to_out.0"]

    def conv_target_modules(self) -> list[str]:
        # the resnets' 3x3 convs, their 1x1 shortcuts and the resampling convs: kohya's LoCon set
        return ["conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv"]

    def use_for_training(self, module: torch.nn.Module) -> None:
        self._denoiser = module

    def describe(self) -> dict[str, str]:
        return {"arch": self.arch, "base_model": self.source, "prediction_type": self.noise_schedule.prediction_type}
