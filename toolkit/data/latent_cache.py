"""Latent cache: each image or clip encoded once, per augmentation variant, keyed by content.

A cache key is a hash of the file's bytes, the variant (bucket size and crop; for a clip also the source frames
it takes, so `num_frames`, `fps` and looping change it where they change the frames) and the encoder's identity
(model path, dtype and config), so replacing an image under the same name, or changing the model, is a cache
miss instead of a stale latent. A clip is encoded as one [1, 3, F, H, W] video. Entries store the encoder's mean
and std, not a sample, so every epoch still draws its own latent sample as an uncached run does, and the image's
size facts (original size, crop, target size: SDXL's conditioning) as the encoded pixels were made.

On disk: `<cache_dir>/latents/<key>.safetensors`, written under a temporary name and renamed, so a
partly written file is never read. In memory: every process encodes every image it may be given.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from toolkit.data.dataset import ImageDataset, TrainItem, image_sizes, load_pixels
from toolkit.files import write_atomic
from toolkit.models.base import LatentDist, ModelAdapter
from toolkit.run.metrics import progress_bars_wanted

log = logging.getLogger("difftune")
def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class LatentCache:
    """Cached latent distributions for the dataset items whose dataset asked for them."""

    def __init__(self, dataset: ImageDataset, roots: dict[int, Path], to_disk: dict[int, bool], identity: str):
        self.dataset = dataset
        self.roots = roots  # dataset index -> cache folder, for the datasets that cache
        self.to_disk = to_disk
        self.identity = identity
        self.memory: dict[str, tuple[LatentDist, torch.Tensor]] = {}  # key -> entry, for datasets cached in memory
        self._digests: dict[Path, str] = {}
        self.keys = {i: self.key(item) for i, item in enumerate(dataset.items) if item.dataset in roots}

    def key(self, item: TrainItem) -> str:
        path = item.record.path
        if path not in self._digests:
            self._digests[path] = file_digest(path)
        variant = f"{item.bucket[0]}x{item.bucket[1]}-center"
        if item.record.clip is not None:  # images keep the keys they always had
            variant += "-frames" + ",".join(str(index) for index in item.record.clip.indices)
        return hashlib.sha256(f"{self._digests[path]}|{variant}|{self.identity}".encode()).hexdigest()[:32]

    def path(self, index: int) -> Path:
        item = self.dataset.items[index]
        return self.roots[item.dataset] / "latents" / f"{self.keys[index]}.safetensors"

    def covers(self, index: int) -> bool:
        return index in self.keys

    @property
    def covers_everything(self) -> bool:
        return len(self.keys) == len(self.dataset)

    def build(self, adapter: ModelAdapter, accelerator) -> None:
        """Encode what is missing, once per entry (repeats and copies share one). Disk entries are shared
        out across processes; memory entries are encoded by every process."""
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
            dist = adapter.encode_latent_dist(load_pixels(item).unsqueeze(0))
            entry = LatentDist(dist.mean[0].cpu(), None if dist.std is None else dist.std[0].cpu())
            if self.to_disk[item.dataset]:
                self.write(self.path(index), entry, image_sizes(item))
            else:
                self.memory[self.keys[index]] = (entry, image_sizes(item))
        accelerator.wait_for_everyone()

    @staticmethod
    def write(path: Path, entry: LatentDist, sizes: torch.Tensor) -> None:
        tensors = {"mean": entry.mean.contiguous(), "image_sizes": sizes.contiguous()}
        if entry.std is not None:
            tensors["std"] = entry.std.contiguous()
        write_atomic(path, lambda tmp: save_file(tensors, str(tmp)))

    def get(self, index: int) -> tuple[LatentDist, torch.Tensor]:
        """The entry's latent distribution and the size facts of the pixels it was encoded from."""
        if self.keys[index] in self.memory and not self.to_disk[self.dataset.items[index].dataset]:
            return self.memory[self.keys[index]]
        path = self.path(index)
        try:
            tensors = load_file(str(path))
        except Exception as err:  # a damaged or deleted entry: name it
            raise RuntimeError(f"cached latent {path} for {self.dataset.items[index].record.path} is "
                               f"unreadable ({err}); delete the cache folder to rebuild it") from err
        if "image_sizes" not in tensors:  # written before entries kept them: the same crop plan made it
            tensors["image_sizes"] = image_sizes(self.dataset.items[index])
        return LatentDist(tensors["mean"], tensors.get("std")), tensors["image_sizes"]
