"""Wan 2.1 / 2.2: WanTransformer3DModel over video latents, the UMT5 text encoder, AutoencoderKLWan, rectified flow.

Conventions, as WanPipeline.__call__ applies them:
- prompts are cleaned (`prompt_clean`), encoded by UMT5 (last hidden state), cut to each prompt's own tokens and
  zero-padded to `max_sequence_length` (512): the transformer sees the zeros, without a mask;
- the VAE encodes [B, 3, F, H, W] clips with F = 4k + 1 (an image is one frame); latents = (sample - latents_mean) /
  latents_std per channel (16 channels; 48 for Wan 2.2 TI2V-5B, whose VAE patchifies 2x2 pixels itself);
- the transformer takes the raw timestep t = 1000 sigma (per token with `expand_timesteps`, TI2V-5B) and predicts the
  flow velocity noise - latents: x_next = x + (sigma_next - sigma) v;
- guidance is classifier-free guidance with a negative prompt (`guidance_scale`).
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import cached_property
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import AutoTokenizer, UMT5EncoderModel

from toolkit.device import memory_debug, move_frozen, to_device
from toolkit.diffusion.schedules import FlowMatchNoiseSchedule
from toolkit.errors import UserError
from toolkit.models.base import (
    Expert,
    LatentDist,
    LoraComponent,
    LoraFileFormat,
    ModelAdapter,
    PromptEmbeds,
    SamplingParts,
    TextRules,
    denoiser_component,
)
from toolkit.models.common import (
    ChannelNormalizedLatents,
    encoder_identity,
    first_weight,
    is_single_file,
    place_frozen,
    pretrained_denoiser,
    subfolder_weight_files,
    transformers_quantization,
    weights_placement,
)
from toolkit.models.wan.config import FACTS, WanModelConfig
from toolkit.models.wan.tiny import ensure_tiny_wan21, ensure_tiny_wan22_5b, ensure_tiny_wan22_a14b
from toolkit.network.files import part_file
from toolkit.network.lora import merge_lora_state
from toolkit.paths import normalize_path
from toolkit.quantize import StreamedWeights, load_quantized, quantize_blockwise

#: `name_or_path` values that build a tiny random model offline
TINY_SOURCES = {"tiny": ensure_tiny_wan21, "tiny-wan2.2-5b": ensure_tiny_wan22_5b,
                "tiny-wan2.2-a14b": ensure_tiny_wan22_a14b}

#: WanPipeline's `max_sequence_length`: the transformer sees every prompt zero-padded to this many tokens
MAX_TOKENS = 512

#: the LoRA targets in each block: self-attention, cross-attention and the MLP (what ComfyUI and diffusers' loaders
#: of Wan LoRAs map; the modulation table and the embedders stay out)
BLOCK_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
                 "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")

#: diffusers' attention layer names -> the original Wan code's (what ComfyUI's model and Wan LoRA files use)
ATTENTION_NAMES = {"attn1": "self_attn", "attn2": "cross_attn"}
PROJECTION_NAMES = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "add_k_proj": "k_img",
                    "add_v_proj": "v_img"}
FFN_NAMES = {"ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}
_BLOCK_MODULE = re.compile(r"^blocks\.(\d+)\.(.+)$")


def original_wan_names(module_names: list[str]) -> dict[str, str]:
    """{diffusers module path: the original Wan path} for the block layers a LoRA may train:
    `blocks.0.attn1.to_q` -> `blocks.0.self_attn.q`, `blocks.0.ffn.net.0.proj` -> `blocks.0.ffn.0`."""
    renames = {}
    for name in module_names:
        match = _BLOCK_MODULE.match(name)
        if not match:
            continue
        block, rest = match.groups()
        attention, _, projection = rest.partition(".")
        if attention in ATTENTION_NAMES and projection in PROJECTION_NAMES:
            renames[name] = f"blocks.{block}.{ATTENTION_NAMES[attention]}.{PROJECTION_NAMES[projection]}"
        elif rest in FFN_NAMES:
            renames[name] = f"blocks.{block}.{FFN_NAMES[rest]}"
    return renames


#: the experts of a two-transformer Wan (2.2 A14B), in WanPipeline's order: `transformer` denoises from the boundary
#: up, `transformer_2` below it (each expert's LoRA file part)
EXPERTS = FACTS.file_parts


#: a two-transformer Wan's subfolders and the expert each one is
EXPERT_OF = dict(zip(("transformer", "transformer_2"), EXPERTS))


def trained_experts(model_cfg: WanModelConfig, two: bool) -> list[str]:
    """The experts that get a LoRA: `model.experts`, default both of a two-transformer model (none of a
    one-transformer one, which refuses the expert keys by name)."""
    if not two:
        for key, given in (("experts", model_cfg.experts), ("expert_switch_every", model_cfg.expert_switch_every != 1)):
            if given:
                raise UserError(f"model.{key}: {model_cfg.name_or_path} has one transformer (Wan 2.1 or 2.2 TI2V-5B), "
                                "no experts to choose or switch between; remove it")
        return []
    return list(model_cfg.experts or EXPERTS)


class WanExperts(torch.nn.Module):
    """Wan 2.2 A14B's experts as one module, what DDP wraps and `predict` runs: a forward runs the expert it is told
    (`expert=`), as WanPipeline switches transformers at its boundary. Each trained expert carries its own LoRA."""

    def __init__(self, experts: dict[str, WanTransformer3DModel]):
        super().__init__()
        self.experts = torch.nn.ModuleDict(experts)

    def forward(self, expert: str, **kwargs):
        if expert not in self.experts:
            raise ValueError(f"the {expert} expert is not loaded in this process")
        return self.experts[expert](**kwargs)

    def adapted(self) -> list[WanTransformer3DModel]:
        return [e for e in self.experts.values() if getattr(e, "_hf_peft_config_loaded", False)]

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts.values():
            expert.enable_gradient_checkpointing()

    def disable_adapters(self) -> None:
        for expert in self.adapted():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self.adapted():
            expert.enable_adapters()


class OneExpertOnDevice:
    """low_vram with two experts: only the expert that runs has its weights on the accelerator. A forward pre-hook on
    each expert (training through `WanExperts`, and WanPipeline's own calls when sampling) first parks the other's
    frozen weights on the CPU and brings this one's; LoRA weights stay on the accelerator (`move_frozen`). A switch
    costs one expert's weights each way, so `model.expert_switch_every` above 1 makes it rarer."""

    def __init__(self, experts: list[WanTransformer3DModel], device: torch.device):
        self.experts = experts
        self.device = device
        self.current: WanTransformer3DModel | None = None
        for expert in experts:
            expert.register_forward_pre_hook(self.bring)

    def bring(self, module: torch.nn.Module, args) -> None:
        if module is self.current:
            return
        for other in self.experts:
            if other is not module:
                move_frozen(other, "cpu")
        move_frozen(module, self.device)
        self.current = module


class WanText(TextRules):
    """UMT5: a prompt's tokens then `</s>`; longer prompts are cut at `max_sequence_length`. Prompts keep their own
    length in batches and caches (the transformer's input is padded to 512 in `predict`)."""

    variable_length = True

    def caption_token_span(self, length: int) -> tuple[int, int]:
        return 0, max(0, length - 1)

    def encoder_text(self, caption: str) -> str:
        return prompt_clean(caption)

    def overlong_prompts(self, prompts: list[str]) -> list[int]:
        a = self.adapter
        lengths = [len(ids) for ids in a.tokenizer([prompt_clean(p) for p in prompts], truncation=False).input_ids]
        return [i for i, length in enumerate(lengths) if length > a.max_sequence_length]


class WanSampling(SamplingParts):
    """WanPipeline over the current components (both experts where the model has two), fed the adapter's prompt
    embeddings (the text encoder leaves before the transformer samples); classifier-free guidance with `sample.neg`
    as the negative prompt (5.0, as the pipeline's)."""

    default_guidance_scale = 5.0
    default_steps = 30

    def pipeline(self) -> WanPipeline:
        """Without the text encoder: samples are rendered from `conditioning`'s embeddings, and WanPipeline takes
        its execution device from its first model, which would be an offloaded text encoder's CPU."""
        a = self.adapter
        return WanPipeline(tokenizer=a.tokenizer, text_encoder=None, vae=a.vae,
                           scheduler=UniPCMultistepScheduler.from_config(a.scheduler.config),
                           transformer=a.transformer, transformer_2=a.transformer_2,
                           boundary_ratio=a.boundary_ratio, expand_timesteps=a.expand_timesteps)

    def pipeline_arguments(self, text: dict, guidance: float) -> dict:
        return {**text, "guidance_scale": guidance, "max_sequence_length": MAX_TOKENS}

    @torch.no_grad()
    def conditioning(self, prompt: str, negative: str) -> dict[str, torch.Tensor]:
        a = self.adapter
        embeds = [a.padded_embeds(a.encode_prompts([p])) for p in (prompt, negative)]
        return {"prompt_embeds": embeds[0], "negative_prompt_embeds": embeds[1]}

    def only_modules(self) -> list[torch.nn.Module]:
        return list(self.adapter.sample_only)

    @property
    def default_frames(self) -> int:
        return 81

    @property
    def default_fps(self) -> float:
        # Wan 2.1 renders at 16 fps, Wan 2.2 TI2V-5B at 24
        return 24.0 if self.adapter.expand_timesteps else 16.0


class WanAdapter(ModelAdapter):
    arch = "wan"
    facts = FACTS
    # ComfyUI's Wan model keeps the original layer names (`blocks.0.self_attn.q`) and its LoRA loader maps
    # `diffusion_model.<path>` with kohya's lora_down/lora_up/alpha names; diffusers' WanPipeline.load_lora_weights
    # converts the same form (`_convert_non_diffusers_wan_lora_to_diffusers`, alpha / rank applied).
    files = LoraFileFormat(prefix="transformer", comfy_prefix="diffusion_model", comfy_separator=".",
                           kohya_base_model="wan", modelspec_architecture="wan/lora",
                           comfy_renames=original_wan_names)
    text_rules = WanText
    sampling_parts = WanSampling
    sharded_blocks = ("blocks",)

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, source: str,
                 max_sequence_length: int = MAX_TOKENS, transformer_2=None, boundary_ratio: float | None = None,
                 expand_timesteps: bool = False, trained_experts: list[str] | None = None,
                 expert_switch_every: int = 1):
        """`transformer_2` and `boundary_ratio`: Wan 2.2 A14B's low-noise expert and where it takes over; an expert
        not trained is loaded only where samples render (None elsewhere). `trained_experts`: those with a LoRA."""
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_ratio = boundary_ratio
        self.expand_timesteps = expand_timesteps
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.source = source
        self.max_sequence_length = max_sequence_length
        first = transformer if transformer is not None else transformer_2
        #: the dtype the transformer computes in (kept from loading: quantized weights may report another)
        self.compute_dtype = first.dtype
        self.patch_size = tuple(first.config.patch_size)
        self.blocks = len(first.blocks)
        self.noise_schedule = FlowMatchNoiseSchedule(scheduler.config.num_train_timesteps, None, self.patch_size[1])
        self.vae_scale = vae.config.scale_factor_spatial
        self.divisor = self.vae_scale * self.patch_size[1]
        self.trained_experts = list(trained_experts or [])
        self.expert_switch_every = expert_switch_every
        #: both experts as one module (two-transformer models), else None
        self.experts: WanExperts | None = None
        if boundary_ratio is not None:
            loaded = {name: t for name, t in zip(EXPERTS, (transformer, transformer_2)) if t is not None}
            self.experts = WanExperts(loaded)
        self._denoiser: torch.nn.Module = self.experts if self.experts is not None else transformer
        #: low_vram with two experts: which one is on the accelerator (set by `load`)
        self.swap: OneExpertOnDevice | None = None
        #: experts loaded only to render samples (not trained, no low_vram swapping): on the CPU between samples
        self.sample_only: list[WanTransformer3DModel] = []
        #: latents normalised with the VAE's per-channel mean and std, as the pipeline denormalises them
        self.latent_norm = ChannelNormalizedLatents(vae.config, spatial_dims=3)

    # ---- loading -----------------------------------------------------------------------------------

    @classmethod
    def load(cls, model_cfg: WanModelConfig, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False, sampling_models: bool = True,
             empty_denoiser: bool = False) -> WanAdapter:
        """The transformer(s) (read and quantized block by block onto the accelerator with `quantize`, so that they
        are never whole in full precision), the text encoder (quantized by transformers as its weights load with
        `quantize_te`), VAE, tokenizer and scheduler; then everything placed."""
        source = cls.resolve_source(model_cfg.name_or_path)
        if is_single_file(source):
            raise FileNotFoundError(f"model.name_or_path: {source}: Wan loads from a diffusers folder or hub id "
                                    "(e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers); single-file transformers are not read")
        kw = {"variant": model_cfg.variant, "revision": model_cfg.revision}
        pipeline_config = WanPipeline.load_config(source, revision=model_cfg.revision)
        two = bool((pipeline_config.get("transformer_2") or [None])[0])
        trained = trained_experts(model_cfg, two)
        # an expert nobody trains serves samples only: loaded where they render, and waiting on the CPU
        sample_only = {name for name, expert in EXPERT_OF.items() if two and expert not in trained}
        wanted = [name for name in (EXPERT_OF if two else ["transformer"]) if name not in sample_only or sampling_models]
        # low_vram with two experts: each waits on the CPU once loaded (quantized on the accelerator), so loading holds
        # one expert there at a time; the one that runs is brought when it runs (OneExpertOnDevice)
        swapping = model_cfg.low_vram and len(wanted) > 1
        parked = {name for name in wanted if swapping or name in sample_only}
        # an assistant LoRA is merged in full precision, before any quantization
        qtype = model_cfg.qtype if model_cfg.quantize and not model_cfg.assistant_lora_path else None
        loaded: dict[str, WanTransformer3DModel | None] = dict.fromkeys(EXPERT_OF if two else ["transformer"])
        for name in wanted:
            with memory_debug(f"{name} load" + (" and quantization" if qtype else ""), debug_memory):
                # a sample-only expert is not trained, so not sharded: loaded whole where samples render
                loaded[name] = cls.load_transformer(source, name, dtype, qtype, device,
                                                    empty=empty_denoiser and name not in sample_only, **kw)
                if name in parked:
                    move_frozen(loaded[name], "cpu")
        if model_cfg.assistant_lora_path:
            with memory_debug("assistant LoRA load", debug_memory):
                merge_assistant_lora(loaded, normalize_path(model_cfg.assistant_lora_path,
                                                            "model.assistant_lora_path"), trained)
            if model_cfg.quantize:
                with memory_debug("transformer quantization", debug_memory):
                    for name in wanted:
                        transformer = loaded[name]
                        quantize_blockwise(transformer, model_cfg.qtype, list(transformer.blocks),
                                           list(cls.QUANTIZATION_EXCLUDE), device)
                        if name in parked:
                            move_frozen(transformer, "cpu")
        with memory_debug("text encoder, VAE load", debug_memory):
            parts = cls.load_components(source, dtype, model_cfg.qtype_te if model_cfg.quantize_te else None,
                                        device, **kw)
        adapter = cls(loaded["transformer"], *parts, source=source, max_sequence_length=model_cfg.max_sequence_length,
                      transformer_2=loaded.get("transformer_2"),
                      boundary_ratio=pipeline_config.get("boundary_ratio") if two else None,
                      expand_timesteps=bool(pipeline_config.get("expand_timesteps")), trained_experts=trained,
                      expert_switch_every=model_cfg.expert_switch_every)
        adapter.compute_dtype = dtype
        adapter.place([loaded[name] for name in wanted], [loaded[name] for name in wanted if name in sample_only],
                      device, model_cfg.low_vram, swapping)
        return adapter

    def place(self, transformers: list[WanTransformer3DModel], sample_only: list[WanTransformer3DModel],
              device: torch.device, low_vram: bool, swapping: bool) -> None:
        """Everything frozen and where training wants it: with `swapping` every expert and encoder waits on the CPU
        (OneExpertOnDevice brings the one that runs); else the trained transformers on `device`, the encoders there
        unless `low_vram`, and sample-only experts on the CPU (they visit the accelerator while samples render)."""
        encoders = [self.vae, self.text_encoder]
        if swapping:
            place_frozen(transformers[0], encoders, "cpu", low_vram=True, parked=transformers[1:])
            self.swap = OneExpertOnDevice(transformers, device)
            return
        self.sample_only = sample_only
        training = [t for t in transformers if not any(t is other for other in sample_only)]
        place_frozen(training[0], encoders, device, low_vram, parked=sample_only)
        for transformer in training[1:]:  # the second trained expert: frozen, beside the first
            place_frozen(transformer, [], device, low_vram=False)

    @staticmethod
    def resolve_source(name_or_path: str, key: str = "model.name_or_path") -> str:
        """A folder or hub id; `tiny`, `tiny-wan2.2-5b`, `tiny-wan2.2-a14b` become the tiny presets' folders."""
        name_or_path = normalize_path(name_or_path, key)
        return str(TINY_SOURCES[name_or_path]()) if name_or_path in TINY_SOURCES else name_or_path

    #: fnmatch patterns over the transformer's module names that stay in full precision: the patch embedding, the
    #: condition embedders (time and text) and the output projection (small and precision-sensitive)
    QUANTIZATION_EXCLUDE = ("patch_embedding", "condition_embedder.*", "proj_out")

    @classmethod
    def load_transformer(cls, source: str, subfolder: str, dtype: torch.dtype, qtype: str | None = None,
                         device: torch.device | str = "cpu", variant: str | None = None,
                         revision: str | None = None, empty: bool = False) -> WanTransformer3DModel:
        """One transformer, frozen. With `qtype` it is built empty from its config and read layer by layer onto
        `device`, each block quantized before the next is read (toolkit.quantize.load_quantized); otherwise
        diffusers' `from_pretrained`."""
        if qtype is None:
            transformer = pretrained_denoiser(WanTransformer3DModel, source, subfolder, dtype, empty, variant=variant,
                                              revision=revision)
            transformer.requires_grad_(False)
            return transformer.eval()
        from accelerate import init_empty_weights

        config = WanTransformer3DModel.load_config(source, subfolder=subfolder, revision=revision)
        with init_empty_weights():
            transformer = WanTransformer3DModel.from_config(config)
        files = subfolder_weight_files(source, subfolder, variant, revision)
        blocks = [f"blocks.{i}" for i in range(len(transformer.blocks))]
        return load_quantized(transformer, StreamedWeights(files), dtype, qtype, blocks,
                              list(cls.QUANTIZATION_EXCLUDE), device, str(files[0].parent))

    @staticmethod
    def load_components(source: str, dtype: torch.dtype, te_qtype: str | None, device: torch.device,
                        variant: str | None = None, revision: str | None = None) -> tuple:
        """VAE, text encoder (quantized by transformers' quanto support as its weights load, with `te_qtype`),
        tokenizer and scheduler."""
        kw = {"variant": variant, "revision": revision}
        text_encoder = UMT5EncoderModel.from_pretrained(source, subfolder="text_encoder", dtype=dtype,
                                                        **transformers_quantization(te_qtype, device), **kw)
        tokenizer = AutoTokenizer.from_pretrained(source, subfolder="tokenizer", revision=revision)
        vae = AutoencoderKLWan.from_pretrained(source, subfolder="vae", torch_dtype=dtype, **kw)
        scheduler = UniPCMultistepScheduler.from_pretrained(source, subfolder="scheduler", revision=revision)
        return vae, text_encoder, tokenizer, scheduler

    @property
    def device(self) -> torch.device:
        # where the experts run (with low_vram one of them may be waiting on the CPU), else the transformer's
        return self.swap.device if self.swap is not None else first_weight(self._denoiser).device

    # ---- text ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """As WanPipeline._get_t5_prompt_embeds: the cleaned prompts through UMT5 (last hidden state), each cut to
        its own tokens (`</s>` included; at most `max_sequence_length`), zero-padded to the longest with a mask."""
        tokens = self.tokenize(self.tokenizer, [prompt_clean(p) for p in prompts], self.max_sequence_length,
                               pad_to_max=False, add_special_tokens=True)
        device = first_weight(self.text_encoder).device
        hidden = self.text_encoder(to_device(tokens.input_ids, device),
                                   to_device(tokens.attention_mask, device)).last_hidden_state
        lengths = tokens.attention_mask.sum(dim=1)
        return PromptEmbeds.padded([h[:n] for h, n in zip(hidden, lengths.tolist())], lengths)

    def padded_embeds(self, embeds: PromptEmbeds) -> torch.Tensor:
        """What the transformer takes: the embeddings zero-padded (or cut) to 512 tokens, as the pipeline gives them
        (the padding of a shorter batch is zero too, so no mask is needed)."""
        tensor = embeds.embeds
        extra = MAX_TOKENS - tensor.shape[1]
        if extra < 0:
            return tensor[:, :MAX_TOKENS]
        return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], extra, tensor.shape[2])], dim=1) if extra else tensor

    def text_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.text_encoder]

    # ---- clips -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_latent_dist(self, pixels: torch.Tensor) -> LatentDist:
        """The VAE posterior of clips [B, 3, F, H, W] (images [B, 3, H, W] are one-frame clips)."""
        if pixels.dim() == 4:
            pixels = pixels.unsqueeze(2)
        posterior = self.vae.encode(pixels.to(**weights_placement(self.vae))).latent_dist
        return LatentDist(posterior.mean, posterior.std)

    def latents_from_dist(self, dist: LatentDist, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.latent_norm.sample(dist, generator)

    def image_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.vae]

    def encoder_identity(self, part: str) -> str:
        if part == "image":
            return encoder_identity(self.arch, part, self.source, self.vae)
        extra = f"{len(self.tokenizer)}|{self.max_sequence_length}"
        return encoder_identity(self.arch, part, self.source, self.text_encoder, extra)

    # ---- the denoiser ------------------------------------------------------------------------------

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: torch.nn.Module | None = None, image_sizes: torch.Tensor | None = None,
                expert: Expert | None = None,
                references: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The flow velocity (noise - latents) for a [B, C, F, H, W] batch, float32: the raw timestep (per token
        with `expand_timesteps`), the prompts zero-padded to 512 tokens."""
        denoiser = module if module is not None else self._denoiser
        dtype, device = self.compute_dtype, noisy.device
        # the experts' module (maybe wrapped by DDP or torch.compile) is told which expert runs; a bare transformer is not
        routed = self.experts is not None and not isinstance(denoiser, WanTransformer3DModel)
        route = {"expert": expert.name if expert is not None else self.expert_for(timesteps)} if routed else {}
        t = timesteps.float().to(device)
        if self.expand_timesteps:  # one timestep per token: latent frames x (H / 2) x (W / 2)
            _, _, frames, height, width = noisy.shape
            tokens = frames * (height // self.patch_size[1]) * (width // self.patch_size[2])
            t = t[:, None].expand(-1, tokens)
        out = denoiser(hidden_states=noisy.to(dtype), timestep=t,
                       encoder_hidden_states=self.padded_embeds(embeds).to(device, dtype), return_dict=False,
                       **route)[0]
        return out.float()

    def expert_for(self, timesteps: torch.Tensor) -> str:
        """The expert of a batch's timesteps, as WanPipeline picks it (high noise from the boundary up). Reads them
        back from the device: training passes the update's expert instead."""
        boundary = self.boundary_ratio * self.noise_schedule.num_train_timesteps
        high = (timesteps >= boundary).tolist()
        if all(high) or not any(high):
            return EXPERTS[0] if high[0] else EXPERTS[1]
        raise ValueError(f"a batch's timesteps {timesteps.tolist()} span the experts' boundary ({boundary:g}): "
                         "predict them in two batches")

    def expert_at(self, update_index: int) -> Expert | None:
        """Both experts trained: `expert_switch_every` updates each, in turn (high noise first)."""
        if not self.trained_experts:
            return None
        name = self.trained_experts[(update_index // self.expert_switch_every) % len(self.trained_experts)]
        return Expert(name, self.expert_ranges()[name])

    def trains_noise_level(self, u: float) -> bool:
        """The expert denoising `u` (high noise from the boundary up, as `expert_for` routes) is a trained one."""
        if not self.trained_experts:
            return True
        return (EXPERTS[0] if u >= self.boundary_ratio else EXPERTS[1]) in self.trained_experts

    def expert_ranges(self) -> dict[str, tuple[float, float]]:
        """Each expert's noise levels (u = timestep / 1000): high noise from `boundary_ratio` up, low noise below."""
        return {EXPERTS[0]: (self.boundary_ratio, 1.0), EXPERTS[1]: (0.0, self.boundary_ratio)}

    def trainable_module(self) -> torch.nn.Module:
        return self.experts if self.experts is not None else self.transformer

    def denoisers(self) -> list[torch.nn.Module]:
        if self.experts is None:
            return [self.transformer]
        return [self.experts.experts[name] for name in self.trained_experts]

    def lora_components(self, text_encoders: bool = False) -> list[LoraComponent]:
        """One component per trained expert, each written to a file of its own (`<name>_high_noise.safetensors`,
        `<name>_low_noise.safetensors`) with the names a one-transformer Wan LoRA has, so that each loads alone:
        ComfyUI's LoRA loader on the matching model, diffusers' `load_lora_weights` (the low-noise file with
        `load_into_transformer_2=True`)."""
        if self.experts is None:
            return super().lora_components(text_encoders)
        return [replace(denoiser_component(self.experts.experts[name], self.files), file_part=name)
                for name in self.trained_experts]

    def lora_target_modules(self) -> list[str]:
        return [f"blocks.{index}.{target}" for index in range(self.blocks) for target in BLOCK_TARGETS]

    def use_for_training(self, module: torch.nn.Module) -> None:
        self._denoiser = module

    @cached_property
    def version(self) -> str:
        """Which Wan layout is loaded: 2.2 A14B (two experts), 2.2 TI2V-5B (per-token timesteps) or 2.1."""
        if self.experts is not None:
            return "2.2 A14B"
        return "2.2 TI2V-5B" if self.expand_timesteps else "2.1"

    def describe(self) -> dict[str, str]:
        return {"arch": self.arch, "base_model": self.source, "version": self.version,
                "prediction_type": self.noise_schedule.prediction_type}


def merge_assistant_lora(transformers: dict[str, WanTransformer3DModel | None], path: str,
                         trained: list[str]) -> None:
    """Merge an assistant LoRA file (any form WanPipeline's loader reads) into the training transformer; with two
    experts, each trained expert's own file (`x_high_noise.safetensors` and `x_low_noise.safetensors`, `path` naming
    either) into that expert (never into an expert that only renders samples)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"model.assistant_lora_path: file not found: {path}")
    experts = len(transformers) > 1
    if experts and part_file(file, EXPERTS[0], list(EXPERTS)) == file == part_file(file, EXPERTS[1], list(EXPERTS)):
        raise UserError(f"model.assistant_lora_path: {path}: a model with two experts takes one assistant LoRA per "
                        "expert, named <x>_high_noise.safetensors and <x>_low_noise.safetensors; name either")
    for name, transformer in transformers.items():
        expert = EXPERT_OF.get(name, "")
        if transformer is None or (experts and expert not in trained):
            continue
        own = part_file(file, expert, list(EXPERTS)) if experts else file
        if not own.is_file():
            raise FileNotFoundError(f"model.assistant_lora_path: no {own.name} beside {path} for the {expert} expert")
        state, metadata = WanPipeline.lora_state_dict(str(own), return_lora_metadata=True)
        merge_lora_state(transformer, state, WanAdapter.files.prefix, metadata)
