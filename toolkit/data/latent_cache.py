"""Latent cache: each image or clip encoded once, per augmentation variant, keyed by content.

A cache key is a hash of the file's bytes, the variant (bucket size and crop; for a clip also the source frames
it takes, so `num_frames`, `fps` and looping change it where they change the frames) and the encoder's identity
(model path, dtype and config), so replacing an image under the same name, or changing the model, is a cache
miss instead of a stale latent. A clip is encoded as one [1, 3, F, H, W] video. Entries store the encoder's mean
and std, not a sample, so every epoch still draws its own latent sample as an uncached run does, and the image's
size facts (original size, crop, target size: SDXL's conditioning) as the encoded pixels were made.

Variants (`datasets[].flip_x`, `flip_y`, `random_crop`): the variant's name in the key is "WxH-center" for the centre
crop unflipped, as every key was before augmentation, and names the crop offset and the flips otherwise
(`variant_name`), so entries written before keep their keys. The centre variant of every item is encoded before
training (`build`); other variants cannot all be known in advance (a random crop has as many as its slack allows),
so one is encoded when it is first drawn and then kept like the rest, on disk or in memory as its dataset asks. Only
such a dataset's entries are made while training: an entry of a dataset without flips or crops that is missing or
damaged (a cache folder deleted mid-run) is an error naming it and its image, never encoded again on an image encoder
that may have left the device (a variant of a dataset that draws them is encoded again when drawn: its encoder stays).
The data loader never runs the encoder: a sample whose variant has no entry comes as pixels with the key to store it
under, and the training loop encodes those rows one by one, as `build` does, stores them and merges them with the
batch's cached rows in batch order (`complete`). A row's latent is therefore the entry's distribution whether the
entry was found or made now, and is drawn from it as from any cached row (`latents_from_dist` of the batch's
distribution). A mirrored variant's size facts are read as `image_sizes` says (its crop counted from the edges the
mirrored picture shows), also from entries written when they were counted before the mirror.

Loss masks (`datasets[].mask_path`): an entry of a dataset with masks also holds the variant's mask on the latent grid
[1, h, w] (area-resized, `losses.mask_to_grid`), and its key adds the mask file's digest and `mask_min_value`
(`mask=none` for a sample without a mask file); entries of datasets without masks keep their keys.

Reference images (image-editing families): an entry of a sample with references also holds each reference's latent
(the encoder's mean: the pipelines encode references at the mode), made from the reference as the variant shows it
(`load_references`), and its key adds each reference file's digest, its trained size and the family's sizing rule;
entries of samples without references keep their keys.

On disk: `<cache_dir>/latents/<key>.safetensors`, written under a temporary name and renamed, so a
partly written file is never read. In memory: every process encodes every image it may be given (and each process,
and a DataLoader worker's copy of the dataset, finds only the variants its own process made).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from toolkit.data.dataset import (
    ImageDataset,
    TrainItem,
    Variant,
    centre_variant,
    image_sizes,
    load_pixels,
    load_references,
    reference_sizes,
)
from toolkit.files import write_atomic
from toolkit.run.disk import disk_error
from toolkit.models.base import LatentDist, ModelAdapter
from toolkit.run.metrics import progress_bars_wanted
from toolkit.train.losses import mask_to_grid

log = logging.getLogger("difftune")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def variant_name(item: TrainItem, variant: Variant | None = None) -> str:
    """The variant's part of a cache key: "WxH-center" for the centre crop (the key every entry had before
    augmentation), else "WxH-crop<left>,<top>"; then "-flipx" / "-flipy" for a mirrored variant, and a clip's source
    frames."""
    centre = centre_variant(item)
    variant = variant or centre
    name = f"{item.bucket[0]}x{item.bucket[1]}"
    centred = (variant.left, variant.top) == (centre.left, centre.top)
    name += "-center" if centred else f"-crop{variant.left},{variant.top}"
    name += "-flipx" * variant.flip_x + "-flipy" * variant.flip_y
    if item.record.clip is not None:  # images keep the keys they always had
        name += "-frames" + ",".join(str(index) for index in item.record.clip.indices)
    return name


class CachedLatent(NamedTuple):
    """One entry: the encoder's output, the size facts of the pixels it was made from, in a dataset with masks the
    variant's loss mask on the latent grid [1, h, w], and the latents of its reference images."""

    dist: LatentDist
    sizes: torch.Tensor
    mask: torch.Tensor | None = None
    #: each reference's latent mean [C, h, w], in slot order (samples with references)
    references: tuple[torch.Tensor, ...] = ()


class LatentCache:
    """Cached latent distributions for the dataset items whose dataset asked for them."""

    def __init__(self, dataset: ImageDataset, roots: dict[int, Path], to_disk: dict[int, bool], identity: str):
        self.dataset = dataset
        self.roots = roots  # dataset index -> cache folder, for the datasets that cache
        self.to_disk = to_disk
        self.identity = identity
        self.memory: dict[str, CachedLatent] = {}  # key -> entry, for datasets cached in memory
        self._digests: dict[Path, str] = {}
        self.keys = {i: self.key(item) for i, item in enumerate(dataset.items) if item.dataset in roots}
        #: (item index, variant) -> key, each made once (`variant_key`): at most the centre and its three mirrors
        #: per item (random crops are not kept)
        self.variant_keys: dict[tuple[int, Variant], str] = {}
        #: the all-ones mask of each latent grid, one for every sample without a mask (`sample_fields`): samples made
        #: once (`ImageDataset.fixed_samples`) would otherwise keep one each
        self.no_masks: dict[tuple[int, int], torch.Tensor] = {}
        #: disk entries found damaged or missing while training, and why (path -> reason): each is encoded again from
        #: its image (`complete`) and written anew; the trainer warns once per entry and counts them
        self.damaged: dict[str, str] = {}
        #: the entries could not be written (a full disk): the latents are encoded live, nothing more is written
        self.unwritable = False

    def digest(self, path: Path) -> str:
        if path not in self._digests:
            self._digests[path] = file_digest(path)
        return self._digests[path]

    def key(self, item: TrainItem, variant: Variant | None = None) -> str:
        """The key of the item's variant (the centre one without `variant`)."""
        fields = [self.digest(item.record.path), variant_name(item, variant), self.identity]
        options = self.dataset.options_for(item.dataset)
        if options.masked:  # datasets without masks keep their keys
            mask = item.record.mask
            fields.append("mask=none" if mask is None else f"mask={self.digest(mask)},{options.mask_min_value}")
        if item.record.references:  # samples without references keep their keys
            rules = self.dataset.references
            sizes = reference_sizes(item, rules)
            fields.append(f"references={rules.size}:" + ",".join(
                f"{self.digest(reference.path)}@{width}x{height}"
                for reference, (width, height) in zip(item.record.references, sizes)))
        return hashlib.sha256("|".join(fields).encode()).hexdigest()[:32]

    def entry_path(self, item: TrainItem, key: str) -> Path:
        return self.roots[item.dataset] / "latents" / f"{key}.safetensors"

    def path(self, index: int) -> Path:
        """Where the centre variant of item `index` is stored (datasets cached on disk)."""
        return self.entry_path(self.dataset.items[index], self.keys[index])

    def covers(self, index: int) -> bool:
        return index in self.keys

    @property
    def covers_everything(self) -> bool:
        return len(self.keys) == len(self.dataset)

    @property
    def grows(self) -> bool:
        """Whether entries are added while training: a cached dataset draws flips or crops, whose variants are
        encoded when first drawn (so the image encoder must stay available)."""
        return any(self.dataset.options_for(dataset).varies for dataset in self.roots)

    def build(self, adapter: ModelAdapter, accelerator) -> None:
        """Encode the centre variants that are missing, once per entry (repeats and copies share one). Disk entries
        are shared out across processes; memory entries are encoded by every process."""
        on_disk = {self.path(i): i for i in self.keys if self.to_disk[self.dataset.items[i].dataset]}
        in_memory = {self.keys[i]: i for i in self.keys if not self.to_disk[self.dataset.items[i].dataset]}
        # shard the full list (the same on every process), then skip what exists: filtering first would
        # race with processes that are already writing
        share = list(on_disk.items())[accelerator.process_index :: accelerator.num_processes]
        todo = [i for path, i in share if not path.is_file()] + list(in_memory.values())
        if accelerator.is_main_process:
            log.info("latent cache: %d entries; this process encodes %d", len(on_disk) + len(in_memory), len(todo))
        shown = accelerator.is_main_process and todo and progress_bars_wanted()
        for index in tqdm(todo, desc="caching latents", disable=not shown):
            item = self.dataset.items[index]
            centre = centre_variant(item)
            self.encode(adapter, item, self.keys[index], centre, load_pixels(item, centre), self.mask_of(item, centre),
                        self.references_of(item, centre))
        accelerator.wait_for_everyone()

    def mask_of(self, item: TrainItem, variant: Variant) -> torch.Tensor | None:
        """The variant's mask in pixels for its entry; None for a dataset without masks."""
        return self.dataset.mask(item, variant) if self.dataset.options_for(item.dataset).masked else None

    def references_of(self, item: TrainItem, variant: Variant) -> list[torch.Tensor]:
        """The variant's reference images in pixels, for its entry (none for a sample without references)."""
        return load_references(item, variant, self.dataset.references) if item.record.references else []

    def encode(self, adapter: ModelAdapter, item: TrainItem, key: str, variant: Variant, pixels: torch.Tensor,
               mask: torch.Tensor | None, references: list[torch.Tensor] = ()) -> CachedLatent:
        """Encode one variant's pixels ([3, H, W] or a clip's [3, F, H, W]) alone and store the entry under `key`;
        `mask`, its loss mask in pixels [1, H, W], is stored on the latent grid; `references` (pixels [3, h, w] each)
        are encoded one by one, their means kept."""
        with torch.no_grad():
            dist = adapter.encode_latent_dist(pixels.unsqueeze(0))
            means = tuple(adapter.encode_latent_dist(reference.unsqueeze(0)).mean[0].cpu() for reference in references)
        mean = dist.mean[0].cpu()
        grid_mask = None if mask is None else mask_to_grid(mask, mean.shape[-2:]).cpu()
        entry = CachedLatent(LatentDist(mean, None if dist.std is None else dist.std[0].cpu()),
                             image_sizes(item, variant), grid_mask, means)
        if not self.to_disk[item.dataset]:
            self.memory[key] = entry
        elif not self.unwritable:
            try:
                self.write(self.entry_path(item, key), entry)
            except Exception as error:
                if disk_error(error, self.roots[item.dataset]) is None:
                    raise
                self.unwritable = True
                log.warning("the latent cache cannot be written (%s): latents are encoded live from here on, and "
                            "nothing more is written to %s", disk_error(error, self.roots[item.dataset]),
                            self.roots[item.dataset])
        return entry

    @staticmethod
    def write(path: Path, entry: CachedLatent) -> None:
        tensors = {"mean": entry.dist.mean.contiguous(), "image_sizes": entry.sizes.contiguous()}
        if entry.dist.std is not None:
            tensors["std"] = entry.dist.std.contiguous()
        if entry.mask is not None:
            tensors["mask"] = entry.mask.contiguous()
        for slot, reference in enumerate(entry.references):
            tensors[f"reference_{slot}"] = reference.contiguous()
        write_atomic(path, lambda tmp: save_file(tensors, str(tmp)))

    def get(self, index: int, variant: Variant | None = None) -> CachedLatent | None:
        """The entry of the item's variant (the centre one without `variant`): its latent distribution, the size facts
        of the pixels it was encoded from, and its mask; None while the variant has no entry."""
        return self.entry(self.dataset.items[index], self.variant_key(index, variant), variant)

    def variant_key(self, index: int, variant: Variant | None = None) -> str:
        """`key` of item `index`'s variant (its centre one without `variant`), hashed once per variant: a sample's
        key is asked for every time it is drawn."""
        if variant is None:
            return self.keys[index]
        item = self.dataset.items[index]
        if self.dataset.options_for(item.dataset).random_crop:  # a random crop rarely recurs: not kept
            return self.key(item, variant)
        key = self.variant_keys.get((index, variant))
        if key is None:
            key = self.variant_keys[index, variant] = self.key(item, variant)
        return key

    def entry(self, item: TrainItem, key: str, variant: Variant | None) -> CachedLatent | None:
        """The entry stored under `key`, None where there is none to use: a dataset that draws variants has none yet,
        or a disk entry is missing or damaged (deleted, cut short, overwritten since it was made: noted in `damaged`).
        Either is encoded from its image when drawn (`complete`, the image encoder visiting the accelerator where it
        left), and written anew."""
        grows = self.dataset.options_for(item.dataset).varies
        if not self.to_disk[item.dataset]:
            if key not in self.memory and not grows:  # `build` made them all, before any loader copied the dataset
                raise RuntimeError(f"the latent of {item.record.path} is missing from the in-memory cache")
            return self.memory.get(key)
        path = self.entry_path(item, key)
        if (grows or self.unwritable) and not path.is_file():
            return None
        try:
            tensors = load_file(str(path))
        except Exception as err:  # a damaged or deleted entry: encoded again from its image (`complete`)
            self.damaged.setdefault(str(path), f"{item.record.path}: {err}")
            return None
        if "image_sizes" not in tensors:  # written before entries kept them: the same crop plan made it
            tensors["image_sizes"] = image_sizes(item, variant)
        elif variant is not None and (variant.flip_x or variant.flip_y):
            # a mirrored variant's crop is counted from the edges it shows (`image_sizes`); entries written before
            # counted it from the unmirrored ones
            tensors["image_sizes"] = image_sizes(item, variant)
        dist = LatentDist(tensors["mean"], tensors.get("std"))
        slots = [f"reference_{slot}" for slot in range(len(item.record.references))]
        if any(slot not in tensors for slot in slots):
            self.damaged.setdefault(str(path), f"{item.record.path}: the entry lacks its reference latents")
            return None
        references = tuple(tensors[slot] for slot in slots)
        return CachedLatent(dist, tensors["image_sizes"], tensors.get("mask"), references)

    def sample_fields(self, entry: CachedLatent) -> dict[str, torch.Tensor]:
        """What a cached sample carries: the latent distribution, its size facts (families conditioned on them) and,
        in a job with masks, its mask on the latent grid (all ones for a dataset without masks)."""
        fields = {"latent_mean": entry.dist.mean}
        if entry.dist.std is not None:
            fields["latent_std"] = entry.dist.std
        if self.dataset.sizes:
            fields["image_sizes"] = entry.sizes
        if self.dataset.masked:
            fields["mask"] = entry.mask if entry.mask is not None else self.no_mask(tuple(entry.dist.mean.shape[-2:]))
        for slot, reference in enumerate(entry.references):
            fields[f"reference_mean_{slot}"] = reference
        return fields

    def no_mask(self, grid: tuple[int, int]) -> torch.Tensor:
        """All ones on a latent grid, [1, h, w]: one tensor per grid, shared (nothing in training writes into a
        batch: `test_training_leaves_in_memory_cache_entries_as_they_were`)."""
        if grid not in self.no_masks:
            self.no_masks[grid] = torch.ones(1, *grid)
        return self.no_masks[grid]

    def complete(self, batch: dict, adapter: ModelAdapter) -> dict:
        """A collated batch with pending rows (variants without an entry when they were loaded) made whole: each is
        encoded alone and stored (unless its entry appeared since: made by an earlier row or batch, another process, or
        while a loader worker's copy of the dataset could not see it), and the latent fields of every row are merged
        in batch order, as if the cache had held them all. Runs in the training loop, on this process's device."""
        pending = batch.pop("pending")
        made = {}
        for position, (row, key) in enumerate(zip(pending["rows"], pending["keys"], strict=True)):
            item, variant = self.dataset.items[batch["indices"][row]], batch["variants"][row]
            entry = self.entry(item, key, variant)
            if entry is None:
                mask = pending["mask"][position] if self.dataset.options_for(item.dataset).masked else None
                references = [pending[f"reference_pixels_{slot}"][position]
                              for slot in range(len(item.record.references))]
                entry = self.encode(adapter, item, key, variant, pending["pixels"][position], mask, references)
            made[row] = self.sample_fields(entry)
        device = pending["pixels"].device
        ready = [row for row in range(len(batch["indices"])) if row not in made]
        for field in next(iter(made.values())).keys() - {"image_sizes"}:
            rows = dict(zip(ready, batch[field])) if ready else {}
            rows.update({row: fields[field].to(device) for row, fields in made.items()})
            batch[field] = torch.stack([rows[row] for row in range(len(batch["indices"]))])
        return batch
