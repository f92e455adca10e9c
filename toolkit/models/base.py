"""The ModelAdapter contract: the only view of a model family the trainer has."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config.schema import ModelConfig
from ..device import to_device


@dataclass
class PromptEmbeds:
    """Text conditioning of a batch: per-token embeddings, a mask where the family uses one, and each
    prompt's token count (start and end tokens included) for token shuffling of cached embeddings.

    The mask and the lengths stay on the host (`to` moves the embeddings only): they decide shapes, which
    is the host's business, and reading them from the device would stop it once per micro-batch."""

    embeds: torch.Tensor
    attention_mask: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> PromptEmbeds:
        return PromptEmbeds(to_device(self.embeds, device, dtype), self.attention_mask, self.lengths)


@dataclass
class LatentDist:
    """What the image encoder says about one image before sampling: a mean, and a std when the encoder
    is a VAE (None for deterministic encoders). Cached latents store this, so every epoch can still draw
    its own sample."""

    mean: torch.Tensor
    std: torch.Tensor | None = None


class NoiseSchedule(ABC):
    """How the family turns clean latents into a training example.

    Timestep samplers draw `u` in (0, 1) per sample; the schedule maps it to the family's own timestep.
    """

    @abstractmethod
    def timesteps(self, u: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...

    #: "epsilon", "v_prediction" or "flow_matching": picks the min-SNR weight formula
    prediction_type: str

    @abstractmethod
    def snr(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Signal-to-noise ratio of each sample's timestep (on the CPU)."""


class ModelAdapter(ABC):
    """One model family. Built by `load`; the trainer calls only the methods below."""

    arch: ClassVar[str]
    noise_schedule: NoiseSchedule
    #: image sides must be multiples of this (latent downscale x denoiser downscale)
    divisor: int
    #: key prefix of the trained module in saved LoRA files (diffusers' convention)
    lora_prefix: ClassVar[str]
    #: the same module's prefix in ComfyUI/kohya LoRA files, and the kohya base-model tag
    comfy_prefix: ClassVar[str]
    #: how the ComfyUI prefix and the module path join: "_" (kohya: lora_unet_down_blocks_0_...) or "."
    comfy_separator: ClassVar[str] = "_"
    kohya_base_model: ClassVar[str]

    #: `save.formats` when the config leaves it unset: both where the family has a ComfyUI form
    default_save_formats: ClassVar[tuple[str, ...]] = ("diffusers", "comfy")
    #: `sample.guidance_scale` when the config leaves it unset
    default_guidance_scale: ClassVar[float] = 7.0

    @classmethod
    @abstractmethod
    def load(cls, model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
             debug_memory: bool = False) -> ModelAdapter:
        """Load (or build, for tiny presets) and place every component; `debug_memory` logs memory per stage."""

    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds: ...

    @abstractmethod
    def encode_latent_dist(self, pixels: torch.Tensor) -> LatentDist:
        """Pixels in [-1, 1], NCHW -> the encoder's output before sampling."""

    @abstractmethod
    def latents_from_dist(self, dist: LatentDist, generator: torch.Generator | None = None) -> torch.Tensor:
        """A sample of the latents the denoiser trains on (scaled as the family needs), float32."""

    def encode_images(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.latents_from_dist(self.encode_latent_dist(pixels), generator)

    @abstractmethod
    def image_encoder_modules(self) -> list[torch.nn.Module]:
        """Modules that turn images into latents; they may leave the accelerator once latents are cached."""

    @abstractmethod
    def text_encoder_modules(self) -> list[torch.nn.Module]:
        """Modules that turn prompts into embeddings; they may leave the accelerator once embeddings are cached."""

    @abstractmethod
    def encoder_identity(self, part: str) -> str:
        """A string that changes whenever `part` ("image" or "text") would encode differently: cache keys."""

    @abstractmethod
    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds,
                module: torch.nn.Module | None = None) -> torch.Tensor:
        """The denoiser's output; through `module` when given (e.g. the bare module, adapters disabled),
        else through the module set by `use_for_training`."""

    @abstractmethod
    def trainable_module(self) -> torch.nn.Module:
        """The module the adapter (LoRA) is added to."""

    @abstractmethod
    def lora_target_modules(self) -> list[str]:
        """Default linear targets (module names or name endings) of the adapter."""

    def conv_target_modules(self) -> list[str]:
        """Conv layers adapted when `network.conv` is set (LoCon style); none by default."""
        return []

    @abstractmethod
    def use_for_training(self, module: torch.nn.Module) -> None:
        """Route `predict` through `module` (the trainable module as wrapped by accelerate)."""

    @abstractmethod
    def sampling_pipeline(self) -> Any:
        """A diffusers pipeline over the current components (LoRA active) for sample images."""

    def sampling_conditioning(self, prompt: str, negative: str) -> dict[str, Any] | None:
        """Pipeline arguments that stand for the prompt (precomputed embeddings), so that the text encoder can
        leave the accelerator before the sampling model arrives; None where the pipeline encodes prompts."""
        return None

    def sampling_unavailable(self) -> str | None:
        """Why sample images cannot be rendered with this config (e.g. a missing decoder), or None."""
        return None

    def lora_mirrors(self) -> list[torch.nn.Module]:
        """Other models that carry the trained LoRA (sharing its layers), e.g. a separate sampling model."""
        return []

    def sampling_only_modules(self) -> list[torch.nn.Module]:
        """Modules used only to render samples: they stay on the CPU and visit the accelerator while sampling."""
        return []

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    def shift_schedule(self):
        """The scheduler's dynamic-shift line (toolkit.train.timesteps.ShiftSchedule), for families whose
        scheduler defines one; None otherwise."""
        return

    def image_seq_len(self, latents: torch.Tensor) -> int:
        """Tokens the denoiser sees per image (for dynamic shift): latent pixels by default."""
        return latents.shape[-1] * latents.shape[-2]

    def blank_prompt_embeds(self) -> PromptEmbeds:
        """The empty prompt's conditioning (blank-prompt preservation, caption dropout)."""
        return self.encode_prompts([""])

    def caption_token_span(self, length: int) -> tuple[int, int]:
        """[first, stop) positions of the caption's own tokens in a prompt of `length` tokens (cached-embedding
        token shuffling moves only these): between the start and the end token by default."""
        return 1, length - 1

    def overlong_prompts(self, prompts: list[str]) -> list[int]:
        """Indices of prompts the text encoder will cut; families without a limit return none."""
        return []

    def describe(self) -> dict[str, str]:
        """Facts recorded in output metadata."""
        return {"arch": self.arch}
