"""Datasets: captions and trigger words, unreadable images, buckets and the batch sampler."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers import make_image
from PIL import Image
from pydantic import ValidationError

from toolkit.config.schema import DatasetConfig
from toolkit.data.buckets import BucketBatchSampler, bucket_sizes, nearest_bucket, resolutions_for_image
from toolkit.data.captions import apply_trigger
from toolkit.data.dataset import DatasetError, build_dataset, collate, load_pixels, scan_folder


def test_trigger_word_replaces_tag_or_is_prepended():
    assert apply_trigger("a photo of [trigger] at night", "sks", is_reg=False) == "a photo of sks at night"
    assert apply_trigger("a dog", "sks", is_reg=False) == "sks, a dog"
    assert apply_trigger("", "sks", is_reg=False) == "sks"
    assert apply_trigger("a dog", None, is_reg=False) == "a dog"


def test_regularisation_captions_never_get_the_trigger():
    assert apply_trigger("a dog", "sks", is_reg=True) == "a dog"
    assert apply_trigger("[trigger], a dog", "sks", is_reg=True) == "a dog"


def test_captions_come_from_sidecars_or_the_default(tmp_path):
    make_image(tmp_path / "a.png", (32, 32), caption="a  red\nthing")
    make_image(tmp_path / "b.jpg", (32, 32))
    (tmp_path / "notes.md").write_text("not an image")
    records = scan_folder(DatasetConfig(folder_path=str(tmp_path), default_caption="fallback"), "sks")
    assert [(r.path.name, r.caption) for r in records] == [("a.png", "sks, a red thing"), ("b.jpg", "sks, fallback")]


def test_corrupt_image_is_skipped_and_named(tmp_path, caplog):
    make_image(tmp_path / "good.png", (32, 32))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    truncated = make_image(tmp_path / "cut.png", (64, 64)).read_bytes()
    (tmp_path / "cut.png").write_bytes(truncated[: len(truncated) // 2])
    noisy = Image.effect_noise((256, 256), 64).convert("RGB")  # incompressible, so half the file is half the image
    noisy.save(tmp_path / "half.jpg", quality=95)
    data = (tmp_path / "half.jpg").read_bytes()
    (tmp_path / "half.jpg").write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="difftune"):
        records = scan_folder(DatasetConfig(folder_path=str(tmp_path)), None)
    assert [r.path.name for r in records] == ["good.png"]
    for name in ("broken.png", "cut.png", "half.jpg"):
        assert str(tmp_path / name) in caplog.text


def test_folder_without_usable_images_fails_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=f"{tmp_path / 'empty'} has no usable image"):
        scan_folder(DatasetConfig(folder_path=str(tmp_path / "empty")), None)
    with pytest.raises(DatasetError, match="dataset folder not found"):
        scan_folder(DatasetConfig(folder_path=str(tmp_path / "missing")), None)


def test_exif_rotation_decides_the_aspect_ratio(tmp_path):
    from PIL import Image

    image = Image.new("RGB", (96, 48))
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    image.save(tmp_path / "rotated.jpg", exif=exif)
    (record,) = scan_folder(DatasetConfig(folder_path=str(tmp_path)), None)
    assert (record.width, record.height) == (48, 96)


def test_bucket_sides_are_multiples_of_the_divisor_and_fit_the_area():
    for width, height in bucket_sizes(512, 64):
        assert width % 64 == 0 and height % 64 == 0 and width * height <= 512 * 512
    assert (512, 512) in bucket_sizes(512, 64)
    assert nearest_bucket(1024, 1024, bucket_sizes(512, 64)) == (512, 512)
    # the same buckets kohya uses at 512: 3:2 lands in 640x384 (closer in log aspect than 576x448)
    assert nearest_bucket(1536, 1024, bucket_sizes(512, 64)) == (640, 384)


def test_images_train_at_each_size_they_can_fill():
    assert resolutions_for_image(600, 600, [512, 768]) == [512]
    assert resolutions_for_image(1024, 1024, [512, 768]) == [512, 768]
    assert resolutions_for_image(100, 100, [512, 768]) == [512]


def test_three_aspect_ratios_give_three_buckets_and_no_batch_mixes_them(tmp_path):
    for i in range(5):
        make_image(tmp_path / f"square_{i}.png", (128, 128))
        make_image(tmp_path / f"wide_{i}.png", (192, 96))
        make_image(tmp_path / f"tall_{i}.png", (96, 192))
    dataset = build_dataset([DatasetConfig(folder_path=str(tmp_path), resolution=[128])], None, divisor=16)
    buckets = {item.record.path.name.split("_")[0]: set() for item in dataset.items}
    for item in dataset.items:
        buckets[item.record.path.name.split("_")[0]].add(item.bucket)
    assert all(len(b) == 1 for b in buckets.values())
    assert len({next(iter(b)) for b in buckets.values()}) == 3

    sampler = BucketBatchSampler(dataset.bucket_keys(), per_batch=2, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 9  # ceil(5 / 2) per bucket
    for batch in batches:
        assert len({dataset.items[i].bucket for i in batch}) == 1
        pixels = collate([dataset[i] for i in batch])["pixels"]
        width, height = dataset.items[batch[0]].bucket
        assert pixels.shape[-2:] == (height, width)
    assert sorted(i for batch in batches for i in batch) == list(range(len(dataset)))


def test_data_order_is_a_function_of_seed_and_epoch():
    keys = [(64, 64)] * 6 + [(96, 32)] * 5
    first = BucketBatchSampler(keys, per_batch=2, seed=3)
    second = BucketBatchSampler(keys, per_batch=2, seed=3)
    assert first.batches_for_epoch(0) == second.batches_for_epoch(0)
    assert first.batches_for_epoch(0) != first.batches_for_epoch(1)
    assert first.batches_for_epoch(0) != BucketBatchSampler(keys, per_batch=2, seed=4).batches_for_epoch(0)
    first.set_epoch(1)
    assert list(first) == second.batches_for_epoch(1)


def test_pixels_cover_the_bucket_in_range(tmp_path):
    make_image(tmp_path / "wide.png", (300, 100), color=(255, 0, 0))
    (item,) = build_dataset([DatasetConfig(folder_path=str(tmp_path), resolution=[64])], None, divisor=16).items
    pixels = load_pixels(item)
    assert pixels.shape == (3, item.bucket[1], item.bucket[0])
    assert pixels.min() >= -1 and pixels.max() <= 1
    assert pixels[0].mean() > 0.9 and pixels[1].mean() < -0.9


def test_num_repeats_and_several_datasets(tmp_path):
    make_image(tmp_path / "a" / "x.png", (64, 64))
    make_image(tmp_path / "b" / "y.png", (64, 64), caption="[trigger] dog")
    dataset = build_dataset(
        [DatasetConfig(folder_path=str(tmp_path / "a"), num_repeats=3, resolution=[64]),
         DatasetConfig(folder_path=str(tmp_path / "b"), is_reg=True, resolution=[64])],
        "sks", divisor=16,
    )
    assert [item.record.caption for item in dataset.items] == ["sks", "sks", "sks", "dog"]


def test_a_mask_folder_that_is_the_image_folder_is_refused(tmp_path):
    make_image(tmp_path / "data" / "a.png", (32, 32))
    for mask_path in (str(tmp_path / "data"), str(tmp_path / "data") + "/", str(tmp_path / "data" / ".." / "data")):
        with pytest.raises(ValidationError, match="mask_path: the image folder itself.*a folder of their own"):
            DatasetConfig(folder_path=str(tmp_path / "data"), mask_path=mask_path)
    assert DatasetConfig(folder_path=str(tmp_path / "data"), mask_path=str(tmp_path / "masks")).mask_path


def noisy_image(path, size, seed):
    """A picture whose every pixel differs (a crop or flip off by one pixel changes its values)."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def augmented_dataset(folder, **keys):
    return build_dataset([DatasetConfig(folder_path=str(folder), resolution=[64], random_crop=True, flip_x=True,
                                        flip_y=True, **keys)], None, divisor=16, seed=3)


def test_kept_decoded_images_give_the_same_pixels_for_every_draw_and_are_not_read_again(tmp_path):
    """A decoded image kept in memory gives, for every drawn crop and flip, the pixels the file gives (bit for bit),
    and the file is not read for it again; the values are PIL's resize and crop."""
    import numpy as np
    import torch

    from toolkit.data.dataset import DecodedImages, crop_plan

    noisy_image(tmp_path / "wide.png", (150, 90), 0)
    noisy_image(tmp_path / "tall.png", (70, 130), 1)
    dataset = augmented_dataset(tmp_path)
    kept = DecodedImages(budget=1 << 30)
    expected = {}
    for index, item in enumerate(dataset.items):
        for epoch in range(6):
            variant = dataset.variant(index, epoch)
            fresh = load_pixels(item, variant)
            with Image.open(item.record.path) as opened:
                picture = opened.convert("RGB").resize(crop_plan(*opened.size, item.bucket).resized,
                                                       Image.Resampling.BICUBIC)
            box = (variant.left, variant.top, variant.left + item.bucket[0], variant.top + item.bucket[1])
            fitted = np.asarray(picture.crop(box), dtype=np.float32)
            by_pil = torch.from_numpy(fitted).div_(127.5).sub_(1.0).permute(2, 0, 1)
            dims = [d for d, flip in ((-1, variant.flip_x), (-2, variant.flip_y)) if flip]
            assert torch.equal(fresh, by_pil.flip(dims) if dims else by_pil)
            expected[(index, epoch)] = (variant, fresh)
            assert torch.equal(load_pixels(item, variant, kept), fresh)
    assert len({v for v, _ in expected.values()}) > 4  # the draws did vary
    assert len(kept.pictures) == 2 and kept.used == sum(p.nbytes for p, _ in kept.pictures.values())
    for item in dataset.items:
        item.record.path.rename(item.record.path.with_suffix(".gone"))
    for (index, _), (variant, fresh) in expected.items():
        pixels = load_pixels(dataset.items[index], variant, kept)
        assert torch.equal(pixels, fresh)
        pixels.add_(1.0)  # a sample's pixels are its own: the kept picture is unchanged
    assert torch.equal(load_pixels(dataset.items[0], expected[(0, 0)][0], kept), expected[(0, 0)][1])
    assert all(not picture.flags.writeable for picture, _ in kept.pictures.values())
    assert np.asarray(kept.pictures[next(iter(kept.pictures))][0]).dtype == np.uint8


def test_decoded_images_keep_the_first_that_fit_and_none_in_loader_workers(tmp_path, monkeypatch):
    import torch

    from toolkit.config.sections import TrainConfig
    from toolkit.data.dataset import DecodedImages

    for i in range(3):
        noisy_image(tmp_path / f"{i}.png", (64, 64), i)
    dataset = augmented_dataset(tmp_path)
    one = 64 * 64 * 3  # an image resized to cover a 64 x 64 bucket, uint8
    dataset.decoded = DecodedImages(budget=2 * one)
    for index in range(3):
        dataset[index]
    assert [path for path, _ in dataset.decoded.pictures] == [str(item.record.path) for item in dataset.items[:2]]
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())  # as inside a loader worker
    dataset.decoded = DecodedImages(budget=1 << 30)
    assert dataset[0]["pixels"].shape == (3, 64, 64) and dataset.decoded.pictures == {}
    # the budget comes from train.decoded_images_gib; 0 keeps nothing
    assert TrainConfig(steps=1).decoded_images_gib == 1.0
    with pytest.raises(ValidationError, match="decoded_images_gib"):
        TrainConfig(steps=1, decoded_images_gib=-1)


def test_a_picture_smaller_than_its_plan_is_cropped_as_pil_crops_it_and_kept_stores_pickle_empty(tmp_path):
    """An image replaced by a smaller one after the scan: black beyond its edge, as PIL's crop gives (a shape the
    batch can stack); a worker's copy of the store holds no pictures."""
    import pickle

    import torch

    from toolkit.data.dataset import DecodedImages, Variant

    noisy_image(tmp_path / "a.png", (128, 128), 0)
    (item,) = build_dataset([DatasetConfig(folder_path=str(tmp_path), resolution=[64])], None, divisor=16).items
    noisy_image(tmp_path / "a.png", (64, 40), 1)  # after the scan: covers 64 x 64 as 102 x 64
    variant = Variant(left=40, top=0)  # a crop drawn for the old size, past the new picture's right edge
    kept = DecodedImages(budget=1 << 30)
    pixels = load_pixels(item, variant, kept)
    with Image.open(item.record.path) as opened:
        cover = opened.convert("RGB").resize((102, 64), Image.Resampling.BICUBIC)
    by_pil = torch.from_numpy(np.asarray(cover.crop((40, 0, 104, 64)), dtype=np.float32)).div_(127.5).sub_(1.0)
    assert pixels.shape == (3, 64, 64) and torch.equal(pixels, by_pil.permute(2, 0, 1))
    assert (pixels[:, :, 62:] == -1).all()
    copy = pickle.loads(pickle.dumps(kept))
    assert kept.pictures and copy.pictures == {} and copy.used == 0 and copy.budget == kept.budget


def test_a_batch_of_mixed_shapes_or_missing_fields_is_refused_naming_the_field():
    import torch

    def sample(index: int, pixels: torch.Tensor | None) -> dict:
        found = {"caption": "c", "index": index, "variant": None}
        return found if pixels is None else found | {"pixels": pixels}

    assert collate([sample(0, torch.zeros(3, 8, 8)), sample(1, torch.ones(3, 8, 8))])["pixels"].shape == (2, 3, 8, 8)
    with pytest.raises(ValueError, match=r"mixes pixels shapes \[\(3, 8, 8\), \(3, 8, 16\)\]"):
        collate([sample(0, torch.zeros(3, 8, 8)), sample(1, torch.zeros(3, 8, 16))])
    with pytest.raises(ValueError, match="1 of a batch's 2 samples lack pixels"):
        collate([sample(0, torch.zeros(3, 8, 8)), sample(1, None)])
