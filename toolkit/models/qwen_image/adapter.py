"""Qwen-Image: QwenImageTransformer2DModel over 2x2-packed 16-channel latents, the Qwen2.5-VL text encoder behind a
prompt template, AutoencoderKLQwenImage, rectified flow with a resolution-dependent shift.

Conventions, as QwenImagePipeline.__call__ applies them:
- prompts are wrapped in the pipeline's template, encoded by the language model (last hidden state), the template's
  first 34 tokens dropped, padding dropped, then zero-padded to the batch's longest prompt with a mask (the mask is
  left out when no prompt is padded);
- the VAE encodes one-frame videos ([B, 3, 1, H, W]); latents = (sample - latents_mean) / latents_std per channel;
- the transformer takes sigma (timestep / 1000) and predicts the flow velocity noise - latents, which the Euler step
  integrates: x_next = x + (sigma_next - sigma) v;
- guidance is true classifier-free guidance with a negative prompt (`true_cfg_scale`), no guidance embedding.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from toolkit.device import memory_debug, to_device
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
from toolkit.models.base_parts import BaseParts
from toolkit.models.common import (
    ChannelNormalizedLatents,
    dynamic_shift_schedule,
    encoder_identity,
    first_weight,
    is_single_file,
    place_frozen,
    pretrained_denoiser,
    subfolder_weight_files,
    transformers_quantization,
    weights_placement,
)
from toolkit.models.part_kinds import comfy_qwen25_vl_names
from toolkit.models.qwen_image.config import FACTS, QwenImageModelConfig
from toolkit.models.qwen_image.files import qwen_image_files
from toolkit.models.single_files import FamilyFiles
from toolkit.models.qwen_image.tiny import ensure_tiny_qwen_image
from toolkit.network.lora import merge_lora_state
from toolkit.paths import normalize_path
from toolkit.quantize import (
    StreamedWeights,
    load_quantized,
    quantize_blockwise,
)

#: where a single-file transformer's other parts and its config come from when `model.single_file_config` is not
#: given
DEFAULT_COMPONENTS = "Qwen/Qwen-Image"

#: QwenImagePipeline's prompt template (`prompt_template_encode`) and the number of its leading tokens dropped from
#: the embeddings (`prompt_template_encode_start_idx`); a test holds them equal to the pipeline's
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_DROP = 34
#: QwenImagePipeline's `tokenizer_max_length`: tokens after the template's prefix
MAX_TOKENS = 1024

#: the LoRA targets in each block: image and text attention, their output projections and both MLPs (the
#: modulation linears `img_mod.1` / `txt_mod.1` stay out, as with FLUX.1)
BLOCK_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                 "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                 "txt_mlp.net.2")

#: what the last block does for the text stream alone: its text output is not used after it (only the image stream
#: reaches the final layer), so LoRA weights there would get no gradient (and multi-process training would stop on
#: them)
LAST_BLOCK_TEXT_ONLY = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")

#: the transformer's token packing: 2x2 latent pixels per token
PATCH_SIZE = 2

class QwenImageText(TextRules):
    """The caption sits inside the template: after the dropped prefix, its tokens come first and the template's
    tail (`<|im_end|>`, the assistant turn) last. Prompts keep their own length (batches pad to the longest)."""

    variable_length = True

    def caption_token_span(self, length: int) -> tuple[int, int]:
        return 0, max(0, length - self._tail_tokens)

    def overlong_prompts(self, prompts: list[str]) -> list[int]:
        a = self.adapter
        texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
        lengths = [len(ids) - TEMPLATE_DROP for ids in a.tokenizer(texts, truncation=False).input_ids]
        return [i for i, length in enumerate(lengths) if length > a.max_sequence_length]

    @cached_property
    def _tail_tokens(self) -> int:
        return len(self.adapter.tokenizer(PROMPT_TEMPLATE.split("{}")[1]).input_ids)


class QwenImageSampling(SamplingParts):
    """QwenImagePipeline over the current components, fed the adapter's prompt embeddings (the text encoder leaves
    before the transformer samples). Guidance is true CFG: `sample.guidance_scale` is the pipeline's
    `true_cfg_scale` (4.0 by default, as the pipeline's), with `sample.neg` (or " " when empty, as Qwen-Image's own
    example does) as the negative prompt; 1 or less samples without guidance."""

    default_guidance_scale = 4.0

    def pipeline(self) -> QwenImagePipeline:
        a = self.adapter
        return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(a.scheduler.config), vae=a.vae,
                                 text_encoder=a.text_encoder, tokenizer=a.tokenizer, transformer=a.transformer)

    def pipeline_arguments(self, text: dict, guidance: float) -> dict:
        """`true_cfg_scale`, and `max_sequence_length` (the pipeline cuts even given embeddings at it: 512 unless
        told)."""
        if guidance <= 1:  # the pipeline would warn that a negative prompt without guidance is unused
            text = {k: v for k, v in text.items() if not k.startswith("negative")}
        return {**text, "true_cfg_scale": guidance, "max_sequence_length": self.adapter.max_sequence_length}

    def negative_prompt(self, negative: str) -> str:
        return negative or " "

    @torch.no_grad()
    def conditioning(self, prompt: str, negative: str) -> dict[str, torch.Tensor]:
        """Each prompt encoded alone, as the pipeline encodes positive and negative separately; the masks are
        passed (all ones for one prompt) so that the pipeline does not warn about their absence."""
        a = self.adapter
        positive, negative_embeds = (a.encode_prompts([p]) for p in (prompt, self.negative_prompt(negative)))
        device = a.text_encoder.device

        def mask(embeds: PromptEmbeds) -> torch.Tensor:
            return to_device(embeds.attention_mask.long(), device)

        return {"prompt_embeds": positive.embeds, "prompt_embeds_mask": mask(positive),
                "negative_prompt_embeds": negative_embeds.embeds, "negative_prompt_embeds_mask": mask(negative_embeds)}


class QwenImageAdapter(ModelAdapter):
    arch = "qwen_image"
    facts = FACTS
    # prefix: QwenImageLoraLoaderMixin._lora_loadable_modules. ComfyUI's Qwen-Image model keeps diffusers' module
    # paths, and its LoRA loader maps `diffusion_model.<path>` (kohya's lora_down/lora_up/alpha names); diffusers'
    # QwenImagePipeline.load_lora_weights strips the same prefix and applies alpha / rank.
    files = LoraFileFormat(prefix="transformer", comfy_prefix="diffusion_model", comfy_separator=".",
                           kohya_base_model="qwen_image", modelspec_architecture="qwen-image/lora")
    text_rules = QwenImageText
    sampling_parts = QwenImageSampling
    sharded_blocks = ("transformer_blocks",)
    #: where a single-file transformer's other parts and its config come from by default
    default_components: ClassVar[str] = DEFAULT_COMPONENTS

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, source: str,
                 max_sequence_length: int = MAX_TOKENS):
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
        self.vae_scale = 2 ** len(vae.temperal_downsample)
        self.divisor = self.vae_scale * PATCH_SIZE
        self._denoiser: torch.nn.Module = transformer
        #: latents normalised with the VAE's per-channel mean and std, as the pipeline denormalises them
        self.latent_norm = ChannelNormalizedLatents(vae.config, spatial_dims=2)

    # ---- loading -----------------------------------------------------------------------------------

    @classmethod
    def load(cls, model_cfg: QwenImageModelConfig, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False, sampling_models: bool = True,
             empty_denoiser: bool = False) -> QwenImageAdapter:
        """The transformer (read and quantized block by block onto the accelerator with `quantize`, so that it is
        never whole in full precision), the text encoder (quantized by transformers as its weights load with
        `quantize_te`), VAE, tokenizer and scheduler; then everything placed."""
        source = cls.resolve_source(model_cfg.name_or_path)
        single = is_single_file(source)
        components = cls.resolve_source(model_cfg.single_file_config or cls.default_components_for(model_cfg),
                                        "model.single_file_config") if single else source
        kw = {"variant": None if single else model_cfg.variant, "revision": None if single else model_cfg.revision}
        kinds = cls.file_kinds()
        files = BaseParts(kinds, model_cfg, source, cls.resolve_source, lambda _: components) if kinds else None
        # a single file of a known variant takes that variant's shipped configs (`single_file_config` overrides)
        variant = (kinds.denoiser.variant(files.header())[1]
                   if kinds and single and not model_cfg.single_file_config else None)
        options = cls.adapter_options(model_cfg, components)  # read before anything loads: a wrong model stops here
        # an assistant LoRA is merged in full precision, before any quantization
        qtype = model_cfg.qtype if model_cfg.quantize and not model_cfg.assistant_lora_path else None
        with memory_debug("transformer load" + (" and quantization" if qtype else ""), debug_memory):
            transformer = cls.load_transformer(source, components, dtype, qtype, device, empty=empty_denoiser,
                                               config=variant.config("transformer") if variant else None, **kw)
            origins = {"transformer": f"{source} ({variant.title})" if variant else source}
        if model_cfg.assistant_lora_path:
            with memory_debug("assistant LoRA load", debug_memory):
                merge_assistant_lora(transformer, normalize_path(model_cfg.assistant_lora_path,
                                                                   "model.assistant_lora_path"))
            if model_cfg.quantize:  # merged in full precision first, so this transformer was loaded whole
                with memory_debug("transformer quantization", debug_memory):
                    quantize_blockwise(transformer, model_cfg.qtype, list(transformer.transformer_blocks),
                                       list(cls.QUANTIZATION_EXCLUDE), device)
        te_qtype = model_cfg.qtype_te if model_cfg.quantize_te else None
        text_files = files is not None and files.text_files
        with memory_debug("text encoder, VAE load", debug_memory):
            vae, text_encoder, tokenizer, scheduler, *more = cls.load_components(
                components, dtype, te_qtype, device, **kw, **({"with_text": False} if text_files else {}))
            if text_files:
                text_encoder = cls.text_encoder_from_file(files, dtype, te_qtype, device)
                tokenizer = files.tokenizers({"tokenizer": AutoTokenizer})["tokenizer"]
                origins.update(files.origins)
            if variant is not None:
                scheduler = FlowMatchEulerDiscreteScheduler.from_config(variant.config("scheduler"))
        adapter = cls(transformer, vae, text_encoder, tokenizer, scheduler, *more, source=source, **options)
        adapter.parts_from = origins
        adapter.compute_dtype = dtype
        place_frozen(transformer, [adapter.vae, adapter.text_encoder], device, model_cfg.low_vram)
        return adapter

    @classmethod
    def file_kinds(cls) -> FamilyFiles | None:
        """What the family takes as single files (its transformer's variants, its text encoder); None where a single
        file still takes its configs and other parts from `single_file_config` (Qwen-Image-Edit)."""
        return qwen_image_files()

    @classmethod
    def text_encoder_from_file(cls, files: BaseParts, dtype: torch.dtype, qtype: str | None,
                               device: torch.device) -> Qwen2_5_VLForConditionalGeneration:
        """Qwen2.5-VL from `model.text_encoder_path` (ComfyUI's file: the language model and vision tower in
        transformers' older names, no LM head, which the text path never runs: it shares the embeddings' weights),
        fp8 kept as stored; quantized block by block where asked."""
        encoder = files.text_encoders(
            {"qwen25_vl_7b": ("text_encoder", lambda c: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**c)),
                              Qwen2_5_VLForConditionalGeneration)}, dtype,
            converters={"qwen25_vl_7b": lambda part, _: comfy_qwen25_vl_names if part.has("model.embed_tokens.weight")
                        else None},
            optional={"qwen25_vl_7b": ("lm_head.weight",)})["qwen25_vl_7b"]
        if encoder.lm_head.weight.device.type == "meta":
            encoder.lm_head.weight = encoder.model.language_model.embed_tokens.weight
        if qtype:
            quantize_blockwise(encoder, qtype, list(encoder.model.language_model.layers), ["lm_head"], device,
                               keep_quantized=True)
        return encoder

    @classmethod
    def default_components_for(cls, model_cfg: QwenImageModelConfig) -> str:
        """The components a single file takes where `model.single_file_config` names none."""
        return cls.default_components

    @classmethod
    def adapter_options(cls, model_cfg: QwenImageModelConfig, components: str) -> dict:
        """The adapter's own options from the config (and the folder its parts come from)."""
        return {"max_sequence_length": model_cfg.max_sequence_length}

    @staticmethod
    def resolve_source(name_or_path: str, key: str = "model.name_or_path") -> str:
        """A folder, hub id or file; `tiny` becomes the tiny preset's folder."""
        name_or_path = normalize_path(name_or_path, key)
        return str(ensure_tiny_qwen_image()) if name_or_path == "tiny" else name_or_path

    @classmethod
    def load_transformer(cls, source: str, components: str, dtype: torch.dtype, qtype: str | None = None,
                         device: torch.device | str = "cpu", variant: str | None = None,
                         revision: str | None = None, empty: bool = False,
                         config: dict | None = None) -> QwenImageTransformer2DModel:
        """The transformer, frozen. With `qtype`, or from a single file, it is built empty from its config and read
        layer by layer onto `device` (quantized on the way with `qtype`; toolkit.quantize.load_quantized), so it is
        never whole in full precision. A single file (ComfyUI's layout: diffusers' names, with or without a
        `model.diffusion_model.` prefix) takes its config from `components`. Otherwise diffusers' `from_pretrained`."""
        single = is_single_file(source)
        if not single and qtype is None:
            transformer = pretrained_denoiser(QwenImageTransformer2DModel, source, "transformer", dtype, empty,
                                              variant=variant, revision=revision)
            transformer.requires_grad_(False)
            return transformer.eval()
        from accelerate import init_empty_weights

        if single and not Path(source).is_file():
            raise FileNotFoundError(f"model file not found: {source}")
        # the config alone: a single file's known variant's, or from the folder (from the hub: config.json only)
        if config is None:
            config = QwenImageTransformer2DModel.load_config(components, subfolder="transformer",
                                                             revision=None if single else revision)
        with init_empty_weights():
            transformer = QwenImageTransformer2DModel.from_config(config)
        files = [Path(source)] if single else subfolder_weight_files(source, "transformer", variant, revision)
        weights = StreamedWeights(files, strip=("model.diffusion_model.", "diffusion_model."))
        blocks = [f"transformer_blocks.{i}" for i in range(len(transformer.transformer_blocks))]
        where = source if single else str(files[0].parent)
        return load_quantized(transformer, weights, dtype, qtype, blocks, list(cls.QUANTIZATION_EXCLUDE), device,
                              where)

    @staticmethod
    def load_components(source: str, dtype: torch.dtype, te_qtype: str | None, device: torch.device,
                        variant: str | None = None, revision: str | None = None, with_text: bool = True) -> tuple:
        """VAE, text encoder (quantized by transformers' quanto support as its weights load, when `te_qtype` is
        given: onto the accelerator, so quantizing is fast there), tokenizer and scheduler (the text encoder and
        tokenizer None without `with_text`: they come from files)."""
        kw = {"variant": variant, "revision": revision}
        text_encoder = tokenizer = None
        if with_text:
            quantized = transformers_quantization(te_qtype, device)
            text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(source, subfolder="text_encoder",
                                                                              dtype=dtype, **quantized, **kw)
            tokenizer = AutoTokenizer.from_pretrained(source, subfolder="tokenizer", revision=revision)
        vae = AutoencoderKLQwenImage.from_pretrained(source, subfolder="vae", torch_dtype=dtype, **kw)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler", revision=revision)
        return vae, text_encoder, tokenizer, scheduler

    #: fnmatch patterns over the transformer's module names that stay in full precision: the image and text input
    #: projections, the text norm, the timestep embedding and the final norm and projection (small and
    #: precision-sensitive). The blocks' modulation linears are quantized with their blocks.
    QUANTIZATION_EXCLUDE = ("img_in", "txt_in", "txt_norm", "time_text_embed.*", "norm_out.*", "proj_out")

    @property
    def device(self) -> torch.device:
        # the first parameter: diffusers' `.device` walks every submodule (milliseconds per call, per step)
        return first_weight(self.transformer).device

    # ---- text ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """As QwenImagePipeline.encode_prompt: the templated prompts through the language model (its last hidden
        state; the LM head is not run), the template's first 34 tokens and the padding dropped, cut at
        `max_sequence_length`, zero-padded to the longest prompt with a mask."""
        tokens = self.tokenize(self.tokenizer, [PROMPT_TEMPLATE.format(p) for p in prompts], MAX_TOKENS + TEMPLATE_DROP,
                               pad_to_max=False)
        device = first_weight(self.text_encoder).device
        hidden = self.text_encoder.model(input_ids=to_device(tokens.input_ids, device),
                                         attention_mask=to_device(tokens.attention_mask, device)).last_hidden_state
        # the kept positions come from the host mask: indexing with a device mask would wait for the device
        kept = [row.nonzero().squeeze(1)[TEMPLATE_DROP:][:self.max_sequence_length]
                for row in tokens.attention_mask.bool()]
        rows = [h.index_select(0, to_device(index, device)) for h, index in zip(hidden, kept)]
        lengths = torch.tensor([len(index) for index in kept])
        return PromptEmbeds.padded(rows, lengths)

    def text_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.text_encoder]

    # ---- images ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_latent_dist(self, pixels: torch.Tensor) -> LatentDist:
        """The VAE posterior of one-frame videos ([B, 3, 1, H, W], as the pipeline decodes), frame axis dropped."""
        posterior = self.vae.encode(pixels.to(**weights_placement(self.vae)).unsqueeze(2)).latent_dist
        return LatentDist(posterior.mean.squeeze(2), posterior.std.squeeze(2))

    def latents_from_dist(self, dist: LatentDist, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.latent_norm.sample(dist, generator)

    def image_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.vae]

    def encoder_identity(self, part: str) -> str:
        if part == "image":
            return encoder_identity(self.arch, part, self.source, self.vae)
        extra = f"{PROMPT_TEMPLATE}|{TEMPLATE_DROP}|{len(self.tokenizer)}|{self.max_sequence_length}"
        return encoder_identity(self.arch, part, self.source, self.text_encoder, extra)

    # ---- the denoiser ------------------------------------------------------------------------------

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: torch.nn.Module | None = None, image_sizes: torch.Tensor | None = None,
                expert: Expert | None = None,
                references: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The flow velocity (noise - latents) for a [B, C, H, W] batch, float32: packed as the pipeline packs,
        sigma as the timestep, the prompt mask where a prompt is padded. Reference latents (Qwen-Image-Edit) follow
        the target's tokens with their own shapes (`reference_tokens`); the output is the target's tokens alone."""
        denoiser = module if module is not None else self._denoiser
        dtype, device = self.compute_dtype, noisy.device
        batch, channels, height, width = noisy.shape
        packed = QwenImagePipeline._pack_latents(noisy.to(dtype), batch, channels, height, width)
        target_tokens, shapes = packed.shape[1], [(1, height // 2, width // 2)]
        if references:
            tokens, reference_shapes = self.reference_tokens(references, dtype, device)
            packed, shapes = torch.cat([packed, tokens], dim=1), shapes + reference_shapes
        mask = embeds.attention_mask
        mask = None if mask is None or bool(mask.all()) else to_device(mask, device)  # a host tensor: no wait
        sigma = timesteps.float() / self.noise_schedule.num_train_timesteps
        out = denoiser(hidden_states=packed, timestep=sigma.to(device, dtype),
                       encoder_hidden_states=embeds.embeds.to(dtype), encoder_hidden_states_mask=mask,
                       img_shapes=[shapes] * batch, return_dict=False)[0]
        unpacked = QwenImagePipeline._unpack_latents(out[:, :target_tokens], height * self.vae_scale,
                                                     width * self.vae_scale, self.vae_scale)
        return unpacked.squeeze(2).float()

    def reference_tokens(self, references: list[torch.Tensor], dtype: torch.dtype,
                         device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Reference latents as tokens after the target's, and each one's shape for the rotary positions: Qwen-Image
        takes none (its config refuses reference folders); Qwen-Image-Edit overrides this."""
        raise ValueError(f"{self.arch} takes no reference images")

    def trainable_module(self) -> torch.nn.Module:
        return self.transformer

    def lora_target_modules(self) -> list[str]:
        return qwen_lora_targets(len(self.transformer.transformer_blocks))

    def use_for_training(self, module: torch.nn.Module) -> None:
        self._denoiser = module

    def describe(self) -> dict[str, str]:
        return {"arch": self.arch, "base_model": self.source, "prediction_type": self.noise_schedule.prediction_type}


def qwen_lora_targets(blocks: int) -> list[str]:
    """Full module names of the default LoRA targets: `BLOCK_TARGETS` in every block, less what only the last
    block's text stream uses."""
    last = blocks - 1
    return [f"transformer_blocks.{index}.{target}" for index in range(blocks) for target in BLOCK_TARGETS
            if not (index == last and target in LAST_BLOCK_TEXT_ONLY)]


def merge_assistant_lora(transformer: torch.nn.Module, path: str) -> None:
    """Merge an assistant LoRA file (e.g. a Lightning adapter; any form QwenImagePipeline's loader reads) into the
    training transformer."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"model.assistant_lora_path: file not found: {path}")
    state, metadata = QwenImagePipeline.lora_state_dict(path, return_lora_metadata=True)
    merge_lora_state(transformer, state, QwenImageAdapter.files.prefix, metadata)
