"""Wuerstchen v2 prior (stage C): text -> 16-channel image embeddings of Wuerstchen's EfficientNetV2-S encoder.

The prior is trained on the image encoder's embeddings (`effnet(x).add(1).div(42)`, 24x24 for a 768 px image);
sample images go through the prior and then the stage-B decoder pipeline.
"""

from __future__ import annotations

import copy
import pickle
from functools import partial
from pathlib import Path
from typing import Any

import torch
from diffusers import DDPMWuerstchenScheduler
from diffusers.pipelines.deprecated.wuerstchen import (
    PaellaVQModel,
    WuerstchenCombinedPipeline,
    WuerstchenDiffNeXt,
    WuerstchenPrior,
)
from safetensors.torch import load_file
from torch import nn
from torchvision.models import efficientnet
from transformers import CLIPTextModel, CLIPTokenizer

from ..config.schema import ModelConfig
from ..device import memory_debug, to_device
from ..paths import normalize_path
from .base import LatentDist, ModelAdapter, PromptEmbeds
from .common import encoder_identity, place_frozen
from .noise_schedules import WuerstchenNoiseSchedule

#: ImageNet normalisation the encoder was trained with
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: decoder denoising steps for sample images (diffusers' default for Wuerstchen's decoder)
DECODER_STEPS = 12
#: EfficientNetV2-S's stages in its `features` Sequential (0 is the stem, 7 the last 1x1 conv)
EFFNET_STAGES = range(1, 7)


def _multiple_of_8(value: float) -> int:
    # torchvision rounds expanded widths to multiples of 8; widths that already are keep the real block layout
    return max(8, round(value / 8) * 8)


class EfficientNetImageEncoder(nn.Module):
    """Wuerstchen's image encoder: EfficientNetV2-S features, a 1x1 conv to `c_latent` channels and a
    BatchNorm2d. torchvision builds the backbone; the key layout (`backbone.*`, `mapper.*`) is that of the
    `effnet_state_dict` in Wuerstchen's stage-B checkpoint. `width` < 1 narrows every stage (tiny models) while
    keeping the stages, layers and keys."""

    def __init__(self, width: float = 1.0, c_latent: int = 16, stage_channels: list[int] | None = None,
                 last_channel: int | None = None):
        super().__init__()
        settings, real_last = efficientnet._efficientnet_conf("efficientnet_v2_s")
        channels = stage_channels or [_multiple_of_8(c * width) for c in
                                      [settings[0].input_channels] + [st.out_channels for st in settings]]
        last_channel = last_channel or _multiple_of_8(real_last * width)
        stages = []
        for index, stage in enumerate(settings):
            stage = copy.copy(stage)
            stage.input_channels, stage.out_channels = channels[index], channels[index + 1]
            stages.append(stage)
        net = efficientnet.EfficientNet(stages, dropout=0.0, last_channel=last_channel,
                                        norm_layer=partial(nn.BatchNorm2d, eps=1e-3))
        self.backbone = net.features
        self.mapper = nn.Sequential(nn.Conv2d(last_channel, c_latent, kernel_size=1, bias=False),
                                    nn.BatchNorm2d(c_latent))
        self.stage_channels = channels

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.mapper(self.backbone(pixels))

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], source: str) -> EfficientNetImageEncoder:
        """An encoder shaped like `state` (stage widths read from its tensors), loaded strictly except for
        BatchNorm's `num_batches_tracked` counters, which conversions often drop and eval mode never reads."""
        if any(key.startswith("backbone.8.") for key in state):
            raise ValueError(f"{source}: an EfficientNetV2-L encoder (it has a backbone.8 stage); the Wuerstchen v2 "
                             "prior needs the V2-S `effnet_state_dict` of model_v2_stage_b.pt")
        try:
            channels = [state["backbone.0.0.weight"].shape[0]] + [_stage_out_channels(state, i) for i in EFFNET_STAGES]
            last_channel, c_latent = state["backbone.7.0.weight"].shape[0], state["mapper.0.weight"].shape[0]
        except KeyError as missing:
            sample = ", ".join(sorted(state)[:3]) or "no tensors"
            raise ValueError(f"{source}: not a Wuerstchen EfficientNet image encoder (no {missing}; found "
                             f"{sample}, ...)") from None
        encoder = cls(c_latent=c_latent, stage_channels=channels, last_channel=last_channel)
        expected = {k: v for k, v in encoder.state_dict().items()
                    if not (k.endswith("num_batches_tracked") and k not in state)}
        problems = _state_problems(expected, state)
        if problems:
            raise ValueError(f"{source}: weights do not fit the EfficientNetV2-S image encoder: {problems}")
        encoder.load_state_dict(state, strict=False)
        return encoder


def _stage_out_channels(state: dict[str, torch.Tensor], stage: int) -> int:
    """A stage's output width: the size of the BatchNorm that ends its first block."""
    prefix = f"backbone.{stage}.0.block."
    blocks = [int(key[len(prefix):].split(".")[0]) for key in state if key.startswith(prefix)]
    if not blocks:
        raise KeyError(f"{prefix}*")
    return state[f"{prefix}{max(blocks)}.1.weight"].shape[0]


def _state_problems(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> str:
    """Missing, unexpected and mis-shaped keys, a few of each, in one line."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    shapes = sorted(k for k in set(expected) & set(given) if expected[k].shape != given[k].shape)
    parts = [f"{label} {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} ({len(keys)})"
             for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)) if keys]
    return "; ".join(parts)


def read_image_encoder_state(path: str) -> dict[str, torch.Tensor]:
    """The encoder's state dict from a .safetensors file, or from a stage-B checkpoint's `effnet_state_dict`."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"model.image_encoder_path: file not found: {path}")
    if path.endswith(".safetensors"):
        return load_file(path)
    try:
        # mmap: a stage-B checkpoint also holds the decoder and its optimizer; only the encoder is read
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError) as error:
        raise ValueError(f"model.image_encoder_path {path}: cannot read it as a plain-tensor checkpoint ({error}); "
                         "extract its `effnet_state_dict` to a .safetensors file") from None
    if isinstance(checkpoint, dict) and "effnet_state_dict" in checkpoint:
        return checkpoint["effnet_state_dict"]
    if isinstance(checkpoint, dict) and "backbone.0.0.weight" in checkpoint:
        return checkpoint
    found = ", ".join(sorted(checkpoint)[:5]) if isinstance(checkpoint, dict) else type(checkpoint).__name__
    raise ValueError(f"model.image_encoder_path {path}: no `effnet_state_dict` in this checkpoint (found {found})")


class WuerstchenSampler:
    """Renders samples through the prior (LoRA active) and the decoder, taking the house's sampling arguments."""

    def __init__(self, pipe: WuerstchenCombinedPipeline):
        self.pipe = pipe

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        self.pipe.set_progress_bar_config(**kwargs)

    def __call__(self, prompt: str, negative_prompt: str | None, num_inference_steps: int, guidance_scale: float,
                 width: int, height: int, generator: torch.Generator):
        return self.pipe(
            prompt=prompt, negative_prompt=negative_prompt, width=width, height=height,
            prior_num_inference_steps=num_inference_steps, prior_guidance_scale=guidance_scale,
            num_inference_steps=DECODER_STEPS, generator=generator,
        )


class WuerstchenAdapter(ModelAdapter):
    arch = "wuerstchen"
    lora_prefix = "prior"  # WuerstchenPriorPipeline.load_lora_weights loads `prior.*` keys into the prior
    # No ComfyUI loader exists for Wuerstchen v2; kohya-style keys under OneTrainer's prefix for the prior.
    comfy_prefix = "lora_prior_unet"
    kohya_base_model = "wuerstchen_v2"
    default_guidance_scale = 4.0  # WuerstchenPriorPipeline's default
    default_save_formats = ("diffusers",)  # ComfyUI has no Wuerstchen v2 loader; `comfy` still writes kohya keys
    #: EfficientNetV2-S reduces the image 32x; the prior is fully convolutional at that size
    divisor = 32

    def __init__(self, prior, text_encoder, tokenizer, scheduler, image_encoder: EfficientNetImageEncoder,
                 decoder: dict[str, Any] | None, sources: dict[str, str]):
        self.prior = prior
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.image_encoder = image_encoder
        self.decoder = decoder
        self.sources = sources
        self.noise_schedule = WuerstchenNoiseSchedule(scheduler)
        self._denoiser: nn.Module = prior
        #: the prior's dtype, read once (diffusers' `.dtype` walks every submodule on each call)
        self.compute_dtype = prior.dtype

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def load(cls, model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False) -> WuerstchenAdapter:
        sources = cls._resolve_sources(model_cfg)
        with memory_debug("model load", debug_memory):
            prior_parts = cls._load_prior_parts(sources["prior"], model_cfg, dtype)
            state = read_image_encoder_state(sources["image_encoder"])
            image_encoder = EfficientNetImageEncoder.from_state_dict(state, sources["image_encoder"]).to(dtype)
            decoder = cls._load_decoder(sources["decoder"], dtype) if "decoder" in sources else None
        adapter = cls(*prior_parts, image_encoder=image_encoder, decoder=decoder, sources=sources)
        # the decoder (sample-only) stays on the CPU until samples render
        place_frozen(adapter.prior, [adapter.text_encoder, adapter.image_encoder], device, model_cfg.low_vram,
                     adapter.sampling_only_modules())
        return adapter

    @staticmethod
    def _resolve_sources(model_cfg: ModelConfig) -> dict[str, str]:
        sources = {"prior": normalize_path(model_cfg.name_or_path),
                   "image_encoder": normalize_path(model_cfg.image_encoder_path or "", "model.image_encoder_path")}
        if model_cfg.decoder_name_or_path:
            sources["decoder"] = normalize_path(model_cfg.decoder_name_or_path, "model.decoder_name_or_path")
        if "tiny" in sources.values():
            from .tiny_wuerstchen import ensure_tiny_wuerstchen

            tiny = ensure_tiny_wuerstchen()
            tiny_parts = {"prior": tiny / "prior", "image_encoder": tiny / "image_encoder.safetensors",
                          "decoder": tiny / "decoder"}
            sources = {key: str(tiny_parts[key]) if value == "tiny" else value for key, value in sources.items()}
        return sources

    @staticmethod
    def _load_prior_parts(source: str, model_cfg: ModelConfig, dtype: torch.dtype) -> tuple:
        kw: dict[str, Any] = {"variant": model_cfg.variant, "revision": model_cfg.revision}
        prior = WuerstchenPrior.from_pretrained(source, subfolder="prior", torch_dtype=dtype, **kw)
        text_encoder = CLIPTextModel.from_pretrained(source, subfolder="text_encoder", dtype=dtype, **kw)
        tokenizer = CLIPTokenizer.from_pretrained(source, subfolder="tokenizer", revision=model_cfg.revision)
        scheduler = DDPMWuerstchenScheduler.from_pretrained(source, subfolder="scheduler",
                                                            revision=model_cfg.revision)
        return prior, text_encoder, tokenizer, scheduler

    @staticmethod
    def _load_decoder(source: str, dtype: torch.dtype) -> dict[str, Any]:
        """The stage-B decoder pipeline's parts, loaded by subfolder (its deprecated pipeline class does not
        reload from model_index.json). They stay on the CPU except while rendering samples."""
        return {
            "decoder": WuerstchenDiffNeXt.from_pretrained(source, subfolder="decoder", torch_dtype=dtype),
            "vqgan": PaellaVQModel.from_pretrained(source, subfolder="vqgan", torch_dtype=dtype),
            "text_encoder": CLIPTextModel.from_pretrained(source, subfolder="text_encoder", dtype=dtype),
            "tokenizer": CLIPTokenizer.from_pretrained(source, subfolder="tokenizer"),
            "scheduler": DDPMWuerstchenScheduler.from_pretrained(source, subfolder="scheduler"),
        }

    @property
    def device(self) -> torch.device:
        # the first parameter: diffusers' `.device` walks every submodule (milliseconds per call, per step)
        return next(self.prior.parameters()).device

    # ---- encoders ------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        tokens = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                truncation=True, return_tensors="pt")
        device = self.text_encoder.device
        output = self.text_encoder(to_device(tokens.input_ids, device), attention_mask=to_device(tokens.attention_mask, device))
        return PromptEmbeds(output.last_hidden_state, lengths=tokens.attention_mask.sum(dim=1))

    def overlong_prompts(self, prompts: list[str]) -> list[int]:
        limit = self.tokenizer.model_max_length
        lengths = [len(ids) for ids in self.tokenizer(prompts, truncation=False).input_ids]
        return [i for i, length in enumerate(lengths) if length > limit]

    @torch.no_grad()
    def encode_latent_dist(self, pixels: torch.Tensor) -> LatentDist:
        encoder = self.image_encoder
        first = next(encoder.parameters())
        mean = torch.tensor(IMAGENET_MEAN, device=first.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=first.device).view(1, 3, 1, 1)
        unit = (pixels.to(first.device).float() + 1) / 2  # the dataset gives [-1, 1]
        return LatentDist(encoder(((unit - mean) / std).to(first.dtype)))

    def latents_from_dist(self, dist: LatentDist, generator: torch.Generator | None = None) -> torch.Tensor:
        # The scaling Wuerstchen's prior was trained with; its pipeline inverts it (x 42 - 1).
        return dist.mean.float().add(1.0).div(42.0)

    def image_encoder_modules(self) -> list[nn.Module]:
        return [self.image_encoder]

    def text_encoder_modules(self) -> list[nn.Module]:
        return [self.text_encoder]

    def sampling_only_modules(self) -> list[nn.Module]:
        if self.decoder is None:
            return []
        return [self.decoder["decoder"], self.decoder["vqgan"], self.decoder["text_encoder"]]

    def encoder_identity(self, part: str) -> str:
        if part == "text":
            return encoder_identity(self.arch, part, self.sources["prior"], self.text_encoder)
        # the image encoder's BatchNorm statistics set the embeddings' scale: they count as weights here
        return encoder_identity(self.arch, part, self.sources["image_encoder"], self.image_encoder,
                                f"effnet_v2_s {self.image_encoder.stage_channels}", buffers=True)

    # ---- denoiser ------------------------------------------------------------------------------

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: nn.Module | None = None) -> torch.Tensor:
        dtype = self.compute_dtype
        denoiser = module if module is not None else self._denoiser
        ratio = timesteps.to(device=noisy.device, dtype=dtype)
        return denoiser(noisy.to(dtype), ratio, embeds.embeds.to(dtype))

    def trainable_module(self) -> nn.Module:
        return self.prior

    def lora_target_modules(self) -> list[str]:
        # add_k_proj / add_v_proj: attention layers with added key/value projections where a prior has them
        return ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj"]

    def use_for_training(self, module: nn.Module) -> None:
        self._denoiser = module

    # ---- outputs -------------------------------------------------------------------------------

    def sampling_unavailable(self) -> str | None:
        if self.decoder is None:
            return "sample images of a Wuerstchen prior need model.decoder_name_or_path (e.g. warp-ai/wuerstchen)"
        return None

    def sampling_pipeline(self) -> WuerstchenSampler:
        if self.decoder is None:
            raise ValueError(self.sampling_unavailable())
        d = self.decoder
        pipe = WuerstchenCombinedPipeline(
            tokenizer=d["tokenizer"], text_encoder=d["text_encoder"], decoder=d["decoder"],
            scheduler=d["scheduler"], vqgan=d["vqgan"], prior_tokenizer=self.tokenizer,
            prior_text_encoder=self.text_encoder, prior_prior=self.prior,
            prior_scheduler=DDPMWuerstchenScheduler.from_config(self.scheduler.config),
        )
        return WuerstchenSampler(pipe)

    def describe(self) -> dict[str, str]:
        return {"arch": self.arch, "base_model": self.sources["prior"],
                "prediction_type": self.noise_schedule.prediction_type}
