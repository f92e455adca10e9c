"""What the Stable Diffusion UNet families (sd15, sdxl) share: a UNet denoising VAE latents under a DDPM schedule
(epsilon or v-prediction, zero terminal SNR on request), CLIP text encoders whose LoRA targets are kohya's, LoCon
conv targets, and single-file loading through the family's pipeline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
from diffusers import DDPMScheduler

from toolkit.diffusion.schedules import DDPMNoiseSchedule
from toolkit.models.base import LatentDist, ModelAdapter
from toolkit.models.common import (
    CLIP_TEXT_TARGETS,
    ddpm_scheduler,
    first_weight,
    vae_latent_dist,
    vae_latents,
)
from toolkit.paths import normalize_path


def ldm_unet_converter(part, config: dict):
    """diffusers' converter of the original (LDM) UNet names, for a file in that layout (its `model.diffusion_model.`
    prefix, which the part's names no longer carry, given back); none for diffusers' names."""
    if not part.has("input_blocks.0.0.weight"):
        return None
    from diffusers.loaders.single_file_utils import LDM_UNET_KEY, convert_ldm_unet_checkpoint

    return lambda checkpoint: convert_ldm_unet_checkpoint({LDM_UNET_KEY + k: v for k, v in checkpoint.items()},
                                                          config)


class StableDiffusionAdapter(ModelAdapter):
    """The members sd15 and sdxl share; each family adds its text encoding, prediction and loading (`assemble`: the
    adapter over its parts, unplaced; `meta` builds them from configs alone)."""

    #: the family's `model` config class, and its tiny preset's builder
    config_class: ClassVar[type]
    tiny_preset: ClassVar[Callable[[], Path]]

    @classmethod
    def resolve_source(cls, name_or_path: str, key: str = "model.name_or_path") -> str:
        """A folder, hub id or file; `tiny` becomes the tiny preset's folder."""
        name_or_path = normalize_path(name_or_path, key)
        return str(cls.tiny_preset()) if name_or_path == "tiny" else name_or_path

    @classmethod
    def for_module_names(cls, name_or_path: str | None) -> StableDiffusionAdapter:
        source = cls.resolve_source(name_or_path) if name_or_path else None
        model_cfg = cls.config_class(arch=cls.arch, name_or_path=source or "the published layout")
        return cls.assemble(model_cfg, source, torch.float32, meta=True)

    def init_denoiser(self, unet, vae, scheduler, source: str) -> None:
        self.unet = unet
        self.vae = vae
        self.scheduler = scheduler
        self.source = source
        self.noise_schedule = DDPMNoiseSchedule(scheduler)
        self.vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        self.divisor = self.vae_scale * 2 ** (len(unet.config.block_out_channels) - 1)
        self._denoiser: torch.nn.Module = unet
        #: the UNet's dtype, read once (diffusers' `.dtype` walks every submodule on each call)
        self.compute_dtype = unet.dtype

    @staticmethod
    def single_file_pipeline(pipeline_class, source: str, config: str | None, dtype: torch.dtype):
        """A single-file checkpoint through the family's pipeline (`config`: a local folder loads it offline), and
        the DDPM scheduler training uses, from the pipeline's scheduler config."""
        if not Path(source).is_file():
            raise FileNotFoundError(f"model file not found: {source}")
        local_config = config is not None and Path(config).is_dir()
        pipe = pipeline_class.from_single_file(source, config=config, local_files_only=local_config, torch_dtype=dtype)
        return pipe, DDPMScheduler.from_config(pipe.scheduler.config)

    def use_zero_terminal_snr(self) -> None:
        self.scheduler = ddpm_scheduler(self.scheduler, zero_terminal_snr=True)
        self.noise_schedule = DDPMNoiseSchedule(self.scheduler)

    @property
    def device(self) -> torch.device:
        # the first parameter: diffusers' `.device` walks every submodule (milliseconds per call, per step)
        return first_weight(self.unet).device

    def encode_latent_dist(self, pixels: torch.Tensor) -> LatentDist:
        return vae_latent_dist(self.vae, pixels)

    def latents_from_dist(self, dist: LatentDist, generator: torch.Generator | None = None) -> torch.Tensor:
        return vae_latents(dist, generator, self.vae.config.scaling_factor)

    def image_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.vae]

    def trainable_module(self) -> torch.nn.Module:
        return self.unet

    def conv_target_modules(self) -> list[str]:
        # the resnets' 3x3 convs, their 1x1 shortcuts and the resampling convs: kohya's LoCon set
        return ["conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv"]

    def text_lora_target_modules(self) -> list[str]:
        return list(CLIP_TEXT_TARGETS)

    def use_for_training(self, module: torch.nn.Module) -> None:
        self._denoiser = module

    def describe(self) -> dict[str, str]:
        return {"arch": self.arch, "base_model": self.source, "prediction_type": self.noise_schedule.prediction_type}
