"""The family contract: the only view of a model family the trainer has.

A small core every family implements (`ModelAdapter`: load, encode prompts, encode images, predict, the trained
module and its LoRA targets, the noise schedule), plus optional parts grouped as small typed objects with
defaults: the LoRA file format (`LoraFileFormat`, class-level), the text rules (`TextRules`) and the sampling
parts (`SamplingParts`). What a family can do is stated before any weight loads, in its config class's
`FamilyFacts` (toolkit/models/config.py), which the adapter shares as `facts`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, ClassVar

import torch

from toolkit.device import to_device
from toolkit.diffusion.schedules import NoiseSchedule
from toolkit.models.config import FamilyFacts, ModelConfigBase, ReferenceFacts
from toolkit.models.tokens import TokenMemos, Tokens


@dataclass
class PromptEmbeds:
    """Text conditioning of a batch: per-token embeddings, a mask where the family uses one, each prompt's token
    count (start and end tokens included) for token shuffling of cached embeddings, and a pooled embedding per
    prompt where the family's denoiser takes one (SDXL).

    The mask and the lengths stay on the host (`to` moves the embeddings only): they decide shapes, which
    is the host's business, and reading them from the device would stop it once per micro-batch."""

    embeds: torch.Tensor
    attention_mask: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    pooled: torch.Tensor | None = None

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> PromptEmbeds:
        pooled = None if self.pooled is None else to_device(self.pooled, device, dtype)
        return PromptEmbeds(to_device(self.embeds, device, dtype), self.attention_mask, self.lengths, pooled)

    @classmethod
    def padded(cls, rows: list[torch.Tensor], lengths: torch.Tensor) -> PromptEmbeds:
        """Prompts of their own lengths ([tokens, dim] each, `lengths` on the host) zero-padded at the end to the
        longest, with the mask saying which tokens are real (families whose prompts keep their own length)."""
        embeds, mask = join_padded([row.unsqueeze(0) for row in rows],
                                   [torch.ones(1, len(row), dtype=torch.bool) for row in rows])
        return cls(embeds, mask, lengths)


def join_padded(embeds: list[torch.Tensor], masks: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Batches of prompt embeddings ([B_i, tokens_i, dim]) and their host masks ([B_i, tokens_i]) joined along the
    batch. Batches of one length join as they are; shorter ones are zero-padded at the end to the longest, their
    masks False there (so a prompt's embeddings mean the same whatever it is batched with)."""
    longest = max(e.shape[1] for e in embeds)
    have_masks = all(m is not None for m in masks)
    if all(e.shape[1] == longest for e in embeds):
        return torch.cat(embeds), torch.cat(masks) if have_masks else None
    if not have_masks:
        raise ValueError("prompt embeddings of different lengths can only be joined with their attention masks")

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        extra = longest - tensor.shape[1]
        return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], extra, *tensor.shape[2:])], dim=1) if extra else tensor

    return torch.cat([pad(e) for e in embeds]), torch.cat([pad(m) for m in masks])


@dataclass
class LatentDist:
    """What the image encoder says about one image before sampling: a mean, and a std when the encoder
    is a VAE (None for deterministic encoders). Cached latents store this, so every epoch can still draw
    its own sample."""

    mean: torch.Tensor
    std: torch.Tensor | None = None


@dataclass(frozen=True)
class LoraFileFormat:
    """How the family's LoRA files name its trained module."""

    #: key prefix of the trained module in diffusers-form files (what `load_lora_weights` expects)
    prefix: str
    #: the same module's prefix in ComfyUI/kohya files
    comfy_prefix: str
    #: how the ComfyUI prefix and the module path join: "_" (kohya: lora_unet_down_blocks_0_...) or "."
    comfy_separator: str = "_"
    #: kohya's base-model tag in the file header
    kohya_base_model: str = ""
    #: the form of `<name>.safetensors`: the one the most tools load for this family ("comfy": ComfyUI, A1111/Forge,
    #: kohya and diffusers' load_lora_weights all read it; "diffusers" where ComfyUI has no loader)
    primary: str = "comfy"
    #: `modelspec.architecture` of the family's LoRA files (Stability AI's model spec, as kohya writes it)
    modelspec_architecture: str = ""
    #: the ComfyUI form names LoRA weights as peft does (`lora_A` / `lora_B`, with `.alpha`) instead of kohya's
    #: `lora_down` / `lora_up`: where that is the one naming every loader of the family reads alike (FLUX.1)
    comfy_peft_names: bool = False
    #: where kohya names follow another layout than diffusers' module tree: the trained module's module names ->
    #: {diffusers module path prefix: the file's path} (see toolkit.network.formats.renamed)
    comfy_renames: Callable[[list[str]], dict[str, str]] | None = None


@dataclass(frozen=True)
class LoraComponent:
    """One module the LoRA trains (the denoiser, and text encoders where they train too) and how files name it."""

    module: torch.nn.Module
    #: key prefix in diffusers-form files (`unet`, `text_encoder`, `text_encoder_2`)
    prefix: str
    #: the module's prefix in ComfyUI/kohya files (`lora_unet`, `lora_te1`, ...)
    comfy_prefix: str
    #: {module path prefix: the kohya file's path} where kohya names follow another layout (none for most)
    comfy_renames: dict[str, str] = field(default_factory=dict)
    #: how the ComfyUI prefix and the module path join ("_": kohya's flattened names, or ".")
    comfy_separator: str = "_"
    #: LoRA weights named as peft does in the ComfyUI form (LoraFileFormat.comfy_peft_names)
    comfy_peft_names: bool = False
    #: a text encoder: the diffusers form uses diffusers' text-encoder key names and `diffusers_renames`
    text_encoder: bool = False
    #: {module path prefix: the diffusers file's path} (a CLIP text model's `text_model.` level, see
    #: `clip_text_model_renames`)
    diffusers_renames: dict[str, str] = field(default_factory=dict)
    #: the final files this component goes in: "" for <name>.safetensors (with the other components), else
    #: <name>_<file_part>.safetensors of its own (a family with several denoisers writes one file per denoiser, each
    #: loadable alone: Wan 2.2's `high_noise` and `low_noise` experts)
    file_part: str = ""

    def in_checkpoint(self) -> LoraComponent:
        """The component as a checkpoint (which holds every component in one file) names it: components with a file
        part of their own share their files' prefix, so there it goes under the part (`high_noise.transformer`)."""
        return replace(self, prefix=f"{self.file_part}.{self.prefix}", file_part="") if self.file_part else self


def text_encoder_component(module: torch.nn.Module, prefix: str, comfy_prefix: str) -> LoraComponent:
    """A CLIP text encoder a LoRA trains: kohya and diffusers both name its modules under `text_model.`."""
    renames = clip_text_model_renames(module)
    return LoraComponent(module, prefix, comfy_prefix, renames, "_", text_encoder=True, diffusers_renames=renames)


def denoiser_component(module: torch.nn.Module, files: LoraFileFormat) -> LoraComponent:
    """The trained module as its family's files name it (kohya renames computed from its module names)."""
    renames = files.comfy_renames
    names = [name for name, _ in module.named_modules() if name] if renames is not None else []
    return LoraComponent(module, files.prefix, files.comfy_prefix, renames(names) if renames is not None else {},
                         files.comfy_separator, files.comfy_peft_names)


def clip_text_model_renames(module: torch.nn.Module) -> dict[str, str]:
    """kohya names CLIP text-encoder modules under `text_model.`; transformers 5's CLIPTextModel no longer has
    that level in its module tree (CLIPTextModelWithProjection still does)."""
    names = {name for name, _ in module.named_children()}
    if "text_model" in names:
        return {}
    return {name: f"text_model.{name}" for name in ("embeddings", "encoder", "final_layer_norm") if name in names}


@dataclass(frozen=True)
class Expert:
    """One of several denoisers a family routes between by noise level (Wan 2.2 A14B: the high-noise and low-noise
    transformers), as training sees it: an update trains one expert, on noise levels of its range only."""

    name: str
    #: [low, high) of u (the noise level, timestep / num_train_timesteps) this expert denoises
    u_range: tuple[float, float]


class TextRules:
    """How a family's prompts become conditioning beyond `encode_prompts`; the defaults fit a CLIP-style
    encoder with a start and an end token and no length warning."""

    #: prompts keep their own length (a batch is padded to its longest prompt, with a mask): cached entries store a
    #: prompt's own tokens and batches are padded when they are put together
    variable_length: ClassVar[bool] = False

    def __init__(self, adapter: ModelAdapter):
        self.adapter = adapter

    def blank_prompt_embeds(self) -> PromptEmbeds:
        """The empty prompt's conditioning (blank-prompt preservation, caption dropout)."""
        return self.adapter.encode_prompts([""])

    def caption_token_span(self, length: int) -> tuple[int, int]:
        """[first, stop) positions of the caption's own tokens in a prompt of `length` tokens (cached caption views
        move only these): between the start and the end token by default."""
        return 1, length - 1

    @property
    def tokenizer(self) -> Any:
        """The tokenizer whose tokens the rows of `encode_prompts`' per-token embeddings are (cached caption views
        find each caption segment's rows with it)."""
        return self.adapter.tokenizer

    def encoder_text(self, caption: str) -> str:
        """The caption as that tokenizer reads it, without any template around it (`caption_token_span` places
        its tokens); families that clean prompts first clean it here the same way."""
        return caption

    def overlong_prompts(self, prompts: list[str]) -> list[int]:
        """Indices of prompts the text encoder will cut; families without a limit return none."""
        return []


class SamplingParts(ABC):
    """How a family renders sample images: its pipeline, and what rendering needs besides the trained model."""

    #: `sample.guidance_scale` and `sample.sample_steps` when the config leaves them unset (a family may make
    #: them properties of its loaded model)
    default_guidance_scale: ClassVar[float] = 7.0
    default_steps: ClassVar[int] = 20
    #: video families: `sample.num_frames` and `sample.fps` when unset
    default_frames: ClassVar[int] = 1
    default_fps: ClassVar[float] = 16.0

    def __init__(self, adapter: ModelAdapter):
        self.adapter = adapter

    @abstractmethod
    def pipeline(self) -> Any:
        """A diffusers pipeline over the current components (LoRA active)."""

    def conditioning(self, prompt: str, negative: str) -> dict[str, Any] | None:
        """Pipeline arguments that stand for the prompt (precomputed embeddings), so that the text encoder can
        leave the accelerator before the sampling model arrives; None where the pipeline encodes prompts."""
        return None

    def only_modules(self) -> list[torch.nn.Module]:
        """Modules used only to render samples: they stay on the CPU and visit the accelerator while sampling."""
        return []

    def mirrors(self) -> list[torch.nn.Module]:
        """Other models that carry the trained LoRA (sharing its layers), e.g. a separate sampling model."""
        return []

    def pipeline_arguments(self, text: dict[str, Any], guidance: float) -> dict[str, Any]:
        """The pipeline's prompt and guidance arguments: `text` (the prompts, or `conditioning`'s embeddings) and the
        guidance scale under the name the family's pipeline takes (a family with true CFG maps it otherwise)."""
        return {**text, "guidance_scale": guidance}

    def size_arguments(self, width: int, height: int) -> dict[str, Any]:
        """The pipeline arguments that make a sample `width` x `height`."""
        return {"width": width, "height": height}

    def reference_arguments(self, images: list[Any], width: int, height: int) -> dict[str, Any]:
        """The pipeline arguments that give a sample its reference images (PIL images, in slot order) for a sample of
        `width` x `height`: image-editing families only (facts `references`)."""
        raise NotImplementedError(f"{self.adapter.arch} samples take no reference images")

    def negative_prompt(self, negative: str) -> str:
        """The negative prompt samples render with for `sample.neg` (what the PNG records)."""
        return negative

    def reproduction(self) -> dict:
        """Pipeline arguments a sample's PNG records besides the common ones, where rendering it again needs them."""
        return {}


class ModelAdapter(ABC):
    """One model family. Built by `load`; the trainer calls only the members below and the parts' methods."""

    arch: ClassVar[str]
    #: what the family can do, known before any weight loads (its config class's facts)
    facts: ClassVar[FamilyFacts]
    #: how its LoRA files name the trained module
    files: ClassVar[LoraFileFormat]
    #: the classes of its optional parts
    text_rules: ClassVar[type[TextRules]] = TextRules
    sampling_parts: ClassVar[type[SamplingParts]]
    #: the denoiser's repeated blocks, each its own unit under `train.sharding: fsdp` (toolkit/run/sharding.py
    #: `block_modules`): dotted paths, `*` for each child of a ModuleList; a path ending at a ModuleList stands for
    #: each of its children, at another module for that module (paths that reach nothing are skipped)
    sharded_blocks: ClassVar[tuple[str, ...]] = ()

    noise_schedule: NoiseSchedule
    #: image sides must be multiples of this (latent downscale x denoiser downscale)
    divisor: int

    @classmethod
    @abstractmethod
    def load(cls, model_cfg: ModelConfigBase, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False, sampling_models: bool = True,
             empty_denoiser: bool = False) -> ModelAdapter:
        """Load (or build, for tiny presets) and place every component; `debug_memory` logs memory per stage.
        `sampling_models`: also load models used only for sample images (only the processes that render do).
        `empty_denoiser`: the denoiser (each trained one) is built on the meta device from its config, its weight
        files kept on it (`toolkit.models.common.pretrained_denoiser`); `train.sharding: fsdp` fills it shard by shard."""

    @classmethod
    def for_module_names(cls, name_or_path: str | None) -> ModelAdapter | None:
        """The adapter with every part built on the meta device from its config alone (no weight read, no
        tokenizer), for resolving a LoRA file's names (`run.py --convert-lora`): from a diffusers folder or hub id,
        a single file's variant (its header only), or, for None, the family's first published variant. None where the
        family cannot build it so; its module names then come from loading the model."""
        return None

    # ---- text and images -------------------------------------------------------------------------

    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds: ...

    @cached_property
    def token_memos(self) -> TokenMemos:
        return TokenMemos()

    def tokenize(self, tokenizer: Any, prompts: list[str], max_length: int, pad_to_max: bool = True,
                 **options) -> Tokens:
        """`tokenizer(prompts, max_length=max_length, truncation=True, padding="max_length" (or True, to the longest,
        without `pad_to_max`), return_tensors="pt", **options)`, each prompt tokenized once per run: a live-encoding
        run reads the same captions every epoch (`toolkit.models.tokens`)."""
        return self.token_memos.tokenize(tokenizer, prompts, max_length, pad_to_max, **options)

    @abstractmethod
    def encode_latent_dist(self, pixels: torch.Tensor) -> LatentDist:
        """Pixels in [-1, 1], NCHW -> the encoder's output before sampling."""

    @abstractmethod
    def latents_from_dist(self, dist: LatentDist, generator: torch.Generator | None = None) -> torch.Tensor:
        """A sample of the latents the denoiser trains on (scaled as the family needs), float32."""

    def encode_images(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.latents_from_dist(self.encode_latent_dist(pixels), generator)

    @property
    def reference_rules(self) -> ReferenceFacts | None:
        """How this model takes reference images (image-editing families): its facts' rule, or the loaded model's
        narrower one (Qwen-Image-Edit's first version takes one reference)."""
        return self.facts.references

    def reference_latents(self, mean: torch.Tensor) -> torch.Tensor:
        """A reference image's latents from the encoder's mean (`encode_latent_dist(pixels).mean`, or a cached one),
        scaled as the denoiser takes them: the editing pipelines encode references at the mode, drawing nothing, and
        scale them in the encoder's dtype (so does this, where the family's `latents_from_dist` keeps a mean without
        a std in its dtype)."""
        return self.latents_from_dist(LatentDist(mean, None))

    @abstractmethod
    def image_encoder_modules(self) -> list[torch.nn.Module]:
        """Modules that turn images into latents; they may leave the accelerator once latents are cached."""

    @abstractmethod
    def text_encoder_modules(self) -> list[torch.nn.Module]:
        """Modules that turn prompts into embeddings; they may leave the accelerator once embeddings are cached."""

    @abstractmethod
    def encoder_identity(self, part: str) -> str:
        """A string that changes whenever `part` ("image" or "text") would encode differently: cache keys."""

    # ---- the denoiser ------------------------------------------------------------------------------

    @abstractmethod
    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: torch.nn.Module | None = None, image_sizes: torch.Tensor | None = None,
                expert: Expert | None = None,
                references: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The denoiser's output; through `module` when given (e.g. the bare module, adapters disabled),
        else through the module set by `use_for_training`. `expert`: where the family routes between experts, the
        one the timesteps belong to (training passes the update's, see `expert_at`; without it the family routes by
        the timesteps); the other families ignore it. `image_sizes` ([B, 6] integers: original height and
        width, crop top and left, target height and width, as `toolkit.data.dataset.image_sizes` gives them) is
        for families conditioned on them (SDXL); the others ignore it. `references`: image-editing families (facts
        `references`), each reference image's latents ([B, C, h, w], as `reference_latents` makes them), in slot order,
        given to the denoiser beside the noisy target; the output is the target's alone (no loss on references)."""

    @abstractmethod
    def trainable_module(self) -> torch.nn.Module:
        """The module the adapter (LoRA) is added to."""

    @abstractmethod
    def lora_target_modules(self) -> list[str]:
        """Default linear targets (module names or name endings) of the adapter."""

    def conv_target_modules(self) -> list[str]:
        """Conv layers adapted when `network.conv` is set (LoCon style); only where `facts.conv_layers`."""
        return []

    @abstractmethod
    def use_for_training(self, module: torch.nn.Module) -> None:
        """Route `predict` through `module` (the trainable module as wrapped by accelerate)."""

    # ---- text-encoder LoRA (families whose facts say `text_encoder_lora`) ------------------------------

    #: set by the trainer while text-encoder LoRAs train: `encode_prompts` then keeps the graph (outside no_grad)
    text_encoders_train: bool = False
    #: guidance-distilled families (facts `guidance_embedding`): the guidance embedding's value in training
    #: (`train.guidance_scale`)
    train_guidance_scale: float = 1.0

    def modules_without_gradients(self) -> list[str]:
        """Name fragments of modules that take no part in the training forward with the current options (no LoRA
        goes there: it would get no gradient, and multi-process training would wait for one)."""
        return []

    def use_training_guidance(self, scale: float | None, bypass: bool | None) -> None:
        """`train.guidance_scale` and `train.bypass_guidance_embedding` (None: the family's default); the config
        refuses both for families without a guidance embedding, so only those families override this."""
        if scale is not None:
            self.train_guidance_scale = scale

    def text_grad(self) -> torch.autograd.grad_mode.set_grad_enabled:
        """The grad mode for encoding prompts: on only while text-encoder LoRAs train and the caller has grad on
        (caches, samples and blank prompts encode without a graph)."""
        return torch.set_grad_enabled(self.text_encoders_train and torch.is_grad_enabled())

    def text_encoder_components(self) -> list[LoraComponent]:
        """The text encoders a LoRA may train (`network.train_text_encoder`), as files name them."""
        return []

    def text_lora_target_modules(self) -> list[str]:
        """Linear targets in the text encoders (kohya's: every linear layer of attention and MLP)."""
        return []

    def lora_components(self, text_encoders: bool = False) -> list[LoraComponent]:
        """What the LoRA trains: the trainable module as `files` names it, then the text encoders when asked."""
        denoiser = denoiser_component(self.trainable_module(), self.files)
        return [denoiser, *(self.text_encoder_components() if text_encoders else [])]

    def denoisers(self) -> list[torch.nn.Module]:
        """The modules the LoRA is added to: the trainable module, or where it routes between several denoisers
        (experts), each trained one."""
        return [self.trainable_module()]

    def expert_at(self, update_index: int) -> Expert | None:
        """The expert update `update_index` trains (its timesteps are drawn in the expert's range), where the family
        has several; None otherwise. A pure function of the update index, so every process and a resumed run agree."""
        return None

    def trains_noise_level(self, u: float) -> bool:
        """Whether the LoRA trains noise level `u` (a family whose trained experts cover part of the range says
        no for the rest, whose expert may not even be loaded); the validation loss covers these levels only, each
        predicted without naming an expert (a family of several routes a batch by its timesteps)."""
        return True

    def use_zero_terminal_snr(self) -> None:
        """Rescale the noise schedule to zero terminal SNR (`train.zero_terminal_snr`), in training and in samples;
        only families whose facts say `ddpm_noise` implement it (the config refuses the key for the others)."""
        raise NotImplementedError(f"{self.arch} has no DDPM noise schedule to rescale")

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    # ---- the optional parts ------------------------------------------------------------------------

    @cached_property
    def text(self) -> TextRules:
        return self.text_rules(self)

    @cached_property
    def sampling(self) -> SamplingParts:
        return self.sampling_parts(self)

    def describe(self) -> dict[str, str]:
        """Facts recorded in output metadata."""
        return {"arch": self.arch}
