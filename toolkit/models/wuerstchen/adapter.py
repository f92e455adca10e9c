"""Wuerstchen v2 prior (stage C): text -> 16-channel image embeddings of Wuerstchen's EfficientNetV2-S encoder.

The prior is trained on the image encoder's embeddings (`effnet(x).add(1).div(42)`, 24x24 for a 768 px image);
sample images go through the prior and then the stage-B decoder pipeline.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import DDPMWuerstchenScheduler
from diffusers.pipelines.deprecated.wuerstchen import (
    PaellaVQModel,
    WuerstchenCombinedPipeline,
    WuerstchenDiffNeXt,
    WuerstchenPrior,
)
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from toolkit.device import memory_debug, to_device
from toolkit.diffusion.schedules import WuerstchenNoiseSchedule
from toolkit.models.base import Expert, LatentDist, LoraFileFormat, ModelAdapter, PromptEmbeds, SamplingParts
from toolkit.models.base_parts import CLIP_EXTRAS, BaseParts
from toolkit.models.common import ClipTextRules, encoder_identity, first_weight, place_frozen
from toolkit.models.part_kinds import open_clip_layout
from toolkit.models.wuerstchen.config import FACTS, WuerstchenModelConfig
from toolkit.models.wuerstchen.files import original_layout, wuerstchen_files
from toolkit.models.wuerstchen.image_encoder import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EfficientNetImageEncoder,
    read_image_encoder_state,
)
from toolkit.paths import normalize_path

#: decoder denoising steps for sample images (diffusers' default for Wuerstchen's decoder)
DECODER_STEPS = 12


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


class WuerstchenSampling(SamplingParts):
    """The prior (LoRA active), then the stage-B decoder, which visits the accelerator only while sampling."""

    default_guidance_scale = 4.0  # WuerstchenPriorPipeline's default

    def pipeline(self) -> WuerstchenSampler:
        a = self.adapter
        if a.decoder is None:  # the config check (FamilyFacts.sampling_needs) refuses prompts without one
            raise ValueError("sample images of a Wuerstchen prior need model.decoder_name_or_path")
        d = a.decoder
        pipe = WuerstchenCombinedPipeline(
            tokenizer=d["tokenizer"], text_encoder=d["text_encoder"], decoder=d["decoder"],
            scheduler=d["scheduler"], vqgan=d["vqgan"], prior_tokenizer=a.tokenizer,
            prior_text_encoder=a.text_encoder, prior_prior=a.prior,
            prior_scheduler=DDPMWuerstchenScheduler.from_config(a.scheduler.config),
        )
        return WuerstchenSampler(pipe)

    def only_modules(self) -> list[nn.Module]:
        d = self.adapter.decoder
        return [] if d is None else [d["decoder"], d["vqgan"], d["text_encoder"]]


#: where a single-file prior's parts not named as files come from, by default
DEFAULT_COMPONENTS = "warp-ai/wuerstchen-prior"


def original_prior_names(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The published prior's names (torch's fused attention: `attention.attn.in_proj_weight`, `out_proj`) as
    diffusers' WuerstchenPrior names them (`to_q`/`to_k`/`to_v`, `to_out.0`), as diffusers' conversion script
    (scripts/convert_wuerstchen.py, not importable) splits them."""
    out = {}
    for key, value in checkpoint.items():
        for fused, kind in (("attention.attn.in_proj_weight", "weight"), ("attention.attn.in_proj_bias", "bias")):
            if key.endswith(fused):
                stem = key[: -len(fused)]
                for name, part in zip(("to_q", "to_k", "to_v"), value.chunk(3, dim=0)):
                    out[f"{stem}attention.{name}.{kind}"] = part
                break
        else:
            out[key.replace("attention.attn.out_proj.", "attention.to_out.0.")] = value
    return out


def open_clip_text_converter(part, config: dict):
    """An open_clip CLIP model's text tower (laion's open_clip_pytorch_model) in CLIPTextModel's names: diffusers'
    converter, then transformers 5's names (no `text_model.` level) and no projection (the prior reads the last
    hidden state)."""
    if not open_clip_layout(part):
        return None
    from types import SimpleNamespace

    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

    text_model = SimpleNamespace(config=SimpleNamespace(hidden_size=config["hidden_size"]))

    def convert(checkpoint: dict) -> dict:
        converted = convert_open_clip_checkpoint(text_model, checkpoint, prefix="")
        return {k.removeprefix("text_model."): v for k, v in converted.items() if k != "text_projection.weight"}

    return convert


class WuerstchenAdapter(ModelAdapter):
    arch = "wuerstchen"
    facts = FACTS
    # WuerstchenPriorPipeline.load_lora_weights loads `prior.*` keys into the prior. No ComfyUI loader exists for
    # Wuerstchen v2, so the diffusers form is primary; the `comfy` form (asked for in save.formats) writes
    # kohya-style keys under OneTrainer's prefix.
    files = LoraFileFormat(prefix="prior", comfy_prefix="lora_prior_unet", kohya_base_model="wuerstchen_v2",
                           primary="diffusers", modelspec_architecture="wuerstchen-v2-prior/lora")
    text_rules = ClipTextRules
    sampling_parts = WuerstchenSampling
    sharded_blocks = ("blocks",)
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
    def load(cls, model_cfg: WuerstchenModelConfig, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False, sampling_models: bool = True,
             empty_denoiser: bool = False) -> WuerstchenAdapter:
        sources = cls._resolve_sources(model_cfg)
        if not sampling_models:
            sources.pop("decoder", None)
        with memory_debug("model load", debug_memory):
            prior_parts = cls._load_prior_parts(sources["prior"], model_cfg, dtype, empty_denoiser)
            state = read_image_encoder_state(sources["image_encoder"])
            image_encoder = EfficientNetImageEncoder.from_state_dict(state, sources["image_encoder"]).to(dtype)
            decoder = cls._load_decoder(sources["decoder"], dtype) if "decoder" in sources else None
        adapter = cls(*prior_parts, image_encoder=image_encoder, decoder=decoder, sources=sources)
        # the decoder (sample-only) stays on the CPU until samples render
        place_frozen(adapter.prior, [adapter.text_encoder, adapter.image_encoder], device, model_cfg.low_vram,
                     adapter.sampling.only_modules())
        return adapter

    @classmethod
    def for_module_names(cls, name_or_path: str | None) -> WuerstchenAdapter:
        """The prior and its text encoder on the meta device (no image encoder, no decoder: the LoRA is the
        prior's)."""
        source = normalize_path(name_or_path) if name_or_path else None
        if source == "tiny":
            from toolkit.models.wuerstchen.tiny import ensure_tiny_wuerstchen

            source = str(ensure_tiny_wuerstchen() / "prior")
        model_cfg = WuerstchenModelConfig(arch="wuerstchen", name_or_path=source or "the published prior",
                                          image_encoder_path="none")
        prior_parts = cls._load_prior_parts(source, model_cfg, torch.float32, meta=True)
        return cls(*prior_parts, image_encoder=None, decoder=None, sources={"prior": source or ""})

    @staticmethod
    def _resolve_sources(model_cfg: WuerstchenModelConfig) -> dict[str, str]:
        sources = {"prior": normalize_path(model_cfg.name_or_path),
                   "image_encoder": normalize_path(model_cfg.image_encoder_path or "", "model.image_encoder_path")}
        if model_cfg.decoder_name_or_path:
            sources["decoder"] = normalize_path(model_cfg.decoder_name_or_path, "model.decoder_name_or_path")
        if "tiny" in sources.values():
            from toolkit.models.wuerstchen.tiny import ensure_tiny_wuerstchen

            tiny = ensure_tiny_wuerstchen()
            tiny_parts = {"prior": tiny / "prior", "image_encoder": tiny / "image_encoder.safetensors",
                          "decoder": tiny / "decoder"}
            sources = {key: str(tiny_parts[key]) if value == "tiny" else value for key, value in sources.items()}
        return sources

    @staticmethod
    def _load_prior_parts(source: str | None, model_cfg: WuerstchenModelConfig, dtype: torch.dtype,
                          empty_denoiser: bool = False, meta: bool = False) -> tuple:
        """The prior, its text encoder, tokenizer and scheduler, each from where the config says
        (toolkit/models/base_parts.py): a prior pipeline folder or hub id, or the original published files."""
        parts = BaseParts(wuerstchen_files(), model_cfg, source, normalize_path, lambda _: DEFAULT_COMPONENTS, meta)
        prior = parts.denoiser(WuerstchenPrior, "prior", dtype, empty_denoiser,
                               converter=lambda part, _: original_prior_names if original_layout(part) else None)
        text_encoder = parts.text_encoders(
            {"clip_bigg": ("text_encoder", lambda c: CLIPTextModel(CLIPTextConfig(**c)), CLIPTextModel)}, dtype,
            converters={"clip_bigg": open_clip_text_converter}, skip={"clip_bigg": ("visual.",)},
            ignore={"clip_bigg": CLIP_EXTRAS + ("logit_scale",)})["clip_bigg"]
        tokenizer = parts.tokenizers({"tokenizer": CLIPTokenizer})["tokenizer"]
        return prior, text_encoder, tokenizer, parts.scheduler(DDPMWuerstchenScheduler)

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
        return first_weight(self.prior).device

    # ---- encoders ------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        tokens = self.tokenize(self.tokenizer, prompts, self.tokenizer.model_max_length)
        device = first_weight(self.text_encoder).device
        output = self.text_encoder(to_device(tokens.input_ids, device), attention_mask=to_device(tokens.attention_mask, device))
        return PromptEmbeds(output.last_hidden_state, lengths=tokens.attention_mask.sum(dim=1))

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

    def encoder_identity(self, part: str) -> str:
        if part == "text":
            return encoder_identity(self.arch, part, self.sources["prior"], self.text_encoder)
        # the image encoder's BatchNorm statistics set the embeddings' scale: they count as weights here
        return encoder_identity(self.arch, part, self.sources["image_encoder"], self.image_encoder,
                                f"effnet_v2_s {self.image_encoder.stage_channels}", buffers=True)

    # ---- denoiser ------------------------------------------------------------------------------

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: nn.Module | None = None, image_sizes: torch.Tensor | None = None,
                expert: Expert | None = None,
                references: list[torch.Tensor] | None = None) -> torch.Tensor:
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

    def describe(self) -> dict[str, str]:
        return {"arch": self.arch, "base_model": self.sources["prior"],
                "prediction_type": self.noise_schedule.prediction_type}
