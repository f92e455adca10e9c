"""SDTrainer (`type: sd_trainer`): the loss of one micro-batch."""

from __future__ import annotations

import torch

from toolkit.models.base import LatentDist
from toolkit.train.losses import mse_loss
from toolkit.train.seeding import seeded_generator
from toolkit.train.timesteps import sample_uniform

from .base_sd_train_process import BaseSDTrainProcess


class SDTrainer(BaseSDTrainProcess):
    def train_step(self, batch: dict, epoch: int, micro_batch: int) -> torch.Tensor:
        """Noise the batch's latents at sampled timesteps and regress the family's target.

        Every draw comes from a generator keyed by (seed, purpose, epoch, micro-batch, rank), so the same
        micro-batch always gets the same noise and timesteps.
        """
        adapter = self.adapter
        seed = self.config.train.seed
        where = (epoch, micro_batch, self.accelerator.process_index)
        latents = self.batch_latents(batch, seeded_generator(seed, "latent_sample", *where))
        embeds = self.conditioning.embeds_for(batch["indices"].tolist(), epoch)
        noise = torch.randn(latents.shape, generator=seeded_generator(seed, "noise", *where)).to(latents.device)
        u = sample_uniform(latents.shape[0], seeded_generator(seed, "timestep", *where))
        timesteps = adapter.noise_schedule.timesteps(u).to(latents.device)
        noisy = adapter.noise_schedule.add_noise(latents, noise, timesteps)
        prediction = adapter.predict(noisy, timesteps, embeds)
        return mse_loss(prediction, adapter.noise_schedule.target(latents, noise, timesteps))

    def batch_latents(self, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """Latents drawn from the cached encoder output, or from encoding the batch's pixels now."""
        if "latent_mean" in batch:
            dist = LatentDist(batch["latent_mean"], batch.get("latent_std"))
            return self.adapter.latents_from_dist(dist, generator)
        return self.adapter.encode_images(batch["pixels"], generator)
