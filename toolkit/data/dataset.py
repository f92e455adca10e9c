"""Dataset folders with sidecar captions, bucketed by aspect ratio (and, for video families, frame count): images, and
for video families clips too (toolkit/data/clips.py reads them)."""

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
from toolkit.data.clips import (
    ANIMATED_IMAGE_EXTENSIONS,
    CONTAINER_EXTENSIONS,
    ClipError,
    ClipInfo,
    clip_info,
    frame_indices,
    read_frames,
)
from toolkit.data.media import clip_files, sample_extensions, sample_files
from toolkit.errors import UserError

EXIF_ORIENTATION = 0x0112
log = logging.getLogger("difftune")


class DatasetError(UserError, ValueError):
    """A dataset that cannot be trained on; the message names the folder or file."""


@dataclass(frozen=True)
class ClipFrames:
    """The frames a clip sample takes: the clip as read when its folder was scanned, and the source frame indices
    its dataset's `num_frames`, `fps` and `short_clips` chose (`clips.frame_indices`), in order (repeated where a
    short clip loops)."""

    info: ClipInfo
    indices: tuple[int, ...]


@dataclass(frozen=True)
class ImageRecord:
    """One usable sample file: its size as displayed (EXIF orientation applied; a clip's frame size) and its final
    caption. `clip` is set for a clip (video families only): which of its frames the sample takes; an image has
    none and is one frame, whatever `num_frames` says."""

    path: Path
    width: int
    height: int
    caption: str
    clip: ClipFrames | None = None

    @property
    def frames(self) -> int:
        """Frames in the sample: 1 for an image, the chosen count for a clip."""
        return len(self.clip.indices) if self.clip is not None else 1


@dataclass(frozen=True)
class TrainItem:
    """One entry of an epoch: an image or clip at one bucket size, from dataset number `dataset` of the job."""

    record: ImageRecord
    bucket: tuple[int, int]
    dataset: int = 0

    @property
    def frames(self) -> int:
        return self.record.frames


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


#: files that may hold several frames: a clip in a video family (a one-frame GIF or WebP there is an image)
MAYBE_CLIP_EXTENSIONS = CONTAINER_EXTENSIONS + ANIMATED_IMAGE_EXTENSIONS


def scan_folder(cfg: DatasetConfig, trigger_word: str | None, frame_step: int = 0,
                family: str = "this model family") -> list[ImageRecord]:
    """The usable samples of one dataset folder, sorted by name. Unreadable files are skipped, named.

    `frame_step` is the family's (`FamilyFacts.frame_step`): 0, an image family, takes images only (its folder's
    clip files are left out with one warning naming `family`); a video family takes clips too, each with the frames
    its dataset's `num_frames` / `fps` / `short_clips` choose. Clips too short for them (with `short_clips: refuse`)
    are refused here, all named at once, before any training."""
    folder = Path(cfg.folder_path)
    if not folder.is_dir():
        raise DatasetError(f"dataset folder not found: {folder}")
    video = frame_step > 0
    if not video:
        ignored = clip_files(folder)
        if ignored:
            log.warning("%d clip file(s) in %s ignored (e.g. %s): %s trains on images", len(ignored), folder,
                        ignored[0].name, family)
    records, short = [], []
    for path in sample_files(folder, video):
        try:
            sample = _read_sample(path, cfg, video)
        except ClipError as err:  # too short for num_frames (unreadable clips are skipped in _read_sample)
            short.append(str(err))
            continue
        if sample is None:
            continue
        (width, height), clip = sample
        caption = read_caption(path, cfg.caption_ext, cfg.default_caption)
        records.append(ImageRecord(path, width, height, apply_trigger(caption, trigger_word, cfg.is_reg), clip))
    if short:
        raise DatasetError("\n".join(short))
    clips = [r for r in records if r.clip is not None and r.clip.info.frames > 1]
    if clips and cfg.num_frames == 1:
        log.warning("%s: %d clip(s) train as one frame each (e.g. %s): datasets[].num_frames is 1; set it (e.g. 33) "
                    "to train on their motion", folder, len(clips), clips[0].path.name)
    if not records:
        kinds = "image or clip" if video else "image"
        raise DatasetError(f"dataset folder {folder} has no usable {kinds} ({', '.join(sample_extensions(video))})")
    return records


def _read_sample(path: Path, cfg: DatasetConfig, video: bool) -> tuple[tuple[int, int], ClipFrames | None] | None:
    """A sample file's size and, for a clip, its frames; None (after a warning naming it) for an unreadable file.
    A clip too short for its dataset's `num_frames` / `fps` (with `short_clips: refuse`) raises ClipError."""
    if video and path.suffix.lower() in MAYBE_CLIP_EXTENSIONS:
        try:
            info = clip_info(path)
        except ClipError as err:
            log.warning("skipping unreadable clip %s: %s", path, err)
            return None
        if info.frames > 1:
            indices = frame_indices(info, cfg.num_frames, cfg.fps, cfg.short_clips, name=str(path))
            return (info.width, info.height), ClipFrames(info, tuple(indices))
        if path.suffix.lower() in CONTAINER_EXTENSIONS:  # a one-frame video: a still, read as a clip
            return (info.width, info.height), ClipFrames(info, (0,))
        # a one-frame GIF or WebP: an image
    try:
        return read_image_size(path), None
    except Exception as err:  # PIL raises many types for broken files; all mean "skip it"
        log.warning("skipping unreadable image %s: %s", path, err)
        return None


def items_for_dataset(records: list[ImageRecord], cfg: DatasetConfig, divisor: int, dataset: int = 0) -> list[TrainItem]:
    """Each image or clip at each of its training sizes, in its nearest bucket, `num_repeats` times."""
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
    """The image resized to cover its bucket and centre-cropped to it (`crop_plan`), float in [-1, 1]: [3, H, W]
    for an image (and any one-frame sample), [3, F, H, W] for a clip of F frames (every frame cropped alike;
    only this clip is decoded, only up to its last chosen frame)."""
    if item.record.clip is not None:
        return _clip_pixels(item)
    try:
        with Image.open(item.record.path) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
    except Exception as err:
        raise DatasetError(f"cannot read image {item.record.path}: {err}") from err
    return torch.from_numpy(_fit(image, item.bucket)).permute(2, 0, 1).div(127.5).sub(1.0)


def _clip_pixels(item: TrainItem) -> torch.Tensor:
    try:
        frames = read_frames(item.record.path, list(item.record.clip.indices))
    except ClipError as err:
        raise DatasetError(f"cannot read clip {item.record.path}: {err}") from err
    fitted = {}  # a looped clip repeats frames: fit each source frame once
    for index, frame in zip(item.record.clip.indices, frames, strict=True):
        if index not in fitted:
            fitted[index] = _fit(Image.fromarray(frame), item.bucket)
    array = np.stack([fitted[index] for index in item.record.clip.indices])
    pixels = torch.from_numpy(array).permute(3, 0, 1, 2).div(127.5).sub(1.0)
    return pixels[:, 0] if pixels.shape[1] == 1 else pixels


def _fit(image: Image.Image, bucket: tuple[int, int]) -> np.ndarray:
    """An RGB picture resized to cover `bucket` and centre-cropped to it (`crop_plan`): float32 [H, W, 3], 0-255."""
    target_w, target_h = bucket
    plan = crop_plan(image.width, image.height, bucket)
    image = image.resize(plan.resized, Image.Resampling.BICUBIC)
    image = image.crop((plan.left, plan.top, plan.left + target_w, plan.top + target_h))
    return np.asarray(image, dtype=np.float32)


class ImageDataset(torch.utils.data.Dataset):
    """All datasets of a job as one list of items (images, and clips for video families); batches are formed by the
    bucket sampler.

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

    def bucket_keys(self) -> list[tuple[int, int, int, bool]]:
        """Each item's batch group, (frames, width, height, cached): a batch never mixes frame counts, sizes, or
        cached latents with pixels. Sortable; every image has frames 1, so image datasets keep their order."""
        cached = self.latents.covers if self.latents is not None else (lambda index: False)
        return [(item.frames, *item.bucket, cached(i)) for i, item in enumerate(self.items)]


def scan_datasets(cfgs: list[DatasetConfig], trigger_word: str | None, frame_step: int = 0,
                  family: str = "this model family") -> list[list[ImageRecord]]:
    """Every dataset folder's usable samples (`scan_folder`): it needs the family's facts only, so a trainer reads
    its data before any model loads, and a bad dataset (a clip too short, a folder without samples) is named in
    seconds."""
    return [scan_folder(cfg, trigger_word, frame_step, family) for cfg in cfgs]


def build_dataset(cfgs: list[DatasetConfig], trigger_word: str | None, divisor: int,
                  sizes: bool = False, frame_step: int = 0, family: str = "this model family",
                  scanned: list[list[ImageRecord]] | None = None) -> ImageDataset:
    """`sizes`: samples carry their `image_sizes` (families conditioned on them). `frame_step`: the family's
    (`FamilyFacts.frame_step`); above 0 (a video family) clips are samples too, see `scan_folder`. `family`: its
    title, for the warning about clips an image family leaves out. `scanned`: the folders as `scan_datasets` read
    them already (else they are read now)."""
    if scanned is None:
        scanned = scan_datasets(cfgs, trigger_word, frame_step, family)
    items: list[TrainItem] = []
    for number, (cfg, records) in enumerate(zip(cfgs, scanned, strict=True)):
        items += items_for_dataset(records, cfg, divisor, number)
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
