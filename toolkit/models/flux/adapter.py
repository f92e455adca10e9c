"""FLUX.1 [dev] and [schnell]: FluxTransformer2DModel over 2x2-packed 16-channel latents, CLIP-L (pooled output)
and T5-XXL (per-token embeddings) text encoders, rectified flow.

Conventions, as FluxPipeline.__call__ applies them:
- latents = (VAE sample - shift_factor) * scaling_factor, packed 2x2 into tokens (`_pack_latents`), with image
  position ids from `_prepare_latent_image_ids` and text position ids all zero;
- the transformer takes sigma (timestep / 1000) and predicts the flow velocity noise - latents, which the Euler
  step integrates: x_next = x + (sigma_next - sigma) v;
- [dev] is guidance-distilled: its guidance embedding takes the guidance scale (no classifier-free guidance);
  [schnell] has no guidance embedding.

Flex.1 is a FLUX.1-layout base pruned to 8 double-stream blocks (FLUX.1 has 19, and twice as many single-stream
ones) whose guidance embedding is an optional add-on: it is trained without that embedding
(`train.bypass_guidance_embedding`, on by default for it), and samples with it. Other pruned bases have the same
block counts (FLUX.1-Lite: 8 and 38, its guidance embedding distilled from [dev]'s and used), so Flex.1 is the
pruned shape with Flex in the base's name; another pruned base is fed the guidance like [dev].
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.models.embeddings import CombinedTimestepGuidanceTextProjEmbeddings

from toolkit.device import memory_debug, to_device
from toolkit.errors import UserError
from toolkit.diffusion.schedules import FlowMatchNoiseSchedule
from toolkit.models.base import (
    Expert,
    LatentDist,
    LoraFileFormat,
    ModelAdapter,
    PromptEmbeds,
    SamplingParts,
    TextRules,
)
from toolkit.models.common import (
    dynamic_shift_schedule,
    encoder_identity,
    first_weight,
    place_frozen,
    vae_latent_dist,
    vae_latents,
)
from toolkit.models.flux.config import FACTS, FluxModelConfig
from toolkit.models.flux.files import flux_files
from toolkit.models.flux.parts import load_flux_parts
from toolkit.models.flux.tiny import ensure_tiny_flex, ensure_tiny_flux, ensure_tiny_flux_schnell
from toolkit.network.lora import merge_lora_state
from toolkit.paths import normalize_path
from toolkit.quantize import quantize_blockwise

log = logging.getLogger("difftune")

#: where a single-file transformer's other parts and its config come from when `model.single_file_config` is not
#: given, by variant ([dev] has guidance-embedding weights): the repos diffusers itself picks for FLUX.1 files
DEFAULT_COMPONENTS = {True: "black-forest-labs/FLUX.1-dev", False: "black-forest-labs/FLUX.1-schnell"}

#: `name_or_path` values that build a tiny random model offline
TINY_SOURCES: dict[str, Callable[[], Path]] = {"tiny": ensure_tiny_flux, "tiny-schnell": ensure_tiny_flux_schnell,
                                                "tiny-flex": ensure_tiny_flex}

#: FluxPipeline's documented T5 lengths: [dev] 512, [schnell] 256
MAX_SEQUENCE_LENGTH = {True: 512, False: 256}

#: the LoRA targets inside each double-stream block (image and text attention, their projections and
#: feed-forwards) and each single-stream block (attention and its two linear layers)
DOUBLE_BLOCK_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                        "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                        "ff_context.net.2")
SINGLE_BLOCK_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")

#: the transformer's token packing: 2x2 latent pixels per token
PATCH_SIZE = 2


def flux_lora_targets(transformer: torch.nn.Module) -> list[str]:
    """Full module names of the default LoRA targets (the single blocks' `proj_out` shares its name with the
    transformer's final projection, so names are given in full rather than as endings)."""
    names = []
    for prefix, targets in (("transformer_blocks", DOUBLE_BLOCK_TARGETS),
                            ("single_transformer_blocks", SINGLE_BLOCK_TARGETS)):
        for index in range(len(getattr(transformer, prefix))):
            names += [f"{prefix}.{index}.{target}" for target in targets]
    return names


class FluxText(TextRules):
    """T5's tokens carry the prompt (no start token, `</s>` at the end); prompts are padded and cut to
    `max_sequence_length`."""

    def caption_token_span(self, length: int) -> tuple[int, int]:
        return 0, max(0, length - 1)

    @property
    def tokenizer(self):
        """T5's: the per-token embeddings are T5's (CLIP gives only the pooled embedding)."""
        return self.adapter.tokenizer_2

    def overlong_prompts(self, prompts: list[str]) -> list[int]:
        a = self.adapter
        lengths = [len(ids) for ids in a.tokenizer_2(prompts, truncation=False).input_ids]
        return [i for i, length in enumerate(lengths) if length > a.max_sequence_length]


class FluxSampling(SamplingParts):
    """FluxPipeline over the current components; prompts are encoded first (T5 then leaves before the
    transformer samples). [dev]: guidance 3.5 into the guidance embedding, 20 steps; [schnell]: 0.0 and 4 steps."""

    @property
    def default_guidance_scale(self) -> float:
        return 3.5 if self.adapter.guidance_embeds else 0.0

    @property
    def default_steps(self) -> int:
        return 20 if self.adapter.guidance_embeds else 4

    def pipeline(self) -> FluxPipeline:
        a = self.adapter
        return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(a.scheduler.config), vae=a.vae,
                            text_encoder=a.text_encoder, tokenizer=a.tokenizer, text_encoder_2=a.text_encoder_2,
                            tokenizer_2=a.tokenizer_2, transformer=a.transformer)

    def reproduction(self) -> dict:
        """T5 runs unmasked, so the padded length shapes the embeddings: rendering again needs the same one."""
        return {"max_sequence_length": self.adapter.max_sequence_length}

    @torch.no_grad()
    def conditioning(self, prompt: str, negative: str) -> dict[str, torch.Tensor]:
        """The pipeline's own `encode_prompt` (FluxPipeline uses the negative prompt only with true CFG)."""
        a = self.adapter
        embeds, pooled, _ = self.pipeline().encode_prompt(prompt, prompt_2=None, device=a.text_encoder_2.device,
                                                          max_sequence_length=a.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


class FluxAdapter(ModelAdapter):
    arch = "flux"
    facts = FACTS
    # The primary form: `transformer.<diffusers path>.lora_A/lora_B.weight` + a float `.alpha` per module, no peft
    # header. ComfyUI and Forge map these names onto the original model (q/k/v into its fused qkv by slices, using
    # the model's own widths) and apply alpha / rank; diffusers' FluxPipeline reads them as they are. kohya's fused
    # `lora_unet_double_blocks_*` form would need block-diagonal qkv, and diffusers' reader of it assumes the
    # full-size widths. kohya_base_model: sd-scripts' FLUX.1 tag.
    files = LoraFileFormat(prefix="transformer", comfy_prefix="transformer", comfy_separator=".",
                           comfy_peft_names=True, kohya_base_model="flux1", modelspec_architecture="flux-1-dev/lora")
    text_rules = FluxText
    sampling_parts = FluxSampling
    sharded_blocks = ("transformer_blocks", "single_transformer_blocks")
    #: `name_or_path` values that build a tiny random model offline
    tiny_sources: ClassVar[dict[str, Callable[[], Path]]] = TINY_SOURCES
    #: a single-file transformer's other parts, by whether it has guidance-embedding weights
    default_components: ClassVar[dict[bool, str]] = DEFAULT_COMPONENTS
    #: what the family takes as single files (the registry's `files` of the family)
    single_files = staticmethod(flux_files)

    def __init__(self, transformer, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, scheduler, source: str,
                 max_sequence_length: int | None = None):
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.text_encoder_2 = text_encoder_2
        self.tokenizer_2 = tokenizer_2
        self.scheduler = scheduler
        self.source = source
        #: [dev] is guidance-distilled (a guidance embedding); [schnell] is not
        self.guidance_embeds = bool(transformer.config.guidance_embeds)
        self.max_sequence_length = max_sequence_length or MAX_SEQUENCE_LENGTH[self.guidance_embeds]
        #: the dtype the transformer computes in (kept from loading: quantized weights may report another)
        self.compute_dtype = transformer.dtype
        self.noise_schedule = FlowMatchNoiseSchedule(scheduler.config.num_train_timesteps,
                                                     dynamic_shift_schedule(scheduler.config), PATCH_SIZE)
        self.vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        self.divisor = self.vae_scale * PATCH_SIZE
        self._denoiser: torch.nn.Module = transformer
        #: image position ids per (latent height, width, device, dtype): built on the host once, not every step
        self._image_ids: dict[tuple, torch.Tensor] = {}
        #: a Flex.1 base (told apart by its block counts)
        self.flex = is_flex(transformer.config, source)
        #: training leaves the guidance embedding out (`train.bypass_guidance_embedding`; Flex.1's default)
        self.bypass_guidance = False
        self.set_guidance_bypass(self.flex)
        if not self.guidance_embeds:
            self.files = dataclasses.replace(self.files, modelspec_architecture="flux-1-schnell/lora")

    # ---- loading -----------------------------------------------------------------------------------

    @classmethod
    def load(cls, model_cfg: FluxModelConfig, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False, sampling_models: bool = True,
             empty_denoiser: bool = False) -> FluxAdapter:
        """The transformer (the assistant LoRA merged before any quantization) and the other parts; then the
        transformer and T5 quantized block by block onto the accelerator where asked. Each part comes from its own
        file where the config names one (`name_or_path`, `text_encoder_path`, `vae_name_or_path`), else from the
        base's folder (`single_file_config` for a single-file base)."""
        source = cls.resolve_source(model_cfg.name_or_path)
        with memory_debug("model load", debug_memory):
            parts, origins = load_flux_parts(cls, model_cfg, source, dtype, empty_denoiser)
        transformer = parts["transformer"]
        transformer.requires_grad_(False)
        transformer.eval()
        if model_cfg.assistant_lora_path:
            with memory_debug("assistant LoRA load", debug_memory):
                merge_assistant_lora(transformer, normalize_path(model_cfg.assistant_lora_path,
                                                                   "model.assistant_lora_path"))
        adapter = cls(**parts, source=source, max_sequence_length=model_cfg.max_sequence_length)
        adapter.parts_from = origins
        adapter.compute_dtype = dtype
        adapter.quantize_and_place(model_cfg, device, debug_memory)
        return adapter

    @classmethod
    def resolve_source(cls, name_or_path: str, key: str = "model.name_or_path") -> str:
        """A folder, hub id or file; `tiny` / `tiny-schnell` become the tiny presets' folders."""
        name_or_path = normalize_path(name_or_path, key)
        tiny = cls.tiny_sources
        return str(tiny[name_or_path]()) if name_or_path in tiny else name_or_path

    #: fnmatch patterns over the transformer's module names that stay in full precision: the input embedders, the
    #: timestep/guidance/text embedding and the final norm and projection (small and precision-sensitive). The
    #: blocks' modulation linears (`norm1.linear`, `norm.linear`: about a quarter of the weights) are quantized with
    #: the rest of each block; quanto leaves the norms themselves alone.
    QUANTIZATION_EXCLUDE = ("x_embedder", "context_embedder", "time_text_embed.*", "norm_out.*", "proj_out")

    def quantize_and_place(self, model_cfg: FluxModelConfig, device: torch.device, debug_memory: bool) -> None:
        """Quantize what the config asks (block by block onto the accelerator; layers an fp8 file stores stay as
        stored), then place the rest: with `low_vram` the text encoders and VAE stay on the CPU until the trainer
        needs them."""
        if model_cfg.quantize:
            with memory_debug("transformer quantization", debug_memory):
                quantize_blockwise(self.transformer, model_cfg.qtype, self.quantization_blocks(),
                                   list(self.QUANTIZATION_EXCLUDE), device, keep_quantized=True)
        if model_cfg.quantize_te:
            with memory_debug("text encoder quantization", debug_memory):
                quantize_blockwise(self.text_encoder_2, model_cfg.qtype_te, list(self.text_encoder_2.encoder.block),
                                   None, device, keep_quantized=True)
        place_frozen(self.transformer, [self.vae, self.text_encoder, self.text_encoder_2], device, model_cfg.low_vram)

    def quantization_blocks(self) -> list[torch.nn.Module]:
        """The double- then the single-stream blocks, quantized one at a time (peak memory: one block)."""
        return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]

    @property
    def device(self) -> torch.device:
        # the first parameter: diffusers' `.device` walks every submodule (milliseconds per call, per step)
        return first_weight(self.transformer).device

    # ---- text and images ---------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """As FluxPipeline.encode_prompt: T5's last hidden state over `max_sequence_length` padded tokens (no
        mask, as the pipeline passes none) and CLIP's pooled output."""
        clip = self.tokenize(self.tokenizer, prompts, self.tokenizer.model_max_length)
        pooled = self.text_encoder(to_device(clip.input_ids, first_weight(self.text_encoder).device),
                                   output_hidden_states=False).pooler_output
        t5 = self.tokenize(self.tokenizer_2, prompts, self.max_sequence_length)
        embeds = self.text_encoder_2(to_device(t5.input_ids, first_weight(self.text_encoder_2).device),
                                     output_hidden_states=False)[0]
        return PromptEmbeds(embeds, lengths=t5.attention_mask.sum(dim=1), pooled=pooled)

    def encode_latent_dist(self, pixels: torch.Tensor) -> LatentDist:
        return vae_latent_dist(self.vae, pixels)

    def latents_from_dist(self, dist: LatentDist, generator: torch.Generator | None = None) -> torch.Tensor:
        # the pipeline decodes latents / scaling_factor + shift_factor: training latents are the inverse
        return vae_latents(dist, generator, self.vae.config.scaling_factor, self.vae.config.shift_factor)

    def image_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.vae]

    def text_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.text_encoder, self.text_encoder_2]

    def encoder_identity(self, part: str) -> str:
        if part == "image":
            return encoder_identity(self.arch, part, self.source, self.vae)
        clip = encoder_identity(self.arch, part, self.source, self.text_encoder)
        return encoder_identity(self.arch, part, self.source, self.text_encoder_2,
                                extra=f"{clip}|{len(self.tokenizer_2)}|{self.max_sequence_length}")

    # ---- the denoiser ------------------------------------------------------------------------------

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: torch.nn.Module | None = None, image_sizes: torch.Tensor | None = None,
                expert: Expert | None = None,
                references: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The flow velocity (noise - latents) for a [B, C, H, W] batch, float32: packed, with FluxPipeline's
        position ids, sigma as the timestep, and the training guidance into [dev]'s guidance embedding. Reference
        latents (FLUX.1 Kontext) follow the target's tokens (`reference_tokens`); the output is the target's tokens
        alone."""
        denoiser = module if module is not None else self._denoiser
        dtype, device = self.compute_dtype, noisy.device
        batch, channels, height, width = noisy.shape
        packed = FluxPipeline._pack_latents(noisy.to(dtype), batch, channels, height, width)
        image_ids = self.image_ids(height, width, device, dtype)
        target_tokens = packed.shape[1]
        if references:
            tokens, ids = self.reference_tokens(references, dtype, device)
            packed, image_ids = torch.cat([packed, tokens], dim=1), torch.cat([image_ids, ids])
        text_ids = torch.zeros(embeds.embeds.shape[1], 3, device=device, dtype=dtype)
        guidance = None  # [schnell], or the embedding bypassed: the transformer embeds timestep and text alone
        if self.guidance_embeds and not self.bypass_guidance:
            guidance = torch.full([batch], self.train_guidance_scale, device=device, dtype=torch.float32)
        sigma = timesteps.float() / self.noise_schedule.num_train_timesteps
        out = denoiser(hidden_states=packed, timestep=sigma.to(device, dtype), guidance=guidance,
                       pooled_projections=embeds.pooled.to(dtype), encoder_hidden_states=embeds.embeds.to(dtype),
                       txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0]
        return FluxPipeline._unpack_latents(out[:, :target_tokens], height * self.vae_scale, width * self.vae_scale,
                                            self.vae_scale).float()

    def reference_tokens(self, references: list[torch.Tensor], dtype: torch.dtype,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference latents as tokens after the target's, and their position ids: FLUX.1 takes none (its config
        refuses reference folders); FLUX.1 Kontext overrides this."""
        raise ValueError(f"{self.arch} takes no reference images")

    def image_ids(self, height: int, width: int, device: torch.device, dtype: torch.dtype,
                  first: int = 0) -> torch.Tensor:
        """FluxPipeline's image position ids for latents of this size (the first coordinate `first`: 0 for the target,
        1 for FLUX.1 Kontext's references), sent to the device once per bucket (a copy from the host every step would
        make it wait for the device)."""
        key = (height, width, device, dtype, first)
        if key not in self._image_ids:
            ids = FluxPipeline._prepare_latent_image_ids(1, height // 2, width // 2, "cpu", dtype)
            ids[..., 0] = first
            self._image_ids[key] = to_device(ids, device)
        return self._image_ids[key]

    def use_training_guidance(self, scale: float | None, bypass: bool | None) -> None:
        """The guidance embedding's training value, or its bypass (by default on for Flex.1 only); a bypass is
        refused for a base without the embedding, and a training value together with the bypass."""
        super().use_training_guidance(scale, bypass)
        requested, bypass = bypass, self.flex if bypass is None else bypass
        if bypass and not self.guidance_embeds:
            raise UserError(f"train.bypass_guidance_embedding: {self.source} has no guidance embedding (a FLUX.1 "
                            "[schnell] layout); remove it")
        if bypass and scale is not None:
            raise UserError(f"train.guidance_scale {scale}: {self.source} is a Flex.1 base, trained without its "
                            "guidance embedding (train.bypass_guidance_embedding is on by default for it), so the "
                            "value would not be used; remove it, or set train.bypass_guidance_embedding: false")
        if is_pruned(self.transformer.config) and not self.flex and requested is None:
            log.info("%s has a pruned FLUX.1 layout (%d double-stream blocks, as Flex.1 and FLUX.1-Lite) without Flex "
                     "in its name: its guidance embedding is fed in training, as for [dev]; set "
                     "train.bypass_guidance_embedding: true for a Flex.1 base", self.source,
                     self.transformer.config.num_layers)
        self.set_guidance_bypass(bypass)

    def set_guidance_bypass(self, bypass: bool) -> None:
        if bypass:
            bypass_guidance_embedding(self.transformer)
        self.bypass_guidance = bypass

    def modules_without_gradients(self) -> list[str]:
        """With the bypass, the guidance embedding takes no part in training: a LoRA there would get no gradient."""
        return ["time_text_embed.guidance_embedder"] if self.bypass_guidance else []

    def trainable_module(self) -> torch.nn.Module:
        return self.transformer

    def lora_target_modules(self) -> list[str]:
        return flux_lora_targets(self.transformer)

    def use_for_training(self, module: torch.nn.Module) -> None:
        self._denoiser = module

    def describe(self) -> dict[str, str]:
        return {"arch": self.arch, "base_model": self.source, "prediction_type": self.noise_schedule.prediction_type,
                "variant": "flex.1" if self.flex else "dev" if self.guidance_embeds else "schnell",
                "guidance_in_training": "bypassed" if self.bypass_guidance else
                ("embedded" if self.guidance_embeds else "none")}


def merge_assistant_lora(transformer: torch.nn.Module, path: str) -> None:
    """Merge an assistant LoRA file (e.g. the [schnell] training adapter; any form FluxPipeline's loader reads)
    into the training transformer."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"model.assistant_lora_path: file not found: {path}")
    state, alphas, metadata = FluxPipeline.lora_state_dict(path, return_alphas=True, return_lora_metadata=True)
    merge_lora_state(transformer, state, FluxAdapter.files.prefix, metadata, alphas)


def is_pruned(config) -> bool:
    """A FLUX.1-layout transformer with a guidance embedding and fewer than half as many double-stream as
    single-stream blocks (Flex.1 and FLUX.1-Lite: 8 and 38; FLUX.1 [dev] and [schnell]: 19 and 38)."""
    return bool(config.guidance_embeds) and 2 * config.num_layers < config.num_single_layers


def is_flex(config, source: str) -> bool:
    """Flex.1: the pruned layout (`is_pruned`) with Flex in the base's name (the last part of its hub id, folder or
    file: ostris/Flex.1-alpha); its block counts alone do not tell it from FLUX.1-Lite, whose guidance embedding is
    meant to be used."""
    return is_pruned(config) and "flex" in Path(str(source)).name.lower()


class GuidanceBypassEmbeddings(CombinedTimestepGuidanceTextProjEmbeddings):
    """FLUX.1's timestep + guidance + pooled-text embedding that also runs without the guidance: called as
    `(timestep, pooled)`, which is how FluxTransformer2DModel calls it when `guidance` is None, it returns the
    timestep and pooled-text terms alone (ai-toolkit's `bypass_guidance_embedding`); called with a guidance (the
    sampling pipeline) it is the original. Written here because diffusers' transformer has no way to leave out the
    guidance term of a guidance-distilled model; the weights and their names are the original module's."""

    def forward(self, timestep, guidance, pooled_projection=None):
        if pooled_projection is not None:
            return super().forward(timestep, guidance, pooled_projection)
        pooled_projection = guidance
        timesteps_emb = self.timestep_embedder(self.time_proj(timestep).to(dtype=pooled_projection.dtype))
        return timesteps_emb + self.text_embedder(pooled_projection)


def bypass_guidance_embedding(transformer: FluxTransformer2DModel) -> None:
    """Let `transformer` run without its guidance embedding when `guidance=None` is passed (see
    GuidanceBypassEmbeddings); it keeps its parameters (the class of its embedding module changes)."""
    embedding = transformer.time_text_embed
    if not isinstance(embedding, CombinedTimestepGuidanceTextProjEmbeddings):
        raise ValueError("the transformer has no guidance embedding to bypass")
    embedding.__class__ = GuidanceBypassEmbeddings
