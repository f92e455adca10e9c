"""Image folders with sidecar captions, bucketed by aspect ratio."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from toolkit.config.sections import DatasetConfig
from toolkit.data.buckets import bucket_sizes, nearest_bucket, resolutions_for_image
from toolkit.data.captions import apply_trigger, read_caption
from toolkit.data.media import IMAGE_EXTENSIONS, sample_files
from toolkit.errors import UserError

EXIF_ORIENTATION = 0x0112
log = logging.getLogger("difftune")


class DatasetError(UserError, ValueError):
    """A dataset that cannot be trained on; the message names the folder or file."""


@dataclass(frozen=True)
class ImageRecord:
    """One usable image file: its size as displayed (EXIF orientation applied) and its final caption."""

    path: Path
    width: int
    height: int
    caption: str


@dataclass(frozen=True)
class TrainItem:
    """One entry of an epoch: an image at one bucket size, from dataset number `dataset` of the job."""

    record: ImageRecord
    bucket: tuple[int, int]
    dataset: int = 0


def read_image_size(path: Path) -> tuple[int, int]:
    """Width and height as displayed; raises for files PIL cannot decode to the end.

    The whole file is decoded, because a truncated JPEG passes `verify()` and would only fail in the
    middle of training. JPEGs decode in draft mode (1/8 scale), which still reads every byte but costs
    a fraction of a full decode.
    """
    with Image.open(path) as image:
        width, height = image.size
        orientation = image.getexif().get(EXIF_ORIENTATION, 1)
        image.draft("RGB", (max(1, width // 8), max(1, height // 8)))
        image.load()
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def scan_folder(cfg: DatasetConfig, trigger_word: str | None) -> list[ImageRecord]:
    """The usable images of one dataset folder, sorted by name. Unreadable files are skipped, named."""
    folder = Path(cfg.folder_path)
    if not folder.is_dir():
        raise DatasetError(f"dataset folder not found: {folder}")
    records = []
    for path in sample_files(folder):
        try:
            width, height = read_image_size(path)
        except Exception as err:  # PIL raises many types for broken files; all mean "skip it"
            log.warning("skipping unreadable image %s: %s", path, err)
            continue
        caption = read_caption(path, cfg.caption_ext, cfg.default_caption)
        records.append(ImageRecord(path, width, height, apply_trigger(caption, trigger_word, cfg.is_reg)))
    if not records:
        raise DatasetError(f"dataset folder {folder} has no usable image ({', '.join(IMAGE_EXTENSIONS)})")
    return records


def items_for_dataset(records: list[ImageRecord], cfg: DatasetConfig, divisor: int, dataset: int = 0) -> list[TrainItem]:
    """Each image at each of its training sizes, in its nearest bucket, `num_repeats` times."""
    sizes = {r: bucket_sizes(r, divisor) for r in cfg.resolution}
    items = []
    for record in records:
        for resolution in resolutions_for_image(record.width, record.height, cfg.resolution):
            bucket = nearest_bucket(record.width, record.height, sizes[resolution])
            items.append(TrainItem(record, bucket, dataset))
    return items * cfg.num_repeats


@dataclass(frozen=True)
class CropPlan:
    """How an image becomes its bucket: resized to cover it, then centre-cropped."""

    resized: tuple[int, int]  # width, height after resizing
    left: int
    top: int


def crop_plan(width: int, height: int, bucket: tuple[int, int]) -> CropPlan:
    target_w, target_h = bucket
    scale = max(target_w / width, target_h / height)
    resized = (max(target_w, round(width * scale)), max(target_h, round(height * scale)))
    return CropPlan(resized, (resized[0] - target_w) // 2, (resized[1] - target_h) // 2)


def image_sizes(item: TrainItem) -> torch.Tensor:
    """The item's size facts as SDXL conditions on them (its `add_time_ids`): original height and width, the
    crop's top and left in the resized image, target height and width. int64, shape [6]."""
    plan = crop_plan(item.record.width, item.record.height, item.bucket)
    target_w, target_h = item.bucket
    return torch.tensor([item.record.height, item.record.width, plan.top, plan.left, target_h, target_w])


def load_pixels(item: TrainItem) -> torch.Tensor:
    """The image resized to cover its bucket and centre-cropped to it (`crop_plan`); CHW float in [-1, 1]."""
    target_w, target_h = item.bucket
    try:
        with Image.open(item.record.path) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
    except Exception as err:
        raise DatasetError(f"cannot read image {item.record.path}: {err}") from err
    plan = crop_plan(image.width, image.height, item.bucket)
    image = image.resize(plan.resized, Image.Resampling.BICUBIC)
    image = image.crop((plan.left, plan.top, plan.left + target_w, plan.top + target_h))
    array = np.asarray(image, dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1).div(127.5).sub(1.0)


class ImageDataset(torch.utils.data.Dataset):
    """All datasets of a job as one list of items; batches are formed by the bucket sampler.

    With a latent cache attached, covered items come as the cached latent distribution instead of pixels
    (no image is decoded); a batch never mixes the two (see `bucket_keys`). With `sizes` (families conditioned
    on them, SDXL), every sample carries its `image_sizes`: from the cache entry when cached (what its latent was
    made from), else from the crop plan; other families' batches do without.
    """

    def __init__(self, items: list[TrainItem], sizes: bool = False):
        self.items = items
        self.sizes = sizes
        self.latents = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        item = self.items[index]
        sample = {"caption": item.record.caption, "index": index}
        if self.latents is not None and self.latents.covers(index):
            dist, sizes = self.latents.get(index)
            sample["latent_mean"] = dist.mean
            if dist.std is not None:
                sample["latent_std"] = dist.std
            if self.sizes:
                sample["image_sizes"] = sizes
        else:
            sample["pixels"] = load_pixels(item)
            if self.sizes:
                sample["image_sizes"] = image_sizes(item)
        return sample

    def bucket_keys(self) -> list[tuple]:
        cached = self.latents.covers if self.latents is not None else (lambda index: False)
        return [(*item.bucket, cached(i)) for i, item in enumerate(self.items)]


def build_dataset(cfgs: list[DatasetConfig], trigger_word: str | None, divisor: int,
                  sizes: bool = False) -> ImageDataset:
    """`sizes`: samples carry their `image_sizes` (families conditioned on them)."""
    items: list[TrainItem] = []
    for number, cfg in enumerate(cfgs):
        items += items_for_dataset(scan_folder(cfg, trigger_word), cfg, divisor, number)
    return ImageDataset(items, sizes)


def collate(samples: list[dict]) -> dict:
    """Stack a batch; every sample must have the same fields and tensor shapes (one bucket)."""
    # indices stay a list: a tensor would be sent to the device with the batch and read back from it
    batch = {"captions": [s["caption"] for s in samples], "indices": [s["index"] for s in samples]}
    for field in ("pixels", "latent_mean", "latent_std", "image_sizes"):
        present = [s[field] for s in samples if field in s]
        if not present:
            continue
        shapes = {tuple(t.shape) for t in present}
        if len(present) != len(samples) or len(shapes) != 1:
            raise ValueError(f"a batch mixes {field} shapes {sorted(shapes)}; batches must come from one bucket")
        batch[field] = torch.stack(present)
    return batch
