"""The training objective of one micro-batch: noise the latents at sampled timesteps and regress the family's
target, with the loss options of `train` (timestep samplers, min-SNR, noise offset, blank-prompt preservation,
differential guidance). Handed to the trainer as a part, so another objective is another object, not another
trainer class."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from toolkit.config.sections import ObjectiveSection
from toolkit.data.dataset import reference_fields
from toolkit.device import to_device
from toolkit.diffusion.noise import noise_offset
from toolkit.diffusion.snr import min_snr_weights
from toolkit.diffusion.timestep_params import TimestepParams
from toolkit.diffusion.timesteps import sample_timestep_u
from toolkit.errors import UserError
from toolkit.models.base import Expert, LatentDist, ModelAdapter, PromptEmbeds, join_padded
from toolkit.train.losses import batch_mean_loss, mask_weights, mse_loss, per_sample_loss, weighted_mean
from toolkit.train.seeding import derive_seed, seeded_generator


@dataclass
class StepDraw:
    """Where a micro-batch sits in training: every draw is a pure function of (seed, purpose, epoch, batch), and the
    schedule-dependent ones of the update index and progress. `batch` is the micro-batch's place in its epoch's batch
    order over all processes (process r of N takes batches r, r + N, ...: its micro-batch m is batch m x N + r), so a
    batch draws the same noise and timesteps whichever process, and however many, compute it."""

    epoch: int
    batch: int
    update_index: int
    progress: float


@dataclass
class LossResult:
    """The loss to optimise, its named parts (logged), and each sample's u and loss (timestep statistics)."""

    loss: torch.Tensor
    parts: dict[str, torch.Tensor]
    u: torch.Tensor
    #: each sample's loss: made where the loss is made from it, else only when asked (`per_sample`)
    sample_losses: torch.Tensor | Callable[[], torch.Tensor]

    @property
    def per_sample(self) -> torch.Tensor:
        if callable(self.sample_losses):
            self.sample_losses = self.sample_losses()
        return self.sample_losses


class DiffusionObjective:
    def __init__(self, section: ObjectiveSection, seed: int, adapter: ModelAdapter,
                 blank_embeds: PromptEmbeds | None = None):
        self.cfg = section
        self.seed = seed
        self.adapter = adapter
        self.blank_embeds = blank_embeds
        #: one CPU generator per purpose, seeded anew for every draw (`seeded_generator`'s state, without making one)
        self.generators: dict[str, torch.Generator] = {}
        self.timestep_params = TimestepParams(**section.timestep_params.model_dump())
        if section.blank_prompt_preservation and blank_embeds is None:
            raise ValueError("blank-prompt preservation needs the blank prompt's embeddings")
        if (section.timestep_type == "shift" and self.timestep_params.dynamic_shift
                and adapter.noise_schedule.shift_schedule is None):
            # known only from the loaded scheduler's config (Z-Image ships with dynamic shifting off)
            raise UserError(f"train.timestep_params.dynamic_shift: the {adapter.arch} scheduler defines no "
                            "base/max shift; set timestep_params.shift instead")

    def loss(self, batch: dict, embeds: PromptEmbeds, at: StepDraw) -> LossResult:
        cfg, schedule = self.cfg, self.adapter.noise_schedule

        def draws(purpose: str) -> torch.Generator:
            return self.seeded(purpose, at.epoch, at.batch, 0)  # the 0 keeps one process's draws as before

        latents = self.batch_latents(batch, draws("latent_sample"))
        # drawn on the host (the same numbers on every device type), sent without waiting for the device
        noise = torch.randn(latents.shape, generator=draws("noise"))
        if cfg.noise_offset:  # its generator only where it draws (offset 0 draws nothing)
            noise = noise_offset(noise, cfg.noise_offset, draws("noise_offset"))
        noise = to_device(noise, latents.device)
        u, sampler_weight = self.draw_timesteps(latents, draws("timestep"), at)
        timesteps = to_device(schedule.timesteps(u), latents.device)
        noisy = schedule.add_noise(latents, noise, timesteps)
        with_blank = self.blank_prompt_due(at.update_index)
        sizes = batch.get("image_sizes")
        expert = self.adapter.expert_at(at.update_index)
        references = self.batch_references(batch)
        prediction, blank_prediction = self.predict(noisy, timesteps, embeds, with_blank, sizes, expert, references)
        target = schedule.target(latents, noise, timesteps)
        if cfg.differential_guidance_scale is not None:
            anchor = prediction.detach()
            target = anchor + cfg.differential_guidance_scale * (target - anchor)
        mask = self.loss_mask(batch, latents)
        if mask is None and sampler_weight is None and cfg.min_snr_gamma is None:
            loss = batch_mean_loss(prediction, target, cfg.loss_type, cfg.huber_c)
            per_sample = functools.partial(detached_sample_losses, prediction, target, cfg.loss_type, cfg.huber_c)
        else:
            per_sample = per_sample_loss(prediction, target, cfg.loss_type, cfg.huber_c, mask)
            snr_weight = None
            if cfg.min_snr_gamma is not None:
                snr_weight = min_snr_weights(schedule.snr(timesteps), cfg.min_snr_gamma, schedule.prediction_type)
            loss = weighted_mean(per_sample, sampler_weight, snr_weight)
        parts = {"loss_diff_guidance" if cfg.differential_guidance_scale else "loss_main": loss.detach()}
        if with_blank:
            bpp = self.blank_prompt_loss(noisy, timesteps, blank_prediction, sizes, expert, references)
            loss = loss + cfg.blank_prompt_preservation_multiplier * bpp
            parts["loss_bpp"] = bpp.detach()
        return LossResult(loss, parts, u, per_sample)

    def seeded(self, purpose: str, *counters: int) -> torch.Generator:
        """The purpose's generator, seeded for these counters: the state `seeded_generator` would make, in a generator
        kept per purpose (each is used up within the micro-batch that seeds it)."""
        generator = self.generators.get(purpose)
        if generator is None:
            generator = self.generators[purpose] = torch.Generator(device="cpu")
        return generator.manual_seed(derive_seed(self.seed, purpose, *counters))

    def draw_timesteps(self, latents: torch.Tensor, generator: torch.Generator, at: StepDraw):
        """u per sample (and the sampler's loss weight, if any) for this update's place in training; where the family
        routes between experts, inside the range of the expert this update trains."""
        cfg, schedule = self.cfg, self.adapter.noise_schedule
        return sample_timestep_u(
            cfg.timestep_type, self.timestep_params, latents.shape[0], generator,
            content_or_style=cfg.content_or_style, timestep_range=self.timestep_range(at.update_index),
            progress=at.progress,
            update_index=at.update_index, image_seq_len=schedule.image_seq_len(latents),
            shift_schedule=schedule.shift_schedule,
        )

    def timestep_range(self, update_index: int) -> tuple[float, float]:
        """`train.timestep_range`, within the range of the expert the update trains (the sampler's draw is rescaled
        into it, keeping its shape, as `timestep_range` does)."""
        low, high = self.cfg.timestep_range
        expert = self.adapter.expert_at(update_index)
        if expert is None:
            return low, high
        start, stop = expert.u_range
        return start + (stop - start) * low, start + (stop - start) * high

    def blank_prompt_due(self, update_index: int) -> bool:
        """Whether this update computes the blank-prompt term: a pure function of (seed, update)."""
        if not self.cfg.blank_prompt_preservation:
            return False
        draw = torch.rand((), generator=seeded_generator(self.seed, "blank_prompt", update_index))
        return draw.item() < self.cfg.blank_prompt_probability

    def predict(self, noisy, timesteps, embeds: PromptEmbeds, with_blank: bool, sizes: torch.Tensor | None,
                expert: Expert | None = None, references: list[torch.Tensor] | None = None):
        """The LoRA model's prediction; with the blank prompt too, in the same forward pass (one pass keeps
        multi-process gradient sync simple and is faster than two), each sample's references given to both."""
        if not with_blank:
            return self.adapter.predict(noisy, timesteps, embeds, image_sizes=sizes, expert=expert,
                                        references=references), None
        both = self.adapter.predict(torch.cat([noisy, noisy]), torch.cat([timesteps, timesteps]),
                                    concat_embeds(embeds, self.blank_embeds, len(noisy)),
                                    image_sizes=None if sizes is None else torch.cat([sizes, sizes]), expert=expert,
                                    references=None if references is None else [torch.cat([r, r]) for r in references])
        return both[: len(noisy)], both[len(noisy):]

    def batch_references(self, batch: dict) -> list[torch.Tensor] | None:
        """The batch's reference latents in slot order (image-editing families): from the cached means, or encoded
        now from the batch's reference pixels; None for a batch without references."""
        fields = reference_fields([batch])
        if fields["reference_mean"]:
            return [self.adapter.reference_latents(batch[field]) for field in fields["reference_mean"]]
        if not fields["reference_pixels"]:
            return None
        with torch.no_grad():
            return [self.adapter.reference_latents(self.adapter.encode_latent_dist(batch[field]).mean)
                    for field in fields["reference_pixels"]]

    def blank_prompt_loss(self, noisy, timesteps, blank_prediction, sizes: torch.Tensor | None,
                          expert: Expert | None = None, references: list[torch.Tensor] | None = None) -> torch.Tensor:
        """MSE between the LoRA model's and the base model's predictions for the blank prompt. The base pass is the
        base model's own prediction: adapters off, no dropout (eval mode), and it draws nothing from the global
        RNG streams training uses (they are forked around it)."""
        module = self.adapter.trainable_module()
        blank = concat_embeds(self.blank_embeds, None, len(noisy))
        devices = [noisy.device.index or 0] if noisy.device.type == "cuda" else []
        was_training = module.training
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            module.disable_adapters()
            module.eval()
            try:
                base = self.adapter.predict(noisy, timesteps, blank, module=module, image_sizes=sizes, expert=expert,
                                            references=references)
            finally:
                module.train(was_training)
                module.enable_adapters()
        return mse_loss(blank_prediction, base)

    @staticmethod
    def loss_mask(batch: dict, latents: torch.Tensor) -> torch.Tensor | None:
        """The batch's loss masks (`datasets[].mask_path`) as per-element weights on the latent grid; None without."""
        return mask_weights(batch["mask"], latents) if "mask" in batch else None

    def batch_latents(self, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """Latents drawn from the cached encoder output (variants that had no entry were encoded and merged in batch
        order before: `LatentCache.complete`), or from encoding the batch's pixels now."""
        if "latent_mean" in batch:
            dist = LatentDist(batch["latent_mean"], batch.get("latent_std"))
            return self.adapter.latents_from_dist(dist, generator)
        return self.adapter.encode_images(batch["pixels"], generator)


def detached_sample_losses(prediction: torch.Tensor, target: torch.Tensor, loss_type, huber_c: float) -> torch.Tensor:
    """Each sample's loss, outside the graph: for statistics of a loss that was made without them."""
    with torch.no_grad():
        return per_sample_loss(prediction.detach(), target.detach(), loss_type, huber_c)


def concat_embeds(embeds: PromptEmbeds, blank: PromptEmbeds | None, batch: int) -> PromptEmbeds:
    """`embeds` (one row is repeated to `batch` rows) followed by `blank` repeated to `batch` rows."""
    parts = [embeds] if blank is None else [embeds, blank]

    def rows(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return tensor.expand(batch, *tensor.shape[1:]) if tensor is not None and tensor.shape[0] == 1 else tensor

    device = embeds.embeds.device
    # masks are host tensors (see PromptEmbeds); prompts of their own lengths are padded to the longest
    joined, mask = join_padded([rows(p.embeds).to(device) for p in parts], [rows(p.attention_mask) for p in parts])
    pooled = [rows(p.pooled) for p in parts]
    pooled = torch.cat([p.to(device) for p in pooled]) if all(p is not None for p in pooled) else None
    return PromptEmbeds(joined, mask, pooled=pooled)
