"""Z-Image: ZImageTransformer2DModel + Qwen3 text encoder (chat template, second-to-last hidden state) +
16-channel VAE + rectified flow.

Conventions, as ZImagePipeline.__call__ and diffusers' Z-Image LoRA example apply them:
- latents = (VAE sample - shift_factor) * scaling_factor;
- the transformer takes a list of [C, 1, H, W] latents (F = 1 frame), a list of per-prompt caption features
  without padding, and t = (1000 - timestep) / 1000 = 1 - sigma (it counts from noise to image);
- its output is the negated flow velocity: the pipeline feeds -output to the Euler step, so the prediction
  that matches the flow target (noise - latents) is -output.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

from toolkit.device import memory_debug, safe_module_to_device, to_device
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
from toolkit.models.base_parts import BaseParts, ldm_vae_converter
from toolkit.models.common import (
    dynamic_shift_schedule,
    encoder_identity,
    first_weight,
    is_single_file,
    pretrained_denoiser,
    vae_latent_dist,
    vae_latents,
)
from toolkit.models.zimage.config import FACTS, ZImageModelConfig
from toolkit.models.zimage.files import COMFY_TOKENIZERS, original_layout, zimage_files
from toolkit.models.zimage.tiny import QWEN3_CHAT_TEMPLATE, ensure_tiny_zimage, ensure_tiny_zimage_turbo
from toolkit.network.lora import merge_lora_state
from toolkit.paths import normalize_path
from toolkit.quantize import quantize_blockwise

#: where a single-file transformer's other parts (text encoder, tokenizer, VAE, scheduler) and its config come
#: from when `model.single_file_config` is not given: the repo diffusers itself picks for Z-Image checkpoints
DEFAULT_COMPONENTS = "Tongyi-MAI/Z-Image-Turbo"

#: `name_or_path` values that build a tiny random model offline
TINY_SOURCES: dict[str, Callable[[], Path]] = {"tiny": ensure_tiny_zimage, "tiny-turbo": ensure_tiny_zimage_turbo}

#: ZImagePipeline's default `max_sequence_length`: prompts are padded (and cut) to this many tokens
MAX_SEQUENCE_LENGTH = 512

#: LoRA targets by default: the attention projections of every block
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")

#: the spatial patch size the pipeline runs the transformer with (ZImageTransformer2DModel.forward's default)
PATCH_SIZE = 2


class ZImageText(TextRules):
    """Prompts inside Qwen3's chat template, padded (and cut) to `max_sequence_length` tokens."""

    def overlong_prompts(self, prompts: list[str]) -> list[int]:
        a = self.adapter
        texts = [a.chat_prompt(p) for p in prompts]
        lengths = [len(ids) for ids in a.tokenizer(texts, truncation=False).input_ids]
        return [i for i, length in enumerate(lengths) if length > a.max_sequence_length]

    def caption_token_span(self, length: int) -> tuple[int, int]:
        """The caption's tokens sit inside the chat template: the template's own tokens stay in place."""
        before, after = self._template_token_counts
        return before, max(before, length - after)  # a caption cut at max_sequence_length lost its template tail

    @cached_property
    def _template_token_counts(self) -> tuple[int, int]:
        marker = "\x00difftune-caption\x00"
        head, tail = self.adapter.chat_prompt(marker).split(marker)
        tokenizer = self.adapter.tokenizer
        return len(tokenizer(head).input_ids), len(tokenizer(tail).input_ids)


class ZImageSampling(SamplingParts):
    """ZImagePipeline over the current components; a separate sampling transformer (e.g. Turbo) when one is set,
    carrying the trained LoRA through shared tensors."""

    #: Z-Image's guidance is pos + g (pos - neg), so 0 is off: what Turbo (the usual preview model) needs
    default_guidance_scale = 0.0

    def pipeline(self) -> ZImagePipeline:
        """Its guidance is pos + g (pos - neg), so guidance_scale 0 turns CFG off (Turbo) and a negative prompt
        only counts when g > 0."""
        a = self.adapter
        return ZImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(a.scheduler.config),
            vae=a.vae,
            text_encoder=a.text_encoder,
            tokenizer=a.tokenizer,
            transformer=a.sampling_transformer if a.sampling_transformer is not None else a.transformer,
        )

    @torch.no_grad()
    def conditioning(self, prompt: str, negative: str) -> dict[str, list[torch.Tensor]]:
        """ZImagePipeline takes the per-prompt caption features the adapter computes (the same tensors its own
        encode_prompt gives), negative included so that guidance needs no text encoder either."""
        a = self.adapter
        positive, negative_features = a.caption_features(a.encode_prompts([prompt, negative or ""]), a.compute_dtype)
        return {"prompt_embeds": [positive], "negative_prompt_embeds": [negative_features]}

    def mirrors(self) -> list[torch.nn.Module]:
        return [] if self.adapter.sampling_transformer is None else [self.adapter.sampling_transformer]

    def only_modules(self) -> list[torch.nn.Module]:
        return self.mirrors()


def transformer_converter(part, config: dict):
    """diffusers' converter of the original names (fused qkv, `final_layer`, `x_embedder`); none for diffusers'."""
    if not original_layout(part):
        return None
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    return convert_z_image_transformer_checkpoint_to_diffusers


class ZImageAdapter(ModelAdapter):
    arch = "zimage"
    facts = FACTS
    # prefix: ZImageLoraLoaderMixin._lora_loadable_modules. ComfyUI maps `diffusion_model.<diffusers module path>`
    # (to_q/to_k/to_v included, into its fused qkv) for Z-Image, and diffusers' Z-Image LoRA loader strips the same
    # prefix; ai-toolkit saves Z-Image LoRAs so. The prefix joins the module path with "."
    # (diffusion_model.layers.0.attention.to_q), not kohya's "_": ComfyUI has no `lora_unet_*_to_q` names for
    # Z-Image. kohya_base_model: ai-toolkit's base-model version for Z-Image.
    files = LoraFileFormat(prefix="transformer", comfy_prefix="diffusion_model", comfy_separator=".",
                           kohya_base_model="zimage", modelspec_architecture="z-image/lora")
    text_rules = ZImageText
    sampling_parts = ZImageSampling
    sharded_blocks = ("noise_refiner", "context_refiner", "siglip_refiner", "layers")

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, source: str,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH):
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.source = source
        self.max_sequence_length = max_sequence_length
        #: the dtype the transformer computes in (kept from loading: quantized weights may report another)
        self.compute_dtype = transformer.dtype
        self.noise_schedule = FlowMatchNoiseSchedule(scheduler.config.num_train_timesteps,
                                                     dynamic_shift_schedule(scheduler.config), PATCH_SIZE)
        self.divisor = 2 ** (len(vae.config.block_out_channels) - 1) * PATCH_SIZE
        self._denoiser: torch.nn.Module = transformer
        #: a separate transformer for sample images (e.g. Turbo); None renders with the training transformer
        self.sampling_transformer: torch.nn.Module | None = None

    # --- loading ------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, model_cfg: ZImageModelConfig, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False, sampling_models: bool = True,
             empty_denoiser: bool = False) -> ZImageAdapter:
        """The separate sampling transformer first (quantized if asked, then parked on the CPU), so that its
        load never meets the training transformer on the accelerator; then the training transformer (with the
        assistant LoRA merged before any quantization), quantized block by block onto the accelerator."""
        sampling = None
        if model_cfg.sampling is not None and sampling_models:
            with memory_debug("sampling transformer load", debug_memory):
                sampling = cls.load_sampling_transformer(model_cfg, device, dtype, debug_memory)
        source = cls.resolve_source(model_cfg.name_or_path)
        with memory_debug("model load", debug_memory):
            found = BaseParts(zimage_files(), model_cfg, source, cls.resolve_source, lambda _: DEFAULT_COMPONENTS)
            transformer = found.denoiser(ZImageTransformer2DModel, "transformer", dtype, empty_denoiser,
                                         converter=transformer_converter).eval()
            transformer.requires_grad_(False)
            # transformers 5 takes `dtype`; Qwen3Model also reads the text encoders saved as Qwen3ForCausalLM
            text_encoder = found.text_encoders(
                {"qwen3_4b": ("text_encoder", lambda c: Qwen3Model(Qwen3Config(**c)), Qwen3Model)}, dtype)["qwen3_4b"]
            vae = found.vae(AutoencoderKL, dtype, converter=ldm_vae_converter)
            tokenizer = found.tokenizers({"tokenizer": AutoTokenizer})["tokenizer"]
            if COMFY_TOKENIZERS["tokenizer"] in found.origins["tokenizer"]:
                # ComfyUI's Qwen tokenizer folder is Qwen2.5-VL's, whose template adds a system turn; Z-Image's
                # prompts are Qwen3's, as ComfyUI also writes them
                tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
            parts = (vae, text_encoder, tokenizer, found.scheduler(FlowMatchEulerDiscreteScheduler))
        if model_cfg.assistant_lora_path:
            with memory_debug("assistant LoRA load", debug_memory):
                merge_assistant_lora(transformer, normalize_path(model_cfg.assistant_lora_path,
                                                                   "model.assistant_lora_path"))
        adapter = cls(transformer, *parts, source=source)
        adapter.parts_from = found.origins
        adapter.compute_dtype = dtype
        adapter.sampling_transformer = sampling
        adapter._quantize_and_place(model_cfg, device, debug_memory)
        return adapter

    @classmethod
    def load_sampling_transformer(cls, model_cfg: ZImageModelConfig, device: torch.device, dtype: torch.dtype,
                                  debug_memory: bool) -> ZImageTransformer2DModel:
        cfg = model_cfg.sampling
        # a single-file sampling transformer takes its config from single_file_config, else from the training
        # model's folder when there is one (offline), else from the hub default
        training = cls.resolve_source(model_cfg.name_or_path)
        fallback = training if not is_single_file(training) else DEFAULT_COMPONENTS
        components = cls.resolve_source(model_cfg.single_file_config or fallback, "model.single_file_config")
        source = cls.resolve_source(cfg.name_or_path, "model.sampling.name_or_path")
        transformer = cls.load_transformer(source, dtype, subfolder=cfg.subfolder, config_source=components)
        if cfg.quantize:
            with memory_debug("sampling transformer quantization", debug_memory):
                quantize_blockwise(transformer, cfg.qtype, cls.quantization_blocks(transformer),
                                   list(cls.QUANTIZATION_EXCLUDE), device)
        return safe_module_to_device(transformer, "cpu")

    def _quantize_and_place(self, model_cfg: ZImageModelConfig, device: torch.device, debug_memory: bool) -> None:
        """Quantize what the config asks (block by block onto the accelerator), then place the rest: with
        `low_vram` the text encoder and VAE stay on the CPU until the trainer needs them."""
        if model_cfg.quantize:
            with memory_debug("transformer quantization", debug_memory):
                quantize_blockwise(self.transformer, model_cfg.qtype, self.quantization_blocks(self.transformer),
                                   list(self.QUANTIZATION_EXCLUDE), device)
        if model_cfg.quantize_te:
            # on the accelerator block by block (fast, one block of peak), then parked if low_vram; quanto leaves
            # the embeddings and norms alone by itself
            with memory_debug("text encoder quantization", debug_memory):
                quantize_blockwise(self.text_encoder, model_cfg.qtype_te, list(self.text_encoder.layers), None,
                                   device)
        for module in (self.vae, self.text_encoder):
            module.requires_grad_(False)
            module.eval()
        safe_module_to_device(self.transformer, device)
        for module in (self.vae, self.text_encoder):
            safe_module_to_device(module, "cpu" if model_cfg.low_vram else device)

    @staticmethod
    def resolve_source(name_or_path: str, key: str = "model.name_or_path") -> str:
        """A folder, hub id or file; `tiny` / `tiny-turbo` become the tiny presets' folders. `key` names the
        config key when a local-looking path does not exist."""
        name_or_path = normalize_path(name_or_path, key)
        return str(TINY_SOURCES[name_or_path]()) if name_or_path in TINY_SOURCES else name_or_path

    @classmethod
    def load_transformer(cls, source: str, dtype: torch.dtype, subfolder: str | None = "transformer",
                         config_source: str | None = None, variant: str | None = None,
                         revision: str | None = None, empty: bool = False) -> ZImageTransformer2DModel:
        """A Z-Image transformer from a diffusers folder or hub id (`subfolder` inside it; None for a bare
        transformer folder) or from a single .safetensors file in the original/ComfyUI layout (fused qkv).

        A single file carries no config: it comes from `config_source`'s transformer subfolder (default
        Tongyi-MAI/Z-Image-Turbo). diffusers' own converter (`convert_z_image_transformer_checkpoint_to_diffusers`,
        behind `from_single_file`) splits qkv into to_q/to_k/to_v and renames out/q_norm/k_norm/x_embedder/
        final_layer, with or without the `model.diffusion_model.` prefix. Also loads the trainer's separate
        sampling transformer. Weights are frozen and in eval mode.
        """
        source = cls.resolve_source(source)
        if is_single_file(source):
            transformer = cls._transformer_from_single_file(source, dtype, config_source or DEFAULT_COMPONENTS)
        else:
            transformer = pretrained_denoiser(ZImageTransformer2DModel, source, subfolder, dtype, empty, variant=variant,
                                              revision=revision)
        transformer.requires_grad_(False)
        return transformer.eval()

    @classmethod
    def _transformer_from_single_file(cls, path: str, dtype: torch.dtype, config_source: str):
        if not Path(path).is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        config_source = cls.resolve_source(config_source)
        return ZImageTransformer2DModel.from_single_file(
            path, config=config_source, subfolder="transformer", local_files_only=Path(config_source).is_dir(),
            torch_dtype=dtype)

    @property
    def device(self) -> torch.device:
        # the first parameter: diffusers' `.device` walks every submodule (milliseconds per call, per step)
        return first_weight(self.transformer).device

    # --- text ---------------------------------------------------------------------------------------------

    def chat_prompt(self, prompt: str) -> str:
        """The prompt wrapped in the chat template exactly as ZImagePipeline._encode_prompt does."""
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=True)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Qwen3's second-to-last hidden state over the chat-templated prompts, as the pipeline computes it.

        The pipeline hands the transformer a list of variable-length embeddings (padding dropped). Here every
        prompt keeps its fixed `max_sequence_length` padding and the mask says which tokens are real, so
        batches, cached entries and the blank prompt stack and concatenate; `predict` drops the padding again.
        """
        tokens = self.tokenize(self.tokenizer, [self.chat_prompt(p) for p in prompts], self.max_sequence_length)
        device = first_weight(self.text_encoder).device
        mask = tokens.attention_mask.bool()
        hidden = self.text_encoder(input_ids=to_device(tokens.input_ids, device), attention_mask=to_device(mask, device),
                                   output_hidden_states=True).hidden_states[-2]
        return PromptEmbeds(hidden, mask, mask.sum(dim=1))

    @staticmethod
    def caption_features(embeds: PromptEmbeds, dtype: torch.dtype) -> list[torch.Tensor]:
        """The transformer's caption input: one [tokens, dim] tensor per prompt, padding dropped."""
        rows = embeds.embeds.to(dtype)
        if embeds.attention_mask is None:
            return list(rows.unbind(0))
        # the kept positions come from the host mask: a boolean index on the device would wait for it
        kept = [keep.nonzero().squeeze(1) for keep in embeds.attention_mask.cpu().bool()]
        return [row.index_select(0, to_device(index, rows.device)) for row, index in zip(rows, kept)]

    # --- images -------------------------------------------------------------------------------------------

    def encode_latent_dist(self, pixels: torch.Tensor) -> LatentDist:
        return vae_latent_dist(self.vae, pixels)

    def latents_from_dist(self, dist: LatentDist, generator: torch.Generator | None = None) -> torch.Tensor:
        # the pipeline decodes latents / scaling_factor + shift_factor: training latents are the inverse
        return vae_latents(dist, generator, self.vae.config.scaling_factor, self.vae.config.shift_factor)

    def image_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.vae]

    def text_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.text_encoder]

    def encoder_identity(self, part: str) -> str:
        # the chat template and the padded length shape the text embeddings too
        extra = f"{self.tokenizer.chat_template}|{len(self.tokenizer)}|{self.max_sequence_length}" if part == "text" else ""
        return encoder_identity(self.arch, part, self.source, {"image": self.vae, "text": self.text_encoder}[part], extra)

    # --- denoiser -----------------------------------------------------------------------------------------

    def transformer_timesteps(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Our timestep (1000 sigma) -> the transformer's t = (1000 - timestep) / 1000 = 1 - sigma."""
        total = self.noise_schedule.num_train_timesteps
        return (total - timesteps.float()) / total

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: torch.nn.Module | None = None, image_sizes: torch.Tensor | None = None,
                expert: Expert | None = None,
                references: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The flow velocity (noise - latents) for a [B, C, H, W] batch, float32 like the pipeline's."""
        denoiser = module if module is not None else self._denoiser
        dtype = self.compute_dtype
        latents = list(noisy.to(dtype).unsqueeze(2).unbind(0))  # [C, 1, H, W] each
        out = denoiser(latents, self.transformer_timesteps(timesteps).to(noisy.device),
                       self.caption_features(embeds, dtype), return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def trainable_module(self) -> torch.nn.Module:
        return self.transformer

    def lora_target_modules(self) -> list[str]:
        """The attention projections of every block (refiners included): diffusers' Z-Image LoRA default.
        `network.target_modules` can add the SwiGLU feed-forward (`feed_forward.w1`, `w2`, `w3`), as ai-toolkit
        does; both file forms save and load them."""
        return list(ATTENTION_TARGETS)

    def use_for_training(self, module: torch.nn.Module) -> None:
        self._denoiser = module

    # --- quantization (used by the trainer) ---------------------------------------------------------------

    #: fnmatch patterns over the transformer's module names (quanto's `exclude=`) that stay in full precision:
    #: the x/caption/timestep embedders and the final layer are small and precision-sensitive (diffusers
    #: skips t_embedder/cap_embedder in layerwise casting too), and the norms (RMSNorms in every block)
    QUANTIZATION_EXCLUDE = ("all_x_embedder.*", "t_embedder.*", "cap_embedder.*", "all_final_layer.*", "*norm*")

    @staticmethod
    def quantization_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
        """The repeated transformer blocks, in order (noise_refiner, context_refiner, then the main layers),
        to quantize one at a time so that peak memory stays at one block. The pad tokens are parameters of
        the transformer itself and stay as loaded."""
        return [block for name in ("noise_refiner", "context_refiner", "layers")
                for block in getattr(transformer, name)]

    # --- sampling -----------------------------------------------------------------------------------------

    def describe(self) -> dict[str, str]:
        return {"arch": self.arch, "base_model": self.source, "prediction_type": self.noise_schedule.prediction_type}


def merge_assistant_lora(transformer: torch.nn.Module, path: str) -> None:
    """Merge an assistant LoRA file (diffusers, ComfyUI or ai-toolkit keys: ZImagePipeline's loader converts
    them) into the training transformer."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"model.assistant_lora_path: file not found: {path}")
    state, metadata = ZImagePipeline.lora_state_dict(path, return_lora_metadata=True)
    merge_lora_state(transformer, state, ZImageAdapter.files.prefix, metadata)
