"""How each family turns clean latents into a training example, as small classes over diffusers'
schedulers. Timestep samplers draw u in (0, 1) with u near 1 meaning high noise; each schedule maps u to
its family's own timestep."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod

import torch
from diffusers import DDPMScheduler, DDPMWuerstchenScheduler

from toolkit.device import to_device
from toolkit.diffusion.snr import snr_from_alphas_cumprod, snr_from_flow_sigmas
from toolkit.diffusion.timesteps import ShiftSchedule


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

    #: the scheduler's dynamic-shift line (resolution-dependent shift), where the family's scheduler uses one
    shift_schedule: ShiftSchedule | None = None

    def image_seq_len(self, latents: torch.Tensor) -> int:
        """Tokens the denoiser sees per image (for dynamic shift): latent pixels by default."""
        return latents.shape[-1] * latents.shape[-2]


class DDPMNoiseSchedule(NoiseSchedule):
    """Integer DDPM timesteps; epsilon or v-prediction target as the scheduler config says (SD 1.x)."""

    def __init__(self, scheduler: DDPMScheduler):
        self.scheduler = scheduler
        self.num_train_timesteps = scheduler.config.num_train_timesteps
        self.prediction_type = scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"unsupported prediction_type '{self.prediction_type}' in the scheduler config")
        self._coefficients: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        #: the same tables shaped [T, 1, ...] to broadcast over latents of a number of dims (`coefficients_at`)
        self._shaped: dict[tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._alphas: dict[torch.device, torch.Tensor] = {}

    def timesteps(self, u: torch.Tensor) -> torch.Tensor:
        t = (u * self.num_train_timesteps).long()
        return t.clamp(0, self.num_train_timesteps - 1)

    def coefficients(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """sqrt(alpha_bar) and sqrt(1 - alpha_bar) of every timestep, on `device` in `dtype`, made once: diffusers'
        `add_noise` and `get_velocity` make the table's dtype copy and both roots again at every call (a dozen
        operations per micro-batch) and move the scheduler's own table to the device."""
        key = (device, dtype)
        if key not in self._coefficients:
            alphas = to_device(self.scheduler.alphas_cumprod, device).to(dtype)
            self._coefficients[key] = (alphas**0.5, (1 - alphas) ** 0.5)
        return self._coefficients[key]

    def coefficients_at(self, like: torch.Tensor, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both roots at each sample's timestep, shaped to broadcast over `like` (diffusers' values, bit for bit)."""
        key = (like.device, like.dtype, like.dim())
        if key not in self._shaped:
            shape = (-1,) + (1,) * (like.dim() - 1)
            self._shaped[key] = tuple(table.reshape(shape) for table in self.coefficients(like.device, like.dtype))
        signal, sigma = self._shaped[key]
        index = to_device(timesteps, like.device)
        return signal.index_select(0, index), sigma.index_select(0, index)

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        signal, sigma = self.coefficients_at(latents, timesteps)
        return signal * latents + sigma * noise

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        if self.prediction_type == "epsilon":
            return noise
        signal, sigma = self.coefficients_at(latents, timesteps)
        return signal * noise - sigma * latents

    def snr(self, timesteps: torch.Tensor) -> torch.Tensor:
        device = timesteps.device  # the table on the timesteps' device once, not copied there at every call
        if device not in self._alphas:
            self._alphas[device] = to_device(self.scheduler.alphas_cumprod, device)
        return snr_from_alphas_cumprod(self._alphas[device], timesteps)


class FlowMatchNoiseSchedule(NoiseSchedule):
    """Rectified flow: sigma = u, noisy = (1 - sigma) x + sigma noise, target noise - x, t = 1000 sigma."""

    prediction_type = "flow_matching"

    def __init__(self, num_train_timesteps: int = 1000, shift_schedule: ShiftSchedule | None = None,
                 patch_size: int = 1):
        self.num_train_timesteps = num_train_timesteps
        self.shift_schedule = shift_schedule
        #: the denoiser's spatial patch: image tokens are latent pixels / patch area
        self.patch_size = patch_size

    def image_seq_len(self, latents: torch.Tensor) -> int:
        return (latents.shape[-2] // self.patch_size) * (latents.shape[-1] // self.patch_size)

    def timesteps(self, u: torch.Tensor) -> torch.Tensor:
        return u.float() * self.num_train_timesteps

    def sigmas(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps.float() / self.num_train_timesteps

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        sigma = self.sigmas(timesteps).to(latents.device).view(-1, *[1] * (latents.dim() - 1))
        return (1 - sigma) * latents + sigma * noise

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        return noise - latents

    def snr(self, timesteps: torch.Tensor) -> torch.Tensor:
        return snr_from_flow_sigmas(self.sigmas(timesteps))


class WuerstchenNoiseSchedule(NoiseSchedule):
    """Wuerstchen's continuous t in [0, 1) with its cosine alpha-bar; epsilon target."""

    prediction_type = "epsilon"

    def __init__(self, scheduler: DDPMWuerstchenScheduler | None = None, t_max: float = 0.999):
        self.scheduler = DDPMWuerstchenScheduler() if scheduler is None else scheduler  # it has a broken __len__
        self.t_max = t_max
        self._per_device: dict[torch.device, DDPMWuerstchenScheduler] = {}

    def timesteps(self, u: torch.Tensor) -> torch.Tensor:
        return u.float() * self.t_max

    def scheduler_on(self, device: torch.device) -> DDPMWuerstchenScheduler:
        """The scheduler with its two constants already on `device`: it keeps them on the host and copies
        them on every call, which would make the host wait for the device once per micro-batch."""
        if device not in self._per_device:
            clone = copy.copy(self.scheduler)
            clone.s = to_device(self.scheduler.s, device)
            clone._init_alpha_cumprod = to_device(self.scheduler._init_alpha_cumprod, device)
            self._per_device[device] = clone
        return self._per_device[device]

    def alphas_cumprod(self, timesteps: torch.Tensor) -> torch.Tensor:
        return self.scheduler_on(timesteps.device)._alpha_cumprod(timesteps.float(), timesteps.device)

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        return self.scheduler_on(latents.device).add_noise(latents, noise, timesteps)

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        return noise

    def snr(self, timesteps: torch.Tensor) -> torch.Tensor:
        alpha_bar = self.alphas_cumprod(timesteps)
        return alpha_bar / (1 - alpha_bar)
