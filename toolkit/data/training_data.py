"""The data and conditioning part of a run: the dataset, its latent and text caches, the batch order and the
dataloader, and the micro-batches of an epoch from a (resumed) position.

Where a cached dataset draws flips or crops, the latent cache grows while training: the micro-batches this part
yields have their new variants encoded and stored here, in the training loop (`LatentCache.complete`), so the
loader's workers never run the image encoder, which then stays on the device."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import torch

from toolkit.config.sections import DatasetConfig, TrainConfig
from toolkit.data.buckets import BucketBatchSampler
from toolkit.data.dataset import DecodedImages, ImageDataset, ImageRecord, build_dataset, collate
from toolkit.data.handover import collate_in_worker
from toolkit.data.latent_cache import LatentCache
from toolkit.data.media import cache_root
from toolkit.data.run_order import RunBatchOrder
from toolkit.data.text_cache import CachedCaptions, LiveCaptions
from toolkit.device import ModulePlacement, modules_on, to_device
from toolkit.models.base import ModelAdapter, PromptEmbeds
from toolkit.run.disk import disk_error
from toolkit.train.plan import Position

log = logging.getLogger("difftune")


class TrainingData:
    """Built with what it needs: the dataset configs, the trigger word, the `train` keys of data order and
    caching, the family adapter (encoders, divisor) and where the encoders live."""

    def __init__(self, datasets: list[DatasetConfig], trigger_word: str | None, train: TrainConfig,
                 adapter: ModelAdapter, placement: ModulePlacement, scanned: list[list[ImageRecord]] | None = None):
        """`scanned`: the dataset folders as `scan_datasets` read them before the model loaded (else read now)."""
        self.cfgs = datasets
        self.trigger_word = trigger_word
        self.train = train
        self.adapter = adapter
        self.placement = placement
        self.dataset: ImageDataset = build_dataset(datasets, trigger_word, adapter.divisor,
                                                   sizes=adapter.facts.size_conditioning,
                                                   frame_step=adapter.facts.frame_step, family=adapter.facts.title,
                                                   scanned=scanned, seed=train.seed,
                                                   references=adapter.reference_rules)
        budget = round(train.runtime.decoded_images_gib * 2**30)
        self.dataset.decoded = DecodedImages(budget) if budget > 0 else None
        self.batch_sampler = self.make_batch_sampler()
        self.conditioning: LiveCaptions | CachedCaptions | None = None
        self.dataloader = None

    def make_batch_sampler(self) -> BucketBatchSampler:
        """The batch order of the dataset as it is now: its bucket keys say which items are cached, so it is made
        again once the latent cache is attached (`build_caches`). Where every dataset is cached, or none, every key
        says the same, and the order is the one made before."""
        return BucketBatchSampler(self.dataset.bucket_keys(), self.train.batch_size, self.train.seed)

    def warn_overlong_captions(self) -> None:
        records = list({item.record.path: item.record for item in self.dataset.items}.values())
        cut = self.adapter.text.overlong_prompts([r.caption for r in records])
        if cut:
            log.warning("%d captions are longer than the text encoder takes and will be cut, e.g. %s",
                        len(cut), records[cut[0]].path)

    def build_caches(self, accelerator) -> None:
        """Latent and text-embedding caches as the config asks; encoders that are no longer needed in the loop
        then leave the accelerator (they come back only to render samples). The image encoder stays where a cached
        dataset draws variants that are encoded when first drawn."""
        cfgs, adapter, placement = self.cfgs, self.adapter, self.placement
        roots = {i: cache_root(cfg.folder_path, cfg.cache_dir) for i, cfg in enumerate(cfgs)}
        caching = {i: roots[i] for i, cfg in enumerate(cfgs) if cfg.cache_latents or cfg.cache_latents_to_disk}
        if caching:
            cache = LatentCache(self.dataset, caching, {i: cfgs[i].cache_latents_to_disk for i in caching},
                                adapter.encoder_identity("image"))
            with placement.visiting(adapter.image_encoder_modules()):
                cache.build(adapter, accelerator)
            self.dataset.latents = cache
            # a batch never mixes cached latents with pixels: the batches are cut again, by the cached keys
            self.batch_sampler = self.make_batch_sampler()
            if cache.covers_everything and not cache.grows and not cache.unwritable:
                placement.offload(adapter.image_encoder_modules(), "image encoder unload")
        seed = self.train.seed
        self.conditioning = LiveCaptions(adapter, self.dataset, cfgs, seed, self.trigger_word)
        if self.train.cache_text_embeddings:
            cached = CachedCaptions(adapter, self.dataset, cfgs, seed, self.trigger_word, roots, placement.device)
            try:
                with placement.visiting(adapter.text_encoder_modules()):
                    cached.build(accelerator)
            except Exception as error:  # a cache that cannot be written: the captions are encoded live
                problem = disk_error(error, next(iter(roots.values())))
                if problem is None:
                    raise
                log.warning("the text-embedding cache cannot be written (%s): captions are encoded live instead, "
                            "and the text encoders stay on the accelerator", problem)
            else:
                self.conditioning = cached
                placement.offload(adapter.text_encoder_modules(), "text encoder unload")
        placement.keep_on_device(adapter.image_encoder_modules() + adapter.text_encoder_modules())

    def num_workers(self, processes: int = 1) -> int:
        """`train.num_workers`, or where it is unset (None) the count `default_num_workers` chooses for this
        machine's cores shared by `processes` training processes on it; none where no batch reads a file (every
        latent cached in memory, no variant encoded later): workers would only hand batches over."""
        configured = self.train.runtime.num_workers
        if configured is not None:
            return configured
        return default_num_workers(usable_cores(), processes) if self.reads_files() else 0

    def reads_files(self) -> bool:
        """Whether loading a batch reads files: images or clips decoded, or latents read from a disk cache."""
        cache = self.dataset.latents
        return cache is None or not cache.covers_everything or cache.grows or any(cache.to_disk.values())

    def make_dataloader(self, pin_memory: bool, workers: int | None = None, num_processes: int = 1,
                        rank: int = 0) -> torch.utils.data.DataLoader:
        """The dataloader of this process's batches (`RunBatchOrder`: process `rank` of the run's `num_processes`,
        a pass over the epochs; `run_batches` sets where it starts); `workers` overrides `num_workers()` (whose count
        assumes one training process on the machine)."""
        runtime = self.train.runtime
        workers = self.num_workers() if workers is None else workers
        return torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=RunBatchOrder(self.batch_sampler, num_processes, rank),
            # a worker's small tensors come in its pipe, not through shared memory (toolkit/data/handover.py)
            collate_fn=collate_in_worker if workers > 0 else collate,
            num_workers=workers,
            # a pass spans the run's epochs; this keeps the workers for a later pass too (a new `run_batches`)
            persistent_workers=workers > 0 and runtime.persistent_workers,
            pin_memory=pin_memory,
            # Each new iterator draws a worker seed; its own generator keeps that draw out of the global RNG, so a
            # resumed run (which starts an iterator mid-epoch) sees the same global RNG stream.
            generator=torch.Generator().manual_seed(self.train.seed),
        )

    @property
    def micro_batches_per_epoch(self) -> int:
        """Micro-batches per epoch on this process, as the dataloader's order gives them."""
        return self.dataloader.batch_sampler.per_epoch

    def run_batches(self, device: torch.device, position: Position, epochs: int | None = None) -> Iterator[dict]:
        """This process's batches from the (resumed) position on, epoch after epoch (to the end of epoch
        `epochs - 1` where given), in one pass of the dataloader (its workers start loading now), each placed on
        `device` and completed (`complete`) when taken. The micro-batches skipped to reach the position are not
        loaded."""
        self.dataloader.batch_sampler.start_at(position.epoch, position.micro_batch_in_epoch, epochs)
        return (self.complete(on_device(batch, device)) for batch in loaded_batches(self.dataloader))

    def epoch_batches(self, batches: Iterator[dict], position: Position) -> Iterator[tuple[int, dict]]:
        """The position's epoch as (micro-batch in the epoch, batch), from its micro-batch on, taken from the run's
        batches (`run_batches`)."""
        self.conditioning.start_epoch(position.epoch)
        for micro_batch in range(position.micro_batch_in_epoch, self.micro_batches_per_epoch):
            batch = next(batches, None)
            if batch is None:
                raise RuntimeError(f"the dataloader's pass ended at micro-batch {micro_batch} of epoch "
                                   f"{position.epoch}: batches were asked past the last epoch it was opened for")
            yield micro_batch, batch

    def one_epoch(self, device: torch.device, position: Position) -> Iterator[tuple[int, dict]]:
        """The position's epoch alone, from its micro-batch on (a pass of one epoch: no loading ahead into the
        next)."""
        return self.epoch_batches(self.run_batches(device, position, position.epoch + 1), position)

    def close(self) -> None:
        """The dataloader goes with the run, and its workers with it: a persistent worker otherwise lives (its copy
        of the dataset too) as long as this object, e.g. through the next jobs of the same command."""
        self.dataloader = None

    def complete(self, batch: dict) -> dict:
        """The batch with its pending rows (variants without a latent cache entry yet, or whose entry was found
        damaged) encoded and stored; an image encoder that left the accelerator visits it for them."""
        if "pending" not in batch:
            return batch
        with modules_on(self.adapter.image_encoder_modules(), self.placement.device):
            return self.dataset.latents.complete(batch, self.adapter)

    def embeds_for(self, batch: dict, epoch: int) -> PromptEmbeds:
        return self.conditioning.embeds_for(batch["indices"], epoch)


def loaded_batches(loader: torch.utils.data.DataLoader) -> Iterator[dict]:
    """One pass of a loader's batches. Its workers, where it has any, load them (torch's iterator). Without workers
    they are read here as torch's single-process iterator reads them, each sample of a batch from the dataset and
    then the collate function, without the iterator's per-batch profiler scope, fetcher and checks: about 15 us of
    host time per batch, several times that between a model's kernels (docs/performance.md). Pinning is left to
    `on_device`, which pins what it sends to CUDA."""
    if loader.num_workers > 0:
        return iter(loader)
    dataset, collate_fn = loader.dataset, loader.collate_fn
    return (collate_fn([dataset[index] for index in indices]) for indices in loader.batch_sampler)


def on_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors, and those of its pending rows, on `device` (`to_device`: from pinned memory without
    waiting for the work queued there); its lists (captions, indices, variants, keys) stay on the host. The loader
    places nothing itself (accelerate's placement, which this replaces, walks every list item and copies with a
    wait). On the CPU the batch is already where it goes: it is returned as it is."""
    if device.type == "cpu":  # a loader's tensors are host tensors
        return batch
    placed = {key: to_device(value, device) if isinstance(value, torch.Tensor) else value
              for key, value in batch.items()}
    if "pending" in batch:
        placed["pending"] = on_device(batch["pending"], device)
    return placed


class BadData:
    """Files found unreadable while training (toolkit.data.dataset `stand_in`, the latent cache's `damaged`): each
    warned about once, and counted for the metrics lines (`figures`)."""

    def __init__(self) -> None:
        self.replaced: dict[str, str] = {}
        self.reencoded: set[str] = set()

    def note(self, batch: dict, latents) -> None:
        """What this batch (and the cache, this far) found; host data only."""
        for path, reason in batch.get("replaced", ()):
            if path not in self.replaced:
                self.replaced[path] = reason
                log.warning("%s; the sample is replaced by the next readable one of its bucket, and will be at every "
                            "draw while the file stays unreadable", reason)
        damaged = getattr(latents, "damaged", None)
        if damaged and len(damaged) > len(self.reencoded):
            for path, reason in damaged.items():
                if path not in self.reencoded:
                    self.reencoded.add(path)
                    log.warning("cached latent %s was missing or damaged (%s): encoded again from its image and "
                                "written anew", path, reason)

    def figures(self) -> dict[str, int]:
        """The counts since the run (or this resume) began, for a metrics line; none while there are none."""
        counts = {"replaced_samples": len(self.replaced), "reencoded_latents": len(self.reencoded)}
        return {key: value for key, value in counts.items() if value}


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or `taskset`'s limit), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: the fewest cores per training process for which it gets loader workers, and the most workers it gets
CORES_FOR_WORKERS = 4
MAX_WORKERS = 4


def default_num_workers(cpu_count: int, processes: int = 1) -> int:
    """DataLoader workers per training process where `train.num_workers` is unset: none below 4 cores per process,
    else half of its cores, at most 4. A worker process decodes ahead of the training loop, but the loop still
    receives each batch from it (about 0.5 ms per batch of small tensors on 2 cores, sent by value; a tensor over
    256 KiB through shared memory, about 1-1.5 ms: toolkit/data/handover.py) and it shares the cores with the
    training process, whose own Python loop and torch threads need them: on 2 cores a worker cost more than it gave
    (docs/performance.md). Half of the cores leaves the other half to the training process; 4 workers decode a few
    hundred large images a second, more than a training step consumes."""
    per_process = cpu_count // max(1, processes)
    return 0 if per_process < CORES_FOR_WORKERS else min(MAX_WORKERS, per_process // 2)
