"""The validation loss (`validation:`): held-out samples denoised at fixed noise and fixed noise levels, so the value
changes only when the weights do.

- Which samples: a held-out folder, or a fraction of the training datasets' images chosen by the seed alone
  (`split_held_out`, before the training dataset is built, so they are never trained on).
- Fixed batches: the held-out items grouped by size and cut into `batch_size` batches in one order, whatever the
  process count; batch b is evaluated by process b mod N. Each batch's latents (one draw from the encoder's
  distribution) and, unless the text encoders train, its prompt embeddings are computed once at the start.
- Fixed draws: noise level k of N is u = (k + 0.5) / N for every sample; batch b's noise at level k comes from a
  generator keyed by (seed, "val_noise", b, k).
- Bit-identical on any process count: every (sample, level) loss is computed by exactly one process on the same
  batch, written into a table of zeros, summed over processes (x + 0 = x exactly), and averaged in one fixed order.
  The forward passes run without gradients, in eval mode (no dropout), on the module outside DDP (no collective per
  forward, so processes with fewer batches do not wait), with the global RNG forked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from toolkit.config.sections import DatasetConfig, ObjectiveSection, ValidationConfig
from toolkit.data.dataset import (
    DatasetError,
    ImageRecord,
    TrainItem,
    image_sizes,
    items_for_dataset,
    load_mask,
    load_pixels,
    load_references,
    reference_sizes,
    reference_views,
    scan_folder,
)
from toolkit.device import to_device
from toolkit.models.base import ModelAdapter, PromptEmbeds
from toolkit.models.config import ReferenceFacts
from toolkit.train.losses import mask_weights, per_sample_loss
from toolkit.train.seeding import seeded_generator

log = logging.getLogger("difftune")

#: the thirds of the noise range a `val_loss_<band>` covers: [low, high) of u
BANDS = {"low": (0.0, 1 / 3), "mid": (1 / 3, 2 / 3), "high": (2 / 3, 1.0 + 1e-9)}


def noise_levels(count: int) -> list[float]:
    """u = (k + 0.5) / count: evenly spread, never exactly clean or pure noise."""
    return [(k + 0.5) / count for k in range(count)]


def split_held_out(scanned: list[list[ImageRecord]], datasets: list[DatasetConfig], fraction: float, seed: int
                   ) -> tuple[list[list[ImageRecord]], list[list[ImageRecord]]]:
    """The training datasets' records without the held-out ones, and the held-out ones per dataset: round(fraction x
    images) of the non-regularisation images (at least one), chosen by a permutation drawn from the seed alone (the
    same on every process count)."""
    candidates = [r for d, records in enumerate(scanned) if not datasets[d].is_reg for r in records]
    if len(candidates) < 2:
        raise DatasetError(f"validation.split: the training datasets have {len(candidates)} image(s); a split needs "
                           "at least 2 (one to train on, one to hold out)")
    count = min(len(candidates) - 1, max(1, round(fraction * len(candidates))))
    order = torch.randperm(len(candidates), generator=seeded_generator(seed, "validation_split")).tolist()
    chosen = {candidates[i].path for i in order[:count]}
    kept = [[r for r in records if r.path not in chosen] for records in scanned]
    emptied = [d for d, records in enumerate(kept) if scanned[d] and not records]
    if emptied:
        raise DatasetError(f"validation.split ({fraction}) takes every image of datasets[{emptied[0]}] "
                           f"({datasets[emptied[0]].folder_path}); lower the split")
    return kept, [[r for r in records if r.path in chosen] for records in scanned]


@dataclass
class HeldOut:
    """The held-out samples, read before any model loads: per dataset config (the validation folder's is datasets[0]'s
    with its folder), its records."""

    sources: list[tuple[DatasetConfig, list[ImageRecord]]]

    def items(self, divisor: int) -> list[TrainItem]:
        """One item per (sample, training size), no repeats; an item's `dataset` is its source's number."""
        return [item for number, (cfg, records) in enumerate(self.sources) if records
                for item in items_for_dataset(records, cfg.model_copy(update={"num_repeats": 1}), divisor, number)]

    def mask_min_values(self) -> list[float]:
        """Each source's `mask_min_value` (a split's samples keep their dataset's loss masks)."""
        return [cfg.mask_min_value for cfg, _ in self.sources]


def read_held_out(cfg: ValidationConfig, datasets: list[DatasetConfig], scanned: list[list[ImageRecord]], seed: int,
                  trigger_word: str | None, frame_step: int, family: str) -> tuple[list[list[ImageRecord]], HeldOut]:
    """The training records (without a split's held-out ones) and the held-out samples: the split's, or the
    validation folder read with datasets[0]'s settings (the trigger word applied)."""
    if cfg.split is not None:
        kept, held = split_held_out(scanned, datasets, cfg.split, seed)
        return kept, HeldOut(list(zip(datasets, held)))
    folder_cfg = datasets[0].model_copy(update={"folder_path": cfg.folder_path, "is_reg": False, "mask_path": None,
                                                "control_path": cfg.control_path})
    return scanned, HeldOut([(folder_cfg, scan_folder(folder_cfg, trigger_word, frame_step, family))])


@dataclass
class HeldOutBatch:
    """One fixed batch: which rows of the loss table it fills, its latents, conditioning, size facts, loss mask
    weights (a split's samples from a dataset with `mask_path`) and reference latents (image-editing families)."""

    number: int
    rows: list[int]
    latents: torch.Tensor
    captions: list[str]
    embeds: PromptEmbeds | None
    sizes: torch.Tensor | None
    mask: torch.Tensor | None
    references: list[torch.Tensor] | None = None


class Validation:
    """Built with the held-out items, the `validation` section, the objective's loss settings, the seed and the
    adapter; `encode_latents` and `encode_prompts` prepare this process's batches once; `evaluate` gives the figures
    of the current weights (call it with the trained modules in eval mode: `in_eval_mode`)."""

    def __init__(self, cfg: ValidationConfig, items: list[TrainItem], objective: ObjectiveSection, seed: int,
                 adapter: ModelAdapter, sizes: bool, mask_min_values: list[float] | None = None,
                 references: ReferenceFacts | None = None):
        """`mask_min_values`: per source (an item's `dataset`), its `mask_min_value`; `references`: the family's rule
        for reference images."""
        if not items:
            raise DatasetError("validation: no held-out samples")
        self.cfg, self.items, self.objective, self.seed, self.adapter, self.sizes = (
            cfg, items, objective, seed, adapter, sizes)
        self.mask_min_values = mask_min_values or [0.0] * (1 + max(item.dataset for item in items))
        self.references = references
        self.levels = [u for u in noise_levels(cfg.timesteps) if adapter.trains_noise_level(u)]
        if not self.levels:
            raise DatasetError("validation.timesteps: none of its noise levels is one the LoRA trains")
        self.batches: list[HeldOutBatch] = []

    def batch_rows(self) -> list[list[int]]:
        """The item indices of each fixed batch: grouped by size (frames, width, height, and the references' sizes),
        then in order."""
        groups: dict[tuple, list[int]] = {}
        for index, item in enumerate(self.items):
            references = reference_sizes(item, self.references) if self.references is not None else ()
            groups.setdefault((item.frames, *item.bucket, references), []).append(index)
        size = self.cfg.batch_size
        return [rows[i:i + size] for key in sorted(groups) for rows in [groups[key]] for i in range(0, len(rows), size)]

    @torch.no_grad()
    def encode_latents(self, rank: int, processes: int) -> None:
        """This process's batches (the image encoder on the device): latents drawn once from a generator keyed by
        (seed, batch), size facts, loss masks."""
        adapter = self.adapter
        self.batches = []
        #: whether the batches are split over the processes (their losses then summed by `evaluate`)
        self.split = processes > 1
        for number, rows in enumerate(self.batch_rows()):
            if number % processes != rank:
                continue
            items = [self.items[i] for i in rows]
            pixels = torch.stack([load_pixels(item) for item in items])
            latents = adapter.encode_images(pixels, seeded_generator(self.seed, "val_latent", number)).to(adapter.device)
            captions = [item.record.caption for item in items]
            sizes = torch.stack([image_sizes(item) for item in items]) if self.sizes else None
            mask = None
            if any(item.record.mask is not None for item in items):
                masks = torch.stack([load_mask(item, None, self.mask_min_values[item.dataset]) for item in items])
                mask = mask_weights(masks, latents)
            references = None
            if items[0].record.references:
                slots = zip(*(load_references(item, None, self.references) for item in items))
                references = [adapter.reference_latents(adapter.encode_latent_dist(torch.stack(pixels)).mean)
                              .to(adapter.device) for pixels in slots]
            self.batches.append(HeldOutBatch(number, rows, latents, captions, None, sizes, mask, references))
        log.info("validation: %d held-out samples in %d batches, %d noise levels; this process evaluates %d batches",
                 len(self.items), len(self.batch_rows()), len(self.levels), len(self.batches))

    @torch.no_grad()
    def encode_prompts(self) -> None:
        """The batches' prompts encoded once (the text encoder on the device), unless the text encoders train (then
        each evaluation encodes them with the weights of the moment)."""
        if self.adapter.text_encoders_train:
            return
        for batch in self.batches:
            batch.embeds = self.prompt_embeds(batch).to(self.adapter.device)

    def prompt_embeds(self, batch: HeldOutBatch) -> PromptEmbeds:
        """A batch's captions encoded; where the text encoder reads the references too, with the held-out samples'
        references (as their centre variant shows them)."""
        rules = self.references
        if rules is None or not rules.in_text:
            return self.adapter.encode_prompts(batch.captions)
        return self.adapter.encode_prompts(batch.captions, [reference_views(self.items[row], None, rules)
                                                            for row in batch.rows])

    @torch.no_grad()
    def losses(self, module: torch.nn.Module) -> torch.Tensor:
        """[items, levels]: this process's losses, zeros in the rows of other processes' batches. Level by level,
        then batch by batch: a family of several experts runs one expert for all batches of a level."""
        adapter, schedule = self.adapter, self.adapter.noise_schedule
        table = torch.zeros(len(self.items), len(self.levels), dtype=torch.float32)
        embeds = {batch.number: batch.embeds for batch in self.batches}
        if any(e is None for e in embeds.values()):
            embeds = {batch.number: self.prompt_embeds(batch) for batch in self.batches}
        for k, u in enumerate(self.levels):
            for batch in self.batches:
                latents = batch.latents
                noise = torch.randn(latents.shape, generator=seeded_generator(self.seed, "val_noise", batch.number, k))
                noise = to_device(noise, latents.device)
                timesteps = to_device(schedule.timesteps(torch.full((len(batch.rows),), u)), latents.device)
                noisy = schedule.add_noise(latents, noise, timesteps)
                prediction = adapter.predict(noisy, timesteps, embeds[batch.number], module=module,
                                             image_sizes=batch.sizes, references=batch.references)
                target = schedule.target(latents, noise, timesteps)
                loss = per_sample_loss(prediction, target, self.objective.loss_type, self.objective.huber_c,
                                       batch.mask)
                table[batch.rows, k] = loss.float().cpu()
        return table

    def figures(self, table: torch.Tensor) -> dict[str, float]:
        """`val_loss` (the mean over every sample and level) and the mean of each third of the noise range that has
        levels (`val_loss_low`, `val_loss_mid`, `val_loss_high`)."""
        values = {"val_loss": table.mean().item()}
        for name, (low, high) in BANDS.items():
            columns = [k for k, u in enumerate(self.levels) if low <= u < high]
            if columns:
                values[f"val_loss_{name}"] = table[:, columns].mean().item()
        return values

    def due(self, step: int, total: int) -> bool:
        """Whether the weights after update `step` are evaluated: every `every` updates and after the last."""
        return step % self.cfg.every == 0 or step == total

    def evaluate(self, module: torch.nn.Module, accelerator) -> dict[str, float]:
        """The figures of the current weights, the same on every process (collective: call on all of them)."""
        table = self.losses(module)
        if self.split:
            table = accelerator.reduce(table.to(accelerator.device), reduction="sum").cpu()
        return self.figures(table)

