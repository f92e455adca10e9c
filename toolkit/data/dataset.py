"""Dataset folders with sidecar captions, bucketed by aspect ratio (and, for video families, frame count): images, and
for video families clips too (toolkit/data/clips.py reads them).

Augmentation (`datasets[].flip_x`, `flip_y`, `random_crop`): each sample's `Variant` (its crop offset in the resized
image and its flips) is drawn from a generator keyed by (train seed, epoch, item index) only (`draw_variant`), so it is
the same on any process count, in any DataLoader worker and after a resume. The batch sampler hands the epoch to the
dataset inside each index (`buckets.EpochIndex`). A picture is resized to cover its bucket, cropped at the variant's
offset, then mirrored; every frame of a clip alike.

Loss masks (`datasets[].mask_path`): a grayscale image per sample, same base name, read as 0-1 (8-bit, 16-bit, 32-bit
or float, each by its own range; a colour image as its luminance: `mask_values`) and raised to
`mask_min_value`, goes through the same resize, crop and mirror as its picture (`load_mask`); the objective brings it
to the latent grid. In a job where any dataset has masks, every sample carries one (all ones where there is none).

Reference images (`datasets[].control_path`, image-editing families): each target's references, one per folder (slot),
found by base name when the folder is scanned (a target without its reference is refused by name, unless
`control_optional`). A reference is sized by the family's rule (`ReferenceFacts.size`): `target`, resized to cover
the target's bucket and cropped at the same fraction of its slack as the target (a reference of the target's size:
the same pixels); `budget`, a pixel area (the family's, else the target's) at the reference's own aspect ratio, from
the target's crop window where the two have one aspect ratio (else the whole picture); then mirrored as the target is. Samples carry
them as `reference_pixels_<slot>` ([3, h, w]), or cached as `reference_mean_<slot>`.

With a latent cache, a variant without an entry yet comes as pixels with the key to store it under (`latent_key`);
the training loop encodes those rows, never a loader worker (`LatentCache.complete`)."""

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
from toolkit.data.media import clip_files, images_by_name, sample_extensions, sample_files
from toolkit.errors import UserError
from toolkit.models.config import ReferenceFacts
from toolkit.train.seeding import seeded_generator

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
class Reference:
    """A reference image of a sample (`datasets[].control_path`): its file and its size as displayed."""

    path: Path
    width: int
    height: int


@dataclass(frozen=True)
class ImageRecord:
    """One usable sample file: its size as displayed (EXIF orientation applied; a clip's frame size) and its final
    caption. `clip` is set for a clip (video families only): which of its frames the sample takes; an image has
    none and is one frame, whatever `num_frames` says. `mask`: its mask file, where its dataset has masks."""

    path: Path
    width: int
    height: int
    caption: str
    clip: ClipFrames | None = None
    mask: Path | None = None  # its loss mask file, in a dataset with `mask_path`
    #: its reference images, in slot order (`control_path`); fewer than the folders where `control_optional` let a
    #: missing one go
    references: tuple[Reference, ...] = ()

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
    masks = _mask_folder(cfg)
    pairs = ReferencePairs(cfg)
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
        mask = None if masks is None else masks.get(path.stem)
        records.append(ImageRecord(path, width, height, apply_trigger(caption, trigger_word, cfg.is_reg), clip, mask,
                                   pairs.of(path)))
    if short:
        raise DatasetError("\n".join(short))
    pairs.check()
    if masks is not None:
        _warn_unmasked(records, cfg)
    clips = [r for r in records if r.clip is not None and r.clip.info.frames > 1]
    if clips and cfg.num_frames == 1:
        log.warning("%s: %d clip(s) train as one frame each (e.g. %s): datasets[].num_frames is 1; set it (e.g. 33) "
                    "to train on their motion", folder, len(clips), clips[0].path.name)
    if not records:
        kinds = "image or clip" if video else "image"
        raise DatasetError(f"dataset folder {folder} has no usable {kinds} ({', '.join(sample_extensions(video))})")
    return records


def _mask_folder(cfg: DatasetConfig) -> dict[str, Path] | None:
    """The dataset's mask files by base name, None without `mask_path`."""
    if cfg.mask_path is None:
        return None
    folder = Path(cfg.mask_path)
    if not folder.is_dir():
        raise DatasetError(f"mask folder not found: {folder}")
    return images_by_name(folder)


class ReferencePairs:
    """The reference images of one dataset's targets (`control_path`: one folder per slot), found by base name. The
    targets without one (missing, or unreadable) are collected while the folder is scanned and named together by
    `check`: refused, or with `control_optional` told in one warning and trained without them."""

    def __init__(self, cfg: DatasetConfig, key: str = "control_path"):
        self.cfg, self.key = cfg, key
        self.folders = [Path(folder) for folder in cfg.reference_folders]
        for folder in self.folders:
            if not folder.is_dir():
                raise DatasetError(f"reference folder not found: {folder} ({key})")
        self.files = [images_by_name(folder) for folder in self.folders]
        #: (target, slot folder, why) of each reference that is not there
        self.missing: list[tuple[Path, Path, str]] = []

    def of(self, target: Path) -> tuple[Reference, ...]:
        found = []
        for folder, files in zip(self.folders, self.files):
            path = files.get(target.stem)
            if path is None:
                self.missing.append((target, folder, "missing"))
                continue
            try:
                width, height = read_image_size(path)
            except Exception as err:  # PIL raises many types for broken files
                self.missing.append((target, folder, f"unreadable {path.name}: {err}"))
                continue
            found.append(Reference(path, width, height))
        return tuple(found)

    def check(self) -> None:
        if not self.missing:
            return
        listed = "\n".join(f"  {target.name}: {why} in {folder}" for target, folder, why in self.missing)
        if not getattr(self.cfg, "control_optional", False):
            raise DatasetError(f"{len(self.missing)} target(s) of {self.cfg.folder_path} have no reference image "
                               f"({self.key}; the same base name, any image extension):\n{listed}\nadd them, or set "
                               "control_optional: true to train those targets without one")
        log.warning("%d target(s) of %s train without a reference image (control_optional):\n%s", len(self.missing),
                    self.cfg.folder_path, listed)


def _warn_unmasked(records: list[ImageRecord], cfg: DatasetConfig) -> None:
    """One warning for the samples of a dataset with masks that have no mask file: they train everywhere."""
    unmasked = [r for r in records if r.mask is None]
    if unmasked:
        log.warning("%d sample(s) of %s have no mask in %s (e.g. %s): they train everywhere", len(unmasked),
                    cfg.folder_path, cfg.mask_path, unmasked[0].path.name)


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


@dataclass(frozen=True)
class SampleOptions:
    """What a dataset varies per sample and whether it has loss masks: its `flip_x`, `flip_y`, `random_crop`,
    `mask_path` (set or not) and `mask_min_value`."""

    flip_x: bool = False
    flip_y: bool = False
    random_crop: bool = False
    masked: bool = False
    mask_min_value: float = 0.0

    @classmethod
    def of(cls, cfg: DatasetConfig) -> SampleOptions:
        return cls(cfg.flip_x, cfg.flip_y, cfg.random_crop, cfg.mask_path is not None, cfg.mask_min_value)

    @property
    def varies(self) -> bool:
        """Whether its samples differ between epochs (flips or crops are drawn)."""
        return self.flip_x or self.flip_y or self.random_crop


#: a dataset without augmentation or masks
PLAIN = SampleOptions()


@dataclass(frozen=True)
class Variant:
    """How a sample is made from its file this epoch: the crop's left and top in the resized image, then the mirrors
    (left-right, top-bottom) of the cropped picture."""

    left: int
    top: int
    flip_x: bool = False
    flip_y: bool = False


def centre_variant(item: TrainItem) -> Variant:
    """The centre crop, unflipped: what every sample is without augmentation."""
    plan = crop_plan(item.record.width, item.record.height, item.bucket)
    return Variant(plan.left, plan.top)


def draw_variant(item: TrainItem, options: SampleOptions, seed: int, epoch: int, index: int) -> Variant:
    """The item's variant for an epoch, a pure function of (seed, epoch, item index): never of the process, the
    micro-batch or the worker. Four uniforms are drawn whatever is switched on (flip x, flip y, crop x, crop y), so
    turning one option on leaves the others' draws as they were. The crop's offset is uniform over the resized
    image's slack beyond the bucket (none where the aspects match)."""
    centre = centre_variant(item)
    if not options.varies:
        return centre
    flip_x, flip_y, crop_x, crop_y = torch.rand(4, generator=seeded_generator(seed, "augment", epoch, index)).tolist()
    left, top = centre.left, centre.top
    if options.random_crop:
        plan = crop_plan(item.record.width, item.record.height, item.bucket)
        slack_x, slack_y = plan.resized[0] - item.bucket[0], plan.resized[1] - item.bucket[1]
        left, top = min(int(crop_x * (slack_x + 1)), slack_x), min(int(crop_y * (slack_y + 1)), slack_y)
    return Variant(left, top, options.flip_x and flip_x < 0.5, options.flip_y and flip_y < 0.5)


def reference_sizes(item: TrainItem, rules: ReferenceFacts) -> tuple[tuple[int, int], ...]:
    """The (width, height) each of the item's references is trained at, by the family's rule: the target's bucket
    (`target`), or a pixel area (`rules.area`, else the bucket's) at the aspect ratio of the reference's window
    (`reference_window`), sides rounded to `rules.multiple` (`budget`). The same for every variant of the item."""
    if rules.size == "target":
        return tuple(item.bucket for _ in item.record.references)
    area = rules.area or item.bucket[0] * item.bucket[1]
    sizes = []
    for reference in item.record.references:
        left, top, right, bottom = reference_window(item, reference, None)
        sizes.append(budget_size(area, (right - left) / (bottom - top), rules.multiple))
    return tuple(sizes)


def budget_size(area: int, aspect: float, multiple: int) -> tuple[int, int]:
    """Sides of about `area` pixels at `aspect` (width / height), each rounded to `multiple` (at least one), as the
    Qwen-Image-Edit pipelines' `calculate_dimensions` makes them."""
    width = (area * aspect) ** 0.5
    height = width / aspect
    return (max(multiple, round(width / multiple) * multiple), max(multiple, round(height / multiple) * multiple))


#: how far apart two aspect ratios may be for a reference to be cut with its target's crop window
SAME_ASPECT = 0.01


def reference_window(item: TrainItem, reference: Reference, variant: Variant | None) -> tuple[float, ...]:
    """The part of a reference (left, top, right, bottom, in its own pixels) that a `budget`-sized reference shows:
    where it has the target's aspect ratio, the window the target's crop takes of the target (at the same fractions),
    so that the pair keeps showing the same region; otherwise the whole reference."""
    width, height = item.record.width, item.record.height
    if abs((reference.width / reference.height) / (width / height) - 1) > SAME_ASPECT:
        return 0.0, 0.0, float(reference.width), float(reference.height)
    plan = crop_plan(width, height, item.bucket)
    variant = variant or centre_variant(item)
    x0, y0 = variant.left / plan.resized[0], variant.top / plan.resized[1]
    x1, y1 = min(1.0, x0 + item.bucket[0] / plan.resized[0]), min(1.0, y0 + item.bucket[1] / plan.resized[1])
    return x0 * reference.width, y0 * reference.height, x1 * reference.width, y1 * reference.height


def same_slack_fraction(item: TrainItem, reference: Reference, variant: Variant | None) -> Variant:
    """A `target`-sized reference's crop in its covering resize: at the same fraction of its slack as the target's
    crop (the centre at the centre; a reference of the target's size: the target's own offsets), mirrored alike."""
    variant = variant or centre_variant(item)
    target = crop_plan(item.record.width, item.record.height, item.bucket)
    own = crop_plan(reference.width, reference.height, item.bucket)

    def offset(at: int, slack: int, own_slack: int, own_centre: int) -> int:
        return own_centre if slack == 0 else min(own_slack, round(at / slack * own_slack))

    left = offset(variant.left, target.resized[0] - item.bucket[0], own.resized[0] - item.bucket[0], own.left)
    top = offset(variant.top, target.resized[1] - item.bucket[1], own.resized[1] - item.bucket[1], own.top)
    return Variant(left, top, variant.flip_x, variant.flip_y)


def reference_picture(item: TrainItem, reference: Reference) -> Image.Image:
    """A reference image file, upright (its EXIF orientation applied), in RGB."""
    try:
        with Image.open(reference.path) as opened:
            ImageOps.exif_transpose(opened, in_place=True)
            return opened.convert("RGB")
    except Exception as err:
        raise DatasetError(f"cannot read reference image {reference.path} (of {item.record.path}): {err}") from err


def reference_views(item: TrainItem, variant: Variant | None, rules: ReferenceFacts) -> list[Image.Image]:
    """The item's reference pictures as its variant shows them, at their own resolution: the part the trained
    reference is made from (`reference_window`; a `target`-sized reference's covering crop mapped back), mirrored
    alike. What a text encoder that reads the references is given (it sizes them its own way)."""
    views = []
    for reference in item.record.references:
        picture = reference_picture(item, reference)
        if rules.size == "target":
            own = same_slack_fraction(item, reference, variant)
            plan = crop_plan(reference.width, reference.height, item.bucket)
            scale = plan.resized[0] / reference.width
            box = (own.left / scale, own.top / scale, (own.left + item.bucket[0]) / scale,
                   (own.top + item.bucket[1]) / scale)
        else:
            box = reference_window(item, reference, variant)
        left, top, right, bottom = (round(value) for value in box)
        view = picture.crop((left, top, max(right, left + 1), max(bottom, top + 1)))
        if variant is not None and variant.flip_x:
            view = view.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if variant is not None and variant.flip_y:
            view = view.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        views.append(view)
    return views


def load_references(item: TrainItem, variant: Variant | None, rules: ReferenceFacts) -> list[torch.Tensor]:
    """The item's reference images as its variant shows them (`reference_sizes`, cropped with the target and
    mirrored alike), float [3, h, w] in [-1, 1] each, in slot order."""
    pictures = []
    for reference, size in zip(item.record.references, reference_sizes(item, rules)):
        image = reference_picture(item, reference)
        if rules.size == "target":
            own = same_slack_fraction(item, reference, variant)
            pixels = _fit(image, item.bucket, own)
        else:
            window = reference_window(item, reference, variant)
            pixels = np.asarray(image.resize(size, Image.Resampling.BICUBIC, box=window)).astype(np.float32)
        pictures.append(_mirrored(_signed(torch.from_numpy(pixels)).permute(2, 0, 1), variant))
    return pictures


def image_sizes(item: TrainItem, variant: Variant | None = None) -> torch.Tensor:
    """The item's size facts as SDXL conditions on them (its `add_time_ids`): original height and width, the
    crop's top and left, target height and width. int64, shape [6].

    The crop's top and left say how far the picture the model sees was cut from the resized image's top and left
    edges (the centre crop without a variant). A mirror swaps the edges: mirrored left-right (`flip_x`), the
    picture's left edge is the crop's right one, `resized width - bucket width - left` from the resized image's
    (mirrored) left edge; likewise top-bottom (`flip_y`), `resized height - bucket height - top`. So a picture and
    its mirror report the same cut from the edges they show, as kohya's sd-scripts do."""
    variant = variant or centre_variant(item)
    target_w, target_h = item.bucket
    left, top = variant.left, variant.top
    if variant.flip_x or variant.flip_y:
        resized_w, resized_h = crop_plan(item.record.width, item.record.height, item.bucket).resized
        left = resized_w - target_w - left if variant.flip_x else left
        top = resized_h - target_h - top if variant.flip_y else top
    return torch.tensor([item.record.height, item.record.width, top, left, target_h, target_w])


class DecodedImages:
    """Images decoded and resized to cover their bucket, kept in memory for the run: an image is then read and
    decoded once, not once per epoch (on few cores, decoding in the training loop is most of what a step waits for
    its data). Up to `budget` bytes, first come first kept (a shuffled epoch over more images than fit would evict
    every entry before it is asked for again); crops and mirrors are made from the kept picture at every draw, so a
    sample is the same whether its picture was kept or decoded."""

    def __init__(self, budget: int):
        self.budget = budget
        self.used = 0
        #: (path, bucket) -> (the picture resized to cover the bucket, uint8 [H, W, 3]; the decoded size)
        self.pictures: dict[tuple[str, tuple[int, int]], tuple[np.ndarray, tuple[int, int]]] = {}

    def __getstate__(self) -> dict:
        """A copy for a loader worker (which keeps none) goes without the pictures."""
        return {**self.__dict__, "pictures": {}, "used": 0}

    @staticmethod
    def key(item: TrainItem) -> tuple[str, tuple[int, int]]:
        return str(item.record.path), item.bucket

    def get(self, item: TrainItem) -> tuple[np.ndarray, tuple[int, int]] | None:
        return self.pictures.get(self.key(item))

    def keep(self, item: TrainItem, covering: np.ndarray, size: tuple[int, int]) -> None:
        if self.used + covering.nbytes <= self.budget:
            covering.flags.writeable = False  # every draw copies its crop out of it
            self.pictures[self.key(item)] = (covering, size)
            self.used += covering.nbytes


def load_pixels(item: TrainItem, variant: Variant | None = None, kept: DecodedImages | None = None) -> torch.Tensor:
    """The image resized to cover its bucket (`crop_plan`), cropped to it where the variant says (the centre
    without one) and mirrored as it says, float in [-1, 1]: [3, H, W] for an image (and any one-frame sample),
    [3, F, H, W] for a clip of F frames (every frame cropped and mirrored alike; only this clip is decoded, only up
    to its last chosen frame). `kept`: decoded images held in memory, asked first and given this one."""
    if item.record.clip is not None:
        return _clip_pixels(item, variant)
    found = kept.get(item) if kept is not None else None
    if found is None:
        found = _covered_image(item)
        if kept is not None:
            kept.keep(item, *found)
    pixels = _cropped(*found, item.bucket, variant)
    return _mirrored(_signed(torch.from_numpy(pixels)).permute(2, 0, 1), variant)


def _covered_image(item: TrainItem) -> tuple[np.ndarray, tuple[int, int]]:
    """The image file decoded (turned upright by its EXIF orientation, RGB) and resized to cover its bucket (bicubic):
    uint8 [H, W, 3], and its decoded (width, height)."""
    try:
        with Image.open(item.record.path) as opened:
            ImageOps.exif_transpose(opened, in_place=True)  # in place: no copy of an upright picture
            image = opened.convert("RGB")
    except Exception as err:
        raise DatasetError(f"cannot read image {item.record.path}: {err}") from err
    return _covering(image, item.bucket, Image.Resampling.BICUBIC), image.size


def _clip_pixels(item: TrainItem, variant: Variant | None) -> torch.Tensor:
    try:
        frames = read_frames(item.record.path, list(item.record.clip.indices))
    except ClipError as err:
        raise DatasetError(f"cannot read clip {item.record.path}: {err}") from err
    fitted = {}  # a looped clip repeats frames: fit each source frame once
    for index, frame in zip(item.record.clip.indices, frames, strict=True):
        if index not in fitted:
            fitted[index] = _fit(Image.fromarray(frame), item.bucket, variant)
    array = np.stack([fitted[index] for index in item.record.clip.indices])
    pixels = _mirrored(_signed(torch.from_numpy(array)).permute(3, 0, 1, 2), variant)
    return pixels[:, 0] if pixels.shape[1] == 1 else pixels


def _signed(pixels: torch.Tensor) -> torch.Tensor:
    """0-255 pixel values (a float tensor of its own) as -1 to 1, in place: no second and third copy of the picture."""
    return pixels.div_(127.5).sub_(1.0)


def mask_values(picture: Image.Image) -> np.ndarray:
    """A mask picture as float32 [H, W] in 0-1, each mode scaled by its own range: 16-bit grayscale (`I;16`,
    `I;16B`, ...) by 65535; 32-bit integer (`I`, as older Pillows open 16-bit PNGs) by 65535 where no value exceeds
    it (a 16-bit mask), else by 2**31 - 1 (the mode's maximum), negative values 0; floating point (`F`) as it is,
    clipped to 0-1; 8-bit grayscale (`L`), and palette (`P`) and 1-bit (`1`) masks through their gray levels, by 255.
    A colour mask (RGB, RGBA, LA, CMYK, ...) is read as its luminance (Pillow's `convert("L")`, ITU-R 601-2 luma;
    any alpha channel is ignored), by 255."""
    mode = picture.mode
    if mode.startswith("I;16"):
        return np.asarray(picture).astype(np.float32) / np.float32(65535)
    if mode == "I":
        values = np.asarray(picture).astype(np.float64)
        top = 65535 if values.size == 0 or values.max() <= 65535 else 2**31 - 1
        return np.clip(values / top, 0.0, 1.0).astype(np.float32)
    if mode == "F":
        return np.clip(np.asarray(picture, dtype=np.float32), 0.0, 1.0)
    return np.asarray(picture.convert("L"), dtype=np.float32) / np.float32(255)


def load_mask(item: TrainItem, variant: Variant | None = None, min_value: float = 0.0) -> torch.Tensor:
    """The item's loss mask, made as its pixels are (`load_pixels`): the mask file read as 0-1 by its mode's range
    (`mask_values`: 8-bit 0-255, 16-bit 0-65535, float as is; colour as luminance), raised to at least
    `min_value`, stretched over its image (a mask of another size still covers it), resized to cover the bucket,
    cropped and mirrored as the variant says: float32 [1, H, W]. Resized bilinearly (bicubic would overshoot a mask's
    edges). All ones for an item without a mask file; a clip has one mask for every frame."""
    width, height = item.bucket
    if item.record.mask is None:
        return torch.ones(1, height, width)
    try:
        with Image.open(item.record.mask) as opened:
            values = mask_values(ImageOps.exif_transpose(opened))
    except Exception as err:
        raise DatasetError(f"cannot read mask {item.record.mask}: {err}") from err
    plane = Image.fromarray(np.maximum(values, np.float32(min_value)))  # a float32 plane: mode F
    plane = plane.resize((item.record.width, item.record.height), Image.Resampling.BILINEAR)
    return _mirrored(torch.from_numpy(_fit(plane, item.bucket, variant, Image.Resampling.BILINEAR))[None], variant)


def _fit(picture: Image.Image, bucket: tuple[int, int], variant: Variant | None = None,
         resample: Image.Resampling = Image.Resampling.BICUBIC) -> np.ndarray:
    """A picture resized to cover `bucket` (`crop_plan`) and cropped to it at the variant's offset (the centre
    without one): float32, [H, W, 3] 0-255 for an RGB picture, [H, W] for a mask plane."""
    return _cropped(_covering(picture, bucket, resample), picture.size, bucket, variant)


def _covering(picture: Image.Image, bucket: tuple[int, int], resample: Image.Resampling) -> np.ndarray:
    """A picture resized to cover `bucket` (`crop_plan`), as an array in its own type."""
    return np.asarray(picture.resize(crop_plan(picture.width, picture.height, bucket).resized, resample))


def _cropped(covering: np.ndarray, size: tuple[int, int], bucket: tuple[int, int],
             variant: Variant | None) -> np.ndarray:
    """A picture of `size` (width, height) resized to cover `bucket` (`_covering`), cropped to it at the variant's
    offset (the centre without one), float32: black beyond its edge, as PIL's crop (a picture smaller than its plan,
    where the file changed since it was scanned)."""
    target_w, target_h = bucket
    plan = crop_plan(*size, bucket)
    left, top = (plan.left, plan.top) if variant is None else (variant.left, variant.top)
    region = covering[top:top + target_h, left:left + target_w]
    pixels = np.zeros((target_h, target_w) + covering.shape[2:], dtype=np.float32)
    pixels[:region.shape[0], :region.shape[1]] = region
    return pixels


def _mirrored(tensor: torch.Tensor, variant: Variant | None) -> torch.Tensor:
    """A picture [..., H, W] mirrored as the variant says (after its crop)."""
    dims = [] if variant is None else [dim for dim, flip in ((-1, variant.flip_x), (-2, variant.flip_y)) if flip]
    return tensor.flip(dims) if dims else tensor


class ImageDataset(torch.utils.data.Dataset):
    """All datasets of a job as one list of items (images, and clips for video families); batches are formed by the
    bucket sampler.

    An index may carry its epoch (`buckets.EpochIndex`; a plain int is epoch 0): each sample is its `Variant` for
    that epoch (`draw_variant`, from each dataset's `SampleOptions` and the train seed) and says which
    (`variant`). With a latent cache attached, covered items come as the cached latent distribution of that variant
    instead of pixels (no image is decoded); a variant without an entry yet comes as pixels with `latent_key`, the
    key to store its entry under, for the training loop to encode (`LatentCache.complete`). A batch never mixes
    cached and uncached datasets (see `bucket_keys`). With `sizes` (families conditioned on them, SDXL), every sample
    carries its `image_sizes`: from the cache entry when cached (what its latent was made from), else from its
    variant; other families' batches do without. Where any dataset has masks, every sample carries a `mask`
    [1, H, W]: in pixels with pixels, on the latent grid with a cached latent (all ones where there is no mask).
    """

    def __init__(self, items: list[TrainItem], sizes: bool = False, options: dict[int, SampleOptions] | None = None,
                 seed: int = 0, references: ReferenceFacts | None = None):
        """`options`: each dataset's (by its number; `PLAIN` for the rest); `seed`: the train seed, of the draws;
        `references`: the family's rule for reference images (image-editing families)."""
        self.items = items
        self.references = references
        self.sizes = sizes
        self.options = options or {}
        self.seed = seed
        self.masked = any(o.masked for o in self.options.values())
        self._latents = None
        #: decoded images the training process keeps (`DecodedImages`); loader workers keep none
        self.decoded: DecodedImages | None = None
        #: each item's centre variant, planned once: the variant of every draw of a dataset that does not vary
        self.centres: dict[int, Variant] = {}
        #: the samples that are the same at every draw, made once: a latent kept in memory of an item whose dataset
        #: draws no variants (each draw is then a cache lookup of a dozen calls, between the model's kernels)
        self.fixed_samples: dict[int, dict] = {}

    @property
    def latents(self):
        """The latent cache attached (`LatentCache`), or None: the samples come as pixels."""
        return self._latents

    @latents.setter
    def latents(self, cache) -> None:
        self._latents = cache
        self.fixed_samples = {}  # made from the cache they came from

    def __len__(self) -> int:
        return len(self.items)

    def options_for(self, dataset: int) -> SampleOptions:
        return self.options.get(dataset, PLAIN)

    def variant(self, index: int, epoch: int) -> Variant:
        item = self.items[index]
        options = self.options_for(item.dataset)
        if not options.varies:  # `draw_variant`'s answer, without planning the crop again
            centre = self.centres.get(index)
            if centre is None:
                centre = self.centres[index] = centre_variant(item)
            return centre
        return draw_variant(item, options, self.seed, epoch, index)

    def mask(self, item: TrainItem, variant: Variant) -> torch.Tensor:
        """The item's loss mask for a variant, in pixels (`load_mask`, with its dataset's `mask_min_value`)."""
        return load_mask(item, variant, self.options_for(item.dataset).mask_min_value)

    def __getitem__(self, index: int) -> dict:
        """The sample at `index`. A file that became unreadable since the scan (deleted, damaged, a clip that now
        decodes short) does not stop the run: the sample is replaced by the next item of its batch group (the same
        frame count, bucket and caching, in the dataset's order, wrapping round) that reads, and says which file it
        stands in for (`replaced`), for the trainer to warn and count. Nothing in the group reads: the error."""
        number, epoch = int(index), getattr(index, "epoch", 0)
        try:
            return self.sample_at(number, epoch)
        except DatasetError as error:
            return self.stand_in(number, epoch, error)

    def stand_in(self, number: int, epoch: int, error: DatasetError) -> dict:
        group = self.group_of(number)
        start = group.index(number)
        for other in group[start + 1:] + group[:start]:
            try:
                sample = dict(self.sample_at(other, epoch))
            except DatasetError:
                continue
            sample["replaced"] = [(str(self.items[number].record.path), str(error))]
            return sample
        raise error

    def group_of(self, number: int) -> list[int]:
        """The items that may stand in for item `number`: its batch group (`bucket_keys`), in order."""
        keys = self.bucket_keys()
        return [i for i, key in enumerate(keys) if key == keys[number]]

    def sample_at(self, number: int, epoch: int) -> dict:
        fixed = self.fixed_samples.get(number)
        if fixed is not None:
            return fixed  # never changed: collate makes the batch anew
        item = self.items[number]
        variant = self.variant(number, epoch)
        sample = {"caption": item.record.caption, "index": number, "variant": variant}
        cached = None
        if self.latents is not None and self.latents.covers(number):
            cached = self.latents.get(number, variant)
            if cached is None:
                sample["latent_key"] = self.latents.variant_key(number, variant)
        if cached is not None:
            sample.update(self.latents.sample_fields(cached))
            if not self.options_for(item.dataset).varies and not self.latents.to_disk[item.dataset]:
                self.fixed_samples[number] = sample
            return sample
        # kept only where the training process reads its own batches: each loader worker would hold its own copy,
        # and workers decode ahead of the loop anyway
        kept = self.decoded if torch.utils.data.get_worker_info() is None else None
        sample["pixels"] = load_pixels(item, variant, kept)
        if self.sizes:
            sample["image_sizes"] = image_sizes(item, variant)
        if self.masked:
            sample["mask"] = self.mask(item, variant)
        if item.record.references:
            for slot, pixels in enumerate(load_references(item, variant, self.references)):
                sample[f"reference_pixels_{slot}"] = pixels
        return sample

    def bucket_keys(self) -> list[tuple]:
        """Each item's batch group, (frames, width, height, cached), and for an image-editing family its references'
        sizes (`reference_sizes`: none for a sample without references): a batch never mixes frame counts, sizes,
        cached latents with pixels, or reference counts and sizes. Sortable; every image has frames 1, so image
        datasets keep their order."""
        cached = self.latents.covers if self.latents is not None else (lambda index: False)
        keys = [(item.frames, *item.bucket, cached(i)) for i, item in enumerate(self.items)]
        if self.references is None:
            return keys
        return [(*key, reference_sizes(item, self.references)) for key, item in zip(keys, self.items)]


def scan_datasets(cfgs: list[DatasetConfig], trigger_word: str | None, frame_step: int = 0,
                  family: str = "this model family") -> list[list[ImageRecord]]:
    """Every dataset folder's usable samples (`scan_folder`): it needs the family's facts only, so a trainer reads
    its data before any model loads, and a bad dataset (a clip too short, a folder without samples) is named in
    seconds."""
    return [scan_folder(cfg, trigger_word, frame_step, family) for cfg in cfgs]


def build_dataset(cfgs: list[DatasetConfig], trigger_word: str | None, divisor: int,
                  sizes: bool = False, frame_step: int = 0, family: str = "this model family",
                  scanned: list[list[ImageRecord]] | None = None, seed: int = 0,
                  references: ReferenceFacts | None = None) -> ImageDataset:
    """`sizes`: samples carry their `image_sizes` (families conditioned on them). `frame_step`: the family's
    (`FamilyFacts.frame_step`); above 0 (a video family) clips are samples too, see `scan_folder`. `family`: its
    title, for the warning about clips an image family leaves out. `scanned`: the folders as `scan_datasets` read
    them already (else they are read now). `seed`: the train seed, which the flips and crops are drawn from.
    `references`: the family's rule for reference images (`FamilyFacts.references`)."""
    if scanned is None:
        scanned = scan_datasets(cfgs, trigger_word, frame_step, family)
    items: list[TrainItem] = []
    for number, (cfg, records) in enumerate(zip(cfgs, scanned, strict=True)):
        items += items_for_dataset(records, cfg, divisor, number)
    return ImageDataset(items, sizes, {number: SampleOptions.of(cfg) for number, cfg in enumerate(cfgs)}, seed,
                        references)


#: the fields of a pending row (a variant without a cache entry yet) that wait in `batch["pending"]` until its
#: latent is made (`LatentCache.complete`)
PENDING_FIELDS = ("pixels", "mask")


def collate(samples: list[dict]) -> dict:
    """Stack a batch; every sample must have the same fields and tensor shapes (one bucket), except pending rows
    (samples with a `latent_key`): their pixels and masks go to `batch["pending"]` with their rows and keys, and the
    other rows' latents are stacked without them until the training loop merges them back in batch order."""
    # indices stay a list: a tensor would be sent to the device with the batch and read back from it
    batch = {"captions": [s["caption"] for s in samples], "indices": [s["index"] for s in samples],
             "variants": [s["variant"] for s in samples]}
    replaced = [entry for s in samples for entry in s.get("replaced", ())]
    if replaced:  # files that became unreadable, and why (`ImageDataset.stand_in`)
        batch["replaced"] = replaced
    rows = [row for row, s in enumerate(samples) if "latent_key" in s]
    references = reference_fields(samples)
    if rows:
        waiting = [samples[row] for row in rows]
        batch["pending"] = {"rows": rows, "keys": [s["latent_key"] for s in waiting],
                            **_stacked(waiting, PENDING_FIELDS + references["reference_pixels"])}
    ready = [s for s in samples if "latent_key" not in s]
    batch.update(_stacked(ready, ("pixels", "latent_mean", "latent_std", "mask", *references["reference_pixels"],
                                  *references["reference_mean"])))
    batch.update(_stacked(samples, ("image_sizes",)))
    return batch


def reference_fields(samples: list[dict]) -> dict[str, tuple[str, ...]]:
    """The names of the samples' (or a batch's) reference fields, in slot order: `reference_pixels`
    (`reference_pixels_0`, ...) and `reference_mean` (cached latents)."""
    def numbered(stem: str) -> tuple[str, ...]:
        count = 0
        while any(f"{stem}_{count}" in sample for sample in samples):
            count += 1
        return tuple(f"{stem}_{slot}" for slot in range(count))

    return {"reference_pixels": numbered("reference_pixels"), "reference_mean": numbered("reference_mean")}


def batch_of(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of one shape stacked along a new batch dimension. One row gains the dimension as a view, not a copy: a
    cached latent or text embedding is then the cache's own tensor, so nothing in training may write into a batch's
    tensors (it does not: `test_training_leaves_in_memory_cache_entries_as_they_were`)."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)


def _stacked(samples: list[dict], fields: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Each of `fields` that the samples have, stacked (`batch_of`); every sample must have it, in one shape."""
    stacked = {}
    for field in fields:
        present = [s[field] for s in samples if field in s]
        if not present:
            continue
        if len(present) != len(samples):
            raise ValueError(f"{len(samples) - len(present)} of a batch's {len(samples)} samples lack {field}; "
                             "batches must come from one bucket")
        try:
            stacked[field] = batch_of(present)  # which checks the shapes
        except RuntimeError:
            shapes = sorted({tuple(t.shape) for t in present})
            if len(shapes) == 1:
                raise  # not a mix of shapes
            raise ValueError(f"a batch mixes {field} shapes {shapes}; batches must come from one bucket") from None
    return stacked
