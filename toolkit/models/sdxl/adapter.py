"""Stable Diffusion XL: UNet2DConditionModel with `text_time` added conditioning, CLIP-L and bigG text encoders,
VAE, DDPM noise (epsilon or v-prediction)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from toolkit.device import memory_debug, to_device
from toolkit.errors import UserError
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
    run_in_own_dtype,
)
from toolkit.models.config import is_single_file
from toolkit.models.sd_common import StableDiffusionAdapter
from toolkit.models.sdxl.config import FACTS, SDXLModelConfig
from toolkit.models.sdxl.names import sgm_unet_renames
from toolkit.models.sdxl.tiny import ensure_tiny_sdxl
from toolkit.paths import normalize_path


class SDXLSampling(SamplingParts):
    default_guidance_scale = 5.0

    def pipeline(self) -> StableDiffusionXLPipeline:
        a = self.adapter
        return StableDiffusionXLPipeline(
            vae=a.vae, text_encoder=a.text_encoder, text_encoder_2=a.text_encoder_2, tokenizer=a.tokenizer,
            tokenizer_2=a.tokenizer_2, unet=a.unet, scheduler=EulerDiscreteScheduler.from_config(a.scheduler.config),
        )

    def conditioning(self, prompt: str, negative: str) -> dict[str, Any]:
        """The pipeline's own `encode_prompt` (an empty negative prompt is zeros, as the pipeline makes it), so the
        text encoders can leave before the UNet samples."""
        pipe = self.pipeline()
        embeds, negative_embeds, pooled, negative_pooled = pipe.encode_prompt(
            prompt, device=self.adapter.text_encoder.device, num_images_per_prompt=1,
            do_classifier_free_guidance=True, negative_prompt=negative or None)
        return {"prompt_embeds": embeds, "negative_prompt_embeds": negative_embeds,
                "pooled_prompt_embeds": pooled, "negative_pooled_prompt_embeds": negative_pooled}


class SDXLAdapter(StableDiffusionAdapter):
    arch = "sdxl"
    facts = FACTS
    files = LoraFileFormat(prefix="unet", comfy_prefix="lora_unet", kohya_base_model="sdxl_base_v1-0",
                           modelspec_architecture="stable-diffusion-xl-v1-base/lora", comfy_renames=sgm_unet_renames)
    text_rules = ClipTextRules
    sampling_parts = SDXLSampling
    sharded_blocks = ("down_blocks.*.attentions", "down_blocks.*.resnets", "mid_block.attentions", "mid_block.resnets",
                      "up_blocks.*.attentions", "up_blocks.*.resnets")

    def __init__(self, unet, vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2, scheduler, source: str,
                 vae_source: str | None = None):
        self.init_denoiser(unet, vae, scheduler, source)
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.tokenizer = tokenizer
        self.tokenizer_2 = tokenizer_2
        self.vae_source = vae_source or source

    # ---- loading -----------------------------------------------------------------------------------

    @classmethod
    def load(cls, model_cfg: SDXLModelConfig, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False, sampling_models: bool = True,
             empty_denoiser: bool = False) -> SDXLAdapter:
        source = normalize_path(model_cfg.name_or_path)
        if source == "tiny":
            source = str(ensure_tiny_sdxl())
        with memory_debug("model load", debug_memory):
            if source.endswith((".safetensors", ".ckpt")):
                parts = cls._load_single_file(source, model_cfg.single_file_config, dtype)
            else:
                parts = cls._load_folder(source, model_cfg, dtype, empty_denoiser)
            unet, vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2, scheduler = parts
            vae_source = (normalize_path(model_cfg.vae_name_or_path, "model.vae_name_or_path")
                          if model_cfg.vae_name_or_path else None)
            if vae_source:
                vae = cls._load_vae(vae_source, model_cfg, source, dtype)
            vae = cls._vae_in_safe_dtype(vae, dtype)
        scheduler = ddpm_scheduler(scheduler, model_cfg.prediction_type)
        adapter = cls(unet, vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2, scheduler, source, vae_source)
        place_frozen(adapter.unet, [adapter.vae, adapter.text_encoder, adapter.text_encoder_2], device,
                     model_cfg.low_vram)
        return adapter

    @staticmethod
    def _load_folder(source: str, model_cfg: SDXLModelConfig, dtype: torch.dtype, empty_denoiser: bool = False) -> tuple:
        kw: dict[str, Any] = {"variant": model_cfg.variant, "revision": model_cfg.revision}
        unet = pretrained_denoiser(UNet2DConditionModel, source, "unet", dtype, empty_denoiser, **kw)
        vae = AutoencoderKL.from_pretrained(source, subfolder="vae", torch_dtype=dtype, **kw)
        text_encoder = CLIPTextModel.from_pretrained(source, subfolder="text_encoder", dtype=dtype, **kw)
        text_encoder_2 = CLIPTextModelWithProjection.from_pretrained(source, subfolder="text_encoder_2", dtype=dtype,
                                                                     **kw)
        tokenizer = CLIPTokenizer.from_pretrained(source, subfolder="tokenizer", revision=model_cfg.revision)
        tokenizer_2 = CLIPTokenizer.from_pretrained(source, subfolder="tokenizer_2", revision=model_cfg.revision)
        scheduler = DDPMScheduler.from_pretrained(source, subfolder="scheduler", revision=model_cfg.revision)
        return unet, vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2, scheduler

    @classmethod
    def _load_single_file(cls, source: str, config: str | None, dtype: torch.dtype) -> tuple:
        pipe, scheduler = cls.single_file_pipeline(StableDiffusionXLPipeline, source, config, dtype)
        return (pipe.unet, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.tokenizer, pipe.tokenizer_2,
                scheduler)

    @staticmethod
    def _load_vae(vae_source: str, model_cfg: SDXLModelConfig, source: str, dtype: torch.dtype) -> AutoencoderKL:
        """`model.vae_name_or_path`: a VAE folder or hub id (its own, or a pipeline's `vae/`), or a single file whose
        config is the base model's VAE config (`single_file_config` for a single-file base)."""
        if is_single_file(vae_source):
            if not Path(vae_source).is_file():
                raise FileNotFoundError(f"model.vae_name_or_path: file not found: {vae_source}")
            config = model_cfg.single_file_config if is_single_file(source) else source
            if config is None:  # the job file's check says so first (SDXLModelConfig.problems)
                raise UserError("model.vae_name_or_path: a single-file VAE beside a single-file model needs "
                                "model.single_file_config (a diffusers SDXL folder or hub id) for its config")
            return AutoencoderKL.from_single_file(vae_source, config=config, subfolder="vae", torch_dtype=dtype,
                                                  local_files_only=Path(config).is_dir())
        subfolder = "vae" if (Path(vae_source) / "vae" / "config.json").is_file() else None
        return AutoencoderKL.from_pretrained(vae_source, subfolder=subfolder, torch_dtype=dtype,
                                             revision=model_cfg.revision if subfolder else None)

    @staticmethod
    def _vae_in_safe_dtype(vae: AutoencoderKL, dtype: torch.dtype) -> AutoencoderKL:
        """The stock SDXL VAE overflows in float16 (NaN latents and images): where its config says so
        (`force_upcast`), it runs in float32, decoding the float16 latents the pipeline hands it."""
        if dtype == torch.float16 and vae.config.force_upcast:
            vae = vae.to(torch.float32)
            run_in_own_dtype(vae, [m for m in (vae.post_quant_conv, vae.decoder) if m is not None])
        return vae

    # ---- text and images ---------------------------------------------------------------------------

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """As StableDiffusionXLPipeline.encode_prompt: hidden layer -2 of both encoders side by side, and the second
        encoder's projected pooled output."""
        hidden, lengths, pooled = [], None, None
        for tokenizer, encoder in ((self.tokenizer, self.text_encoder), (self.tokenizer_2, self.text_encoder_2)):
            tokens = self.tokenize(tokenizer, prompts, tokenizer.model_max_length)
            with self.text_grad():
                output = encoder(to_device(tokens.input_ids, first_weight(encoder).device), output_hidden_states=True)
            hidden.append(output.hidden_states[-2])
            if lengths is None:
                lengths = tokens.attention_mask.sum(dim=1)
            pooled = output[0]
        return PromptEmbeds(torch.cat(hidden, dim=-1), lengths=lengths, pooled=pooled)

    def text_encoder_components(self) -> list[LoraComponent]:
        return [text_encoder_component(self.text_encoder, "text_encoder", "lora_te1"),
                text_encoder_component(self.text_encoder_2, "text_encoder_2", "lora_te2")]

    def text_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.text_encoder, self.text_encoder_2]

    def encoder_identity(self, part: str) -> str:
        if part == "image":
            return encoder_identity(self.arch, part, self.vae_source, self.vae)
        first = encoder_identity(self.arch, part, self.source, self.text_encoder)
        return encoder_identity(self.arch, part, self.source, self.text_encoder_2, extra=first)

    # ---- the denoiser ------------------------------------------------------------------------------

    def default_image_sizes(self, latents: torch.Tensor) -> torch.Tensor:
        """Size conditioning of an uncropped image at the latents' size (original = target, crop 0, 0)."""
        height, width = latents.shape[-2] * self.vae_scale, latents.shape[-1] * self.vae_scale
        return torch.tensor([[height, width, 0, 0, height, width]]).expand(latents.shape[0], 6)

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: torch.nn.Module | None = None, image_sizes: torch.Tensor | None = None,
                expert: Expert | None = None,
                references: list[torch.Tensor] | None = None) -> torch.Tensor:
        dtype = self.compute_dtype
        denoiser = module if module is not None else self._denoiser
        sizes = image_sizes if image_sizes is not None else self.default_image_sizes(noisy)
        added = {"text_embeds": embeds.pooled.to(dtype), "time_ids": to_device(sizes, noisy.device, dtype)}
        return denoiser(noisy.to(dtype), timesteps, encoder_hidden_states=embeds.embeds.to(dtype),
                        added_cond_kwargs=added).sample

    def lora_target_modules(self) -> list[str]:
        # every linear layer of the transformer blocks, kohya's SDXL default
        return ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out"]
