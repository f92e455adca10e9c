"""Datasets of video clips (video families, `frame_step` > 0): clips and images as samples, the frames a clip's dataset
chooses, pixels as [3, F, H, W] cropped like images, buckets by frame count, latent cache keys by frame selection,
image families leaving clips out, and the preflight check. Clips are generated here: frame k is gray level 10 k."""

from __future__ import annotations

import hashlib
import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import make_image, write_gif, write_mp4
from PIL import Image

from toolkit.config.preflight import path_problems
from toolkit.config.sections import DatasetConfig
from toolkit.data.buckets import BucketBatchSampler
from toolkit.data.dataset import DatasetError, build_dataset, collate, crop_plan, image_sizes, load_pixels
from toolkit.data.latent_cache import LatentCache, file_digest
from toolkit.errors import UserError
from toolkit.models.base import LatentDist
from toolkit.models.config import FamilyFacts

LEVEL = 10  # frame k of a generated clip is gray level LEVEL * k
WAN_LIKE = 4  # frame_step of a video family taking 4k + 1 frames
SOLO = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True, wait_for_everyone=lambda: None)


def clip_folder(folder, *, mp4_frames: int = 12, copies: int = 1):
    """An mp4 clip (12 frames at 10 fps), a GIF (10 frames at 10 fps), a PNG image, each with a caption; all 32x32."""
    for copy in range(copies):
        name = "clip" if copy == 0 else f"clip{copy}"
        write_mp4(folder / f"{name}.mp4", frames=mp4_frames, fps=10, level=LEVEL)
        (folder / f"{name}.txt").write_text(f"a clip {copy}")
    write_gif(folder / "anim.gif", frames=10, duration_ms=100, level=LEVEL)
    (folder / "anim.txt").write_text("a gif")
    make_image(folder / "still.png", (32, 32), color=(200, 200, 200), caption="a still")
    return folder


def video_dataset(folder, **options):
    cfg = DatasetConfig(folder_path=str(folder), resolution=[32], **{"num_frames": 5, **options})
    return build_dataset([cfg], None, divisor=16, frame_step=WAN_LIKE)


def by_name(dataset) -> dict:
    return {item.record.path.name: (index, item) for index, item in enumerate(dataset.items)}


def levels(pixels: torch.Tensor) -> list[int]:
    """Which generated frame each frame of [3, F, H, W] pixels in [-1, 1] shows."""
    return [round(float((pixels[:, f] + 1).mul(127.5).mean()) / LEVEL) for f in range(pixels.shape[1])]


def test_a_video_familys_samples_are_clips_and_images_bucketed_by_frame_count(tmp_path):
    dataset = video_dataset(clip_folder(tmp_path))
    items = by_name(dataset)
    assert sorted(items) == ["anim.gif", "clip.mp4", "still.png"]
    assert [items[n][1].record.caption for n in ("clip.mp4", "anim.gif", "still.png")] == ["a clip 0", "a gif",
                                                                                           "a still"]
    # an image is one frame whatever num_frames says; clips give num_frames
    assert {n: item.frames for n, (_, item) in items.items()} == {"clip.mp4": 5, "anim.gif": 5, "still.png": 1}
    keys = dataset.bucket_keys()
    assert keys[items["clip.mp4"][0]] == keys[items["anim.gif"][0]] == (5, 32, 32, False)
    assert keys[items["still.png"][0]] == (1, 32, 32, False)  # the same size, another bucket
    for batch in BucketBatchSampler(keys, per_batch=3, seed=0):
        assert len({dataset.items[i].frames for i in batch}) == 1


def test_a_clips_pixels_are_its_chosen_frames_in_order(tmp_path):
    folder = clip_folder(tmp_path)
    items = by_name(video_dataset(folder))
    for name in ("clip.mp4", "anim.gif"):
        pixels = load_pixels(items[name][1])
        assert pixels.shape == (3, 5, 32, 32) and pixels.dtype == torch.float32
        assert pixels.min() >= -1 and pixels.max() <= 1
        assert levels(pixels) == [0, 1, 2, 3, 4], name
    assert load_pixels(items["still.png"][1]).shape == (3, 32, 32)
    # at half the clips' 10 fps: every other frame
    items = by_name(video_dataset(folder, fps=5))
    for name in ("clip.mp4", "anim.gif"):
        assert items[name][1].record.clip.indices == (0, 2, 4, 6, 8)
        assert levels(load_pixels(items[name][1])) == [0, 2, 4, 6, 8], name


def test_clip_frames_are_resized_and_cropped_exactly_as_images(tmp_path):
    """A 64x32 GIF whose first frame is a PNG's picture: in the 48x16 bucket (resized to 48x24, 4 rows cropped off
    the top) its first frame equals the image's pixels, and its size facts are the same six numbers."""
    picture = Image.new("RGB", (64, 32), (0, 0, 255))
    picture.paste((255, 0, 0), (0, 0, 64, 6))
    picture.paste((0, 255, 0), (0, 24, 64, 32))
    picture.paste((255, 255, 255), (20, 0, 28, 32))
    frames = [picture] + [Image.new("RGB", (64, 32), (LEVEL * k,) * 3) for k in range(1, 6)]
    frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    picture.save(tmp_path / "image.png")
    items = by_name(video_dataset(tmp_path))
    clip, image = items["clip.gif"][1], items["image.png"][1]
    assert clip.bucket == image.bucket == (48, 16)
    assert crop_plan(64, 32, clip.bucket).top == 4
    clip_pixels, image_pixels = load_pixels(clip), load_pixels(image)
    assert clip_pixels.shape == (3, 5, 16, 48)
    assert torch.equal(clip_pixels[:, 0], image_pixels)
    assert torch.equal(image_sizes(clip), image_sizes(image))
    assert image_sizes(clip).tolist() == [32, 64, 4, 0, 16, 48]


def test_a_corrupt_clip_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    clip_folder(tmp_path)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    with caplog.at_level(logging.WARNING, logger="difftune"):
        dataset = video_dataset(tmp_path)
    assert "broken.mp4" not in by_name(dataset)
    assert sorted(by_name(dataset)) == ["anim.gif", "clip.mp4", "still.png"]
    assert f"skipping unreadable clip {broken}" in caplog.text


def test_a_clip_that_fails_to_decode_when_loaded_is_a_dataset_error_naming_it(tmp_path):
    items = by_name(video_dataset(clip_folder(tmp_path)))
    write_mp4(tmp_path / "clip.mp4", frames=3, level=LEVEL)  # replaced after the scan by a shorter clip
    with pytest.raises(DatasetError, match=f"cannot read clip {tmp_path / 'clip.mp4'}: .*has no frame 3"):
        load_pixels(items["clip.mp4"][1])
    (tmp_path / "clip.mp4").write_bytes(b"garbage" * 40)
    with pytest.raises(DatasetError, match=f"cannot read clip {tmp_path / 'clip.mp4'}"):
        load_pixels(items["clip.mp4"][1])


def test_a_too_short_clip_is_refused_naming_it_or_looped(tmp_path):
    clip_folder(tmp_path, mp4_frames=3)
    with pytest.raises(UserError, match=f"{tmp_path / 'clip.mp4'}: 3 frames at 10 fps give 3 frames, but num_frames "
                                        "is 5") as err:
        video_dataset(tmp_path)
    assert isinstance(err.value, DatasetError)
    assert "anim.gif" not in str(err.value)  # 10 frames: long enough
    write_mp4(tmp_path / "more.mp4", frames=2, level=LEVEL)
    with pytest.raises(DatasetError) as err:  # every short clip named at once
        video_dataset(tmp_path)
    assert "clip.mp4" in str(err.value) and "more.mp4" in str(err.value)
    items = by_name(video_dataset(tmp_path, short_clips="loop"))
    assert items["clip.mp4"][1].record.clip.indices == (0, 1, 2, 0, 1)
    assert levels(load_pixels(items["clip.mp4"][1])) == [0, 1, 2, 0, 1]


def test_latent_cache_keys_follow_a_clips_frames_and_keep_images_keys(tmp_path):
    clip_folder(tmp_path)
    identity = "encoder-identity"

    def keys(**options):
        dataset = video_dataset(tmp_path, **options)
        cache = LatentCache(dataset, {0: tmp_path / "cache"}, {0: True}, identity)
        return {name: cache.keys[index] for name, (index, _) in by_name(dataset).items()}

    five, nine, half_rate = keys(), keys(num_frames=9), keys(fps=5)
    assert five["clip.mp4"] != nine["clip.mp4"] != half_rate["clip.mp4"] != five["clip.mp4"]
    assert five["anim.gif"] != nine["anim.gif"] != half_rate["anim.gif"] != five["anim.gif"]
    # an image's key is the one it always had, whatever the frame settings
    image = hashlib.sha256(f"{file_digest(tmp_path / 'still.png')}|32x32-center|{identity}".encode()).hexdigest()[:32]
    assert five["still.png"] == nine["still.png"] == half_rate["still.png"] == image
    image_family = build_dataset([DatasetConfig(folder_path=str(tmp_path), resolution=[32])], None, divisor=16)
    assert LatentCache(image_family, {0: tmp_path / "cache"}, {0: True}, identity).keys == {0: image}


def test_a_clip_is_encoded_as_one_video_and_served_from_the_cache(tmp_path):
    dataset = video_dataset(clip_folder(tmp_path))
    encoded = []

    def encode_latent_dist(pixels):
        encoded.append(tuple(pixels.shape))
        return LatentDist(pixels[:, :2] * 0.5, None)

    cache = LatentCache(dataset, {0: tmp_path / "cache"}, {0: True}, "identity")
    cache.build(SimpleNamespace(encode_latent_dist=encode_latent_dist), SOLO)
    assert sorted(encoded) == [(1, 3, 5, 32, 32), (1, 3, 5, 32, 32), (1, 3, 32, 32)]
    dataset.latents = cache
    items = by_name(dataset)
    index = items["clip.mp4"][0]
    assert torch.equal(dataset[index]["latent_mean"], load_pixels(items["clip.mp4"][1])[:2] * 0.5)
    assert dataset.bucket_keys()[index] == (5, 32, 32, True)


def test_a_batch_of_clips_collates_to_b_c_f_h_w(tmp_path):
    dataset = video_dataset(clip_folder(tmp_path, copies=2))
    sampler = BucketBatchSampler(dataset.bucket_keys(), per_batch=4, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    shapes = sorted(tuple(batch["pixels"].shape) for batch in loader)
    assert shapes == [(1, 3, 32, 32), (3, 3, 5, 32, 32)]


def test_an_image_family_warns_once_about_clips_and_trains_on_its_images(tmp_path, caplog):
    clip_folder(tmp_path)
    write_gif(tmp_path / "moving.webp", frames=4, duration_ms=100, level=LEVEL)  # animated WebP: its first frame
    with caplog.at_level(logging.WARNING, logger="difftune"):
        dataset = build_dataset([DatasetConfig(folder_path=str(tmp_path), resolution=[32])], None, divisor=16,
                                family="Tiny Image")
    assert sorted(by_name(dataset)) == ["moving.webp", "still.png"]
    assert all(item.record.clip is None and item.frames == 1 for item in dataset.items)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"2 clip file(s) in {tmp_path} ignored (e.g. anim.gif): Tiny Image trains on images"]
    webp = by_name(dataset)["moving.webp"][1]
    assert load_pixels(webp).shape == (3, 32, 32)
    assert dataset.bucket_keys()[by_name(dataset)["moving.webp"][0]] == (1, 32, 32, False)
    # the same WebP in a video family is a clip
    assert by_name(video_dataset(tmp_path, num_frames=1 + WAN_LIKE, short_clips="loop"))["moving.webp"][1].frames == 5


def test_preflight_takes_a_video_familys_clip_only_folder_and_names_clips(tmp_path):
    write_mp4(tmp_path / "clips" / "a.mp4", frames=2)
    (tmp_path / "empty").mkdir()

    def problems(frame_step: int) -> list[str]:
        model = SimpleNamespace(facts=FamilyFacts(title="Tiny Family", frame_step=frame_step))
        datasets = [DatasetConfig(folder_path=str(tmp_path / name)) for name in ("clips", "empty")]
        return path_problems(SimpleNamespace(datasets=datasets, model=model))

    images = "(.png, .jpg, .jpeg, .webp)"
    assert problems(WAN_LIKE) == [
        f"datasets[1].folder_path: no images or clips {images[:-1]}, .mp4, .webm, .mov, .gif) in {tmp_path / 'empty'}"]
    assert problems(0) == [
        (f"datasets[0].folder_path: no images {images} in {tmp_path / 'clips'} (its 1 clip file(s) are not used: "
         "Tiny Family trains on images)"),
        f"datasets[1].folder_path: no images {images} in {tmp_path / 'empty'}"]


def test_clips_at_one_frame_are_said_to_train_without_motion(tmp_path, caplog):
    """A video family's clips with the default `num_frames: 1` train as their first frame: said once, naming the
    key to set."""
    folder = clip_folder(tmp_path)
    with caplog.at_level(logging.WARNING, logger="difftune"):
        dataset = video_dataset(folder, num_frames=1)
    assert {item.frames for item in dataset.items} == {1}
    warnings = [r.getMessage() for r in caplog.records if "num_frames is 1" in r.getMessage()]
    assert len(warnings) == 1 and "2 clip(s)" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="difftune"):
        video_dataset(folder)
    assert not [r for r in caplog.records if "num_frames is 1" in r.getMessage()]
