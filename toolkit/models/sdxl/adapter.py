"""Stable Diffusion XL: UNet2DConditionModel with `text_time` added conditioning, CLIP-L and bigG text encoders,
VAE, DDPM noise (epsilon or v-prediction)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from toolkit.device import memory_debug, to_device
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
    run_in_own_dtype,
)
from toolkit.models.base_parts import CLIP_EXTRAS, BaseParts, ldm_vae_converter
from toolkit.models.part_kinds import open_clip_layout
from toolkit.models.sd_common import StableDiffusionAdapter, ldm_unet_converter
from toolkit.models.sdxl.config import FACTS, SDXLModelConfig
from toolkit.models.sdxl.files import sdxl_files
from toolkit.models.sdxl.names import sgm_unet_renames
from toolkit.models.sdxl.tiny import ensure_tiny_sdxl


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


#: where a single-file checkpoint's parts not found in it (nor named as files) come from, by default
DEFAULT_COMPONENTS = "stabilityai/stable-diffusion-xl-base-1.0"


class SecondTokenizer:
    """SDXL's second tokenizer: CLIP's, padding with "!" (as the pipeline's `tokenizer_2` does; ComfyUI keeps one
    CLIP tokenizer for both encoders and pads the second with "!" too)."""

    @staticmethod
    def from_pretrained(*args, **kwargs) -> CLIPTokenizer:
        return CLIPTokenizer.from_pretrained(*args, pad_token="!", **kwargs)


def open_clip_converter(part, config: dict):
    """diffusers' converter of open_clip's names (an SDXL checkpoint's CLIP-G); none for transformers' names."""
    if not open_clip_layout(part):
        return None
    from types import SimpleNamespace

    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

    text_model = SimpleNamespace(config=SimpleNamespace(hidden_size=config["hidden_size"]))
    return lambda checkpoint: convert_open_clip_checkpoint(text_model, checkpoint, prefix="")


class SDXLAdapter(StableDiffusionAdapter):
    arch = "sdxl"
    facts = FACTS
    files = LoraFileFormat(prefix="unet", comfy_prefix="lora_unet", kohya_base_model="sdxl_base_v1-0",
                           modelspec_architecture="stable-diffusion-xl-v1-base/lora", comfy_renames=sgm_unet_renames)
    text_rules = ClipTextRules
    sampling_parts = SDXLSampling
    config_class = SDXLModelConfig
    tiny_preset = staticmethod(ensure_tiny_sdxl)
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
        with memory_debug("model load", debug_memory):
            adapter = cls.assemble(model_cfg, cls.resolve_source(model_cfg.name_or_path), dtype, empty_denoiser)
        place_frozen(adapter.unet, [adapter.vae, adapter.text_encoder, adapter.text_encoder_2], device,
                     model_cfg.low_vram)
        return adapter

    @classmethod
    def assemble(cls, model_cfg: SDXLModelConfig, source: str | None, dtype: torch.dtype, empty_denoiser: bool = False,
                 meta: bool = False) -> SDXLAdapter:
        """The adapter over its parts, each from where the config says (toolkit/models/base_parts.py), unplaced."""
        parts = BaseParts(sdxl_files(), model_cfg, source, cls.resolve_source, lambda _: DEFAULT_COMPONENTS, meta)
        unet = parts.denoiser(UNet2DConditionModel, "unet", dtype, empty_denoiser, converter=ldm_unet_converter)
        encoders = parts.text_encoders(
            {"clip_l": ("text_encoder", lambda c: CLIPTextModel(CLIPTextConfig(**c)), CLIPTextModel),
             "clip_g": ("text_encoder_2", lambda c: CLIPTextModelWithProjection(CLIPTextConfig(**c)),
                        CLIPTextModelWithProjection)},
            dtype, ignore={"clip_l": CLIP_EXTRAS, "clip_g": CLIP_EXTRAS}, converters={"clip_g": open_clip_converter})
        vae = parts.vae(AutoencoderKL, dtype, converter=ldm_vae_converter)
        vae = vae if meta else cls._vae_in_safe_dtype(vae, dtype)
        tokenizers = parts.tokenizers({"tokenizer": CLIPTokenizer, "tokenizer_2": SecondTokenizer})
        scheduler = ddpm_scheduler(parts.scheduler(DDPMScheduler), model_cfg.prediction_type)
        vae_source = parts.origins.get("vae") if model_cfg.vae_name_or_path else None
        adapter = cls(unet, vae, encoders["clip_l"], encoders["clip_g"], tokenizers["tokenizer"],
                      tokenizers["tokenizer_2"], scheduler, source or "", vae_source)
        adapter.parts_from = parts.origins
        return adapter


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
