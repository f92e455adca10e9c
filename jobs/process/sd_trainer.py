"""SDTrainer (`type: sd_trainer`): the loss of one micro-batch."""

from __future__ import annotations

from functools import cached_property

import torch

from toolkit.device import to_device
from toolkit.models.base import LatentDist, PromptEmbeds
from toolkit.train.losses import min_snr_weights, mse_loss, noise_offset, per_sample_loss, weighted_mean
from toolkit.train.seeding import seeded_generator
from toolkit.train.timesteps import TimestepParams, sample_timestep_u

from .base_sd_train_process import BaseSDTrainProcess


class SDTrainer(BaseSDTrainProcess):
    def train_step(self, batch: dict, epoch: int, micro_batch: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Noise the batch's latents at sampled timesteps and regress the family's target.

        Every draw comes from a generator keyed by (seed, purpose, epoch, micro-batch, rank), so the same
        micro-batch always gets the same noise and timesteps. Returns the loss to optimise and its parts
        (logged as their own metrics).
        """
        train, schedule = self.config.train, self.adapter.noise_schedule
        where = (epoch, micro_batch, self.accelerator.process_index)

        def draws(purpose: str) -> torch.Generator:
            return seeded_generator(train.seed, purpose, *where)

        latents = self.batch_latents(batch, draws("latent_sample"))
        embeds = self.conditioning.embeds_for(batch["indices"], epoch)
        # drawn on the host (the same numbers on every device type), sent without waiting for the device
        noise = to_device(noise_offset(torch.randn(latents.shape, generator=draws("noise")), train.noise_offset,
                                       draws("noise_offset")), latents.device)
        u, sampler_weight = self.draw_timesteps(latents, draws("timestep"))
        timesteps = to_device(schedule.timesteps(u), latents.device)
        noisy = schedule.add_noise(latents, noise, timesteps)
        with_blank = self.blank_prompt_due()
        prediction, blank_prediction = self.predict(noisy, timesteps, embeds, with_blank)
        target = schedule.target(latents, noise, timesteps)
        if train.differential_guidance_scale is not None:
            anchor = prediction.detach()
            target = anchor + train.differential_guidance_scale * (target - anchor)
        per_sample = per_sample_loss(prediction, target, train.loss_type, train.huber_c)
        snr_weight = None
        if train.min_snr_gamma is not None:
            snr_weight = min_snr_weights(schedule.snr(timesteps), train.min_snr_gamma, schedule.prediction_type)
        loss = weighted_mean(per_sample, sampler_weight, snr_weight)
        parts = {"loss_diff_guidance" if train.differential_guidance_scale else "loss_main": loss.detach()}
        if with_blank:
            bpp = self.blank_prompt_loss(noisy, timesteps, blank_prediction)
            loss = loss + train.blank_prompt_preservation_multiplier * bpp
            parts["loss_bpp"] = bpp.detach()
        if self.timestep_stats is not None:
            self.timestep_stats.add(u, per_sample)
        return loss, parts

    @cached_property
    def timestep_params(self) -> TimestepParams:
        return TimestepParams(**self.config.train.timestep_params.model_dump())

    def draw_timesteps(self, latents: torch.Tensor, generator: torch.Generator):
        """u per sample (and the sampler's loss weight, if any) for this update's place in training."""
        train = self.config.train
        return sample_timestep_u(
            train.timestep_type, self.timestep_params, latents.shape[0], generator,
            content_or_style=train.content_or_style, timestep_range=train.timestep_range,
            progress=min(1.0, self.position.global_step / self.plan.total_updates),
            update_index=self.position.global_step,
            image_seq_len=self.adapter.image_seq_len(latents), shift_schedule=self.adapter.shift_schedule(),
        )

    def blank_prompt_due(self) -> bool:
        """Whether this update computes the blank-prompt term: a pure function of (seed, update)."""
        train = self.config.train
        if not train.blank_prompt_preservation:
            return False
        draw = torch.rand((), generator=seeded_generator(train.seed, "blank_prompt", self.position.global_step))
        return draw.item() < train.blank_prompt_probability

    def predict(self, noisy, timesteps, embeds, with_blank: bool):
        """The LoRA model's prediction; with the blank prompt too, in the same forward pass (one pass keeps
        multi-process gradient sync simple and is faster than two)."""
        if not with_blank:
            return self.adapter.predict(noisy, timesteps, embeds), None
        both = self.adapter.predict(torch.cat([noisy, noisy]), torch.cat([timesteps, timesteps]),
                                    concat_embeds(embeds, self.blank_embeds, len(noisy)))
        return both[: len(noisy)], both[len(noisy):]

    def blank_prompt_loss(self, noisy, timesteps, blank_prediction) -> torch.Tensor:
        """MSE between the LoRA model's and the base model's predictions for the blank prompt."""
        module = self.adapter.trainable_module()
        blank = concat_embeds(self.blank_embeds, None, len(noisy))
        with torch.no_grad():
            module.disable_adapters()
            try:
                base = self.adapter.predict(noisy, timesteps, blank, module=module)
            finally:
                module.enable_adapters()
        return mse_loss(blank_prediction, base)

    def batch_latents(self, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """Latents drawn from the cached encoder output, or from encoding the batch's pixels now."""
        if "latent_mean" in batch:
            dist = LatentDist(batch["latent_mean"], batch.get("latent_std"))
            return self.adapter.latents_from_dist(dist, generator)
        return self.adapter.encode_images(batch["pixels"], generator)


def concat_embeds(embeds: PromptEmbeds, blank: PromptEmbeds | None, batch: int) -> PromptEmbeds:
    """`embeds` (one row is repeated to `batch` rows) followed by `blank` repeated to `batch` rows."""
    parts = [embeds] if blank is None else [embeds, blank]

    def rows(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return tensor.expand(batch, *tensor.shape[1:]) if tensor is not None and tensor.shape[0] == 1 else tensor

    device = embeds.embeds.device
    masks = [rows(p.attention_mask) for p in parts]  # host tensors (see PromptEmbeds)
    mask = torch.cat(masks) if all(m is not None for m in masks) else None
    return PromptEmbeds(torch.cat([rows(p.embeds).to(device) for p in parts]), mask)
