"""Augmentation (flips and random crops drawn per (seed, epoch, sample)) and loss masks: the draws on any process count
and after a resume, the latent cache's variants, and the masked loss on the tiny SD 1.5 model."""

from __future__ import annotations

import hashlib
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file

from toolkit.config.preflight import path_problems
from toolkit.config.sections import DatasetConfig, NetworkConfig, ObjectiveSection, TrainConfig
from toolkit.data.buckets import EpochIndex
from toolkit.data.dataset import (
    DatasetError,
    ImageRecord,
    SampleOptions,
    TrainItem,
    Variant,
    build_dataset,
    centre_variant,
    collate,
    crop_plan,
    draw_variant,
    image_sizes,
    load_mask,
    load_pixels,
    mask_values,
)
from toolkit.data.latent_cache import LatentCache, file_digest
from toolkit.data.training_data import TrainingData
from toolkit.device import ModulePlacement
from toolkit.models.registry import model_config
from toolkit.models.sd15.adapter import SD15Adapter
from toolkit.network.lora import add_lora
from toolkit.train.losses import mask_weights, per_sample_loss
from toolkit.train.objective import DiffusionObjective, StepDraw
from toolkit.train.plan import Position

CPU = torch.device("cpu")
SOLO = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True, wait_for_everyone=lambda: None,
                       device=CPU)


def load_adapter() -> SD15Adapter:
    return SD15Adapter.load(model_config(arch="sd15", name_or_path="tiny"), CPU, torch.float32)


@pytest.fixture(scope="module")
def adapter(tiny_sd15):
    return load_adapter()


def noise_image(path, size: tuple[int, int], seed: int = 0):
    """An RGB image of noise: every flip and crop of it is another picture."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def half_mask(path, size: tuple[int, int], bright: str = "right"):
    """A grayscale mask, white over one half (left or right) and black over the other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    values = np.zeros((size[1], size[0]), dtype=np.uint8)
    if bright == "right":
        values[:, size[0] // 2:] = 255
    else:
        values[:, : size[0] // 2] = 255
    Image.fromarray(values).save(path, lossless=True)  # lossless: also as WebP, the halves stay exactly 0 and 255
    return path


def epoch_where(dataset, index: int, wanted) -> tuple[int, Variant]:
    """The first epoch whose draw for item `index` satisfies `wanted`, and that variant."""
    for epoch in range(200):
        variant = dataset.variant(index, epoch)
        if wanted(variant):
            return epoch, variant
    raise AssertionError("no epoch draws the wanted variant")


# ---- draws ---------------------------------------------------------------------------------------------------


def wide_and_tall(folder) -> None:
    """3 wide and 3 tall noise images: at resolution 64 they are resized to 80x53 / 53x80 and cut to 80x48 / 48x80."""
    for i in range(3):
        noise_image(folder / f"wide{i}.png", (96, 64), seed=i)
        noise_image(folder / f"tall{i}.png", (64, 96), seed=10 + i)


def variants_seen(cfg: DatasetConfig, adapter, processes: int, workers: int = 0, skip: int = 0) -> dict:
    """(epoch, index) -> variant of every sample the trainer's data part yields on each of `processes` processes
    (sharded as accelerate shards, `RunBatchOrder`), epochs 0 and 1 from micro-batch `skip`; each sample's pixels are
    checked to be its variant's."""
    train = TrainConfig(steps=4, batch_size=2, seed=3, num_workers=workers, persistent_workers=True)
    data = TrainingData([cfg], None, train, adapter, ModulePlacement(CPU, low_vram=False))
    data.build_caches(SOLO)
    seen = {}
    for rank in range(processes):
        data.dataloader = data.make_dataloader(pin_memory=False, num_processes=processes, rank=rank)
        for epoch in (0, 1):
            for _, batch in data.one_epoch(CPU, Position(0, epoch, skip)):
                for index, variant, pixels in zip(batch["indices"], batch["variants"], batch["pixels"], strict=True):
                    seen[(epoch, index)] = variant
                    assert torch.equal(pixels, load_pixels(data.dataset.items[index], variant))
    # train.decoded_images_gib (1 GiB unset): the training process keeps what it decoded, a loader worker keeps none
    assert bool(data.dataset.decoded.pictures) == (workers == 0)
    return seen


def test_draws_are_the_same_on_one_and_two_processes_in_a_worker_and_after_a_resume(tmp_path, adapter):
    wide_and_tall(tmp_path / "data")
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], flip_x=True, flip_y=True,
                        random_crop=True)
    one = variants_seen(cfg, adapter, 1)
    dataset = build_dataset([cfg], None, adapter.divisor, seed=3)
    assert one == {(epoch, i): dataset.variant(i, epoch) for epoch in (0, 1) for i in range(6)}
    assert variants_seen(cfg, adapter, 2) == one
    assert variants_seen(cfg, adapter, 1, workers=1) == one  # a persistent worker's dataset copy gets each epoch
    resumed = variants_seen(cfg, adapter, 1, skip=2)  # 2 of each epoch's 4 micro-batches
    assert 4 <= len(resumed) < 12 and resumed == {key: one[key] for key in resumed}
    # the draws do vary: by epoch, and over the crop's slack and both mirrors
    assert any(one[(0, i)] != one[(1, i)] for i in range(6))
    centres = {i: centre_variant(dataset.items[i]) for i in range(6)}
    assert any((v.left, v.top) != (centres[i].left, centres[i].top) for (_, i), v in one.items())
    assert {v.flip_x for v in one.values()} == {v.flip_y for v in one.values()} == {False, True}


def test_one_pass_over_the_run_has_a_worker_load_the_next_epoch_while_this_one_trains(tmp_path, adapter):
    """With a loader worker, the run's batches come in one pass over its epochs: the loader hands each epoch's first
    batch to its worker while the loop is still taking the epoch before (two ahead, as every other batch), not once
    the loop has asked for it, and the pass gives every epoch's batches in their order, each sample with its epoch's
    draw. Counted where the loader hands indices out (in the training process), without a clock."""
    wide_and_tall(tmp_path / "data")
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], flip_x=True)
    train = TrainConfig(steps=4, batch_size=2, seed=3, num_workers=1)
    data = TrainingData([cfg], None, train, adapter, ModulePlacement(CPU, low_vram=False))
    data.build_caches(SOLO)
    data.dataloader = data.make_dataloader(pin_memory=False)
    run_order, taken, handed_out_after = data.dataloader.batch_sampler, [], []
    pass_over = run_order.pass_over

    def counted_pass(*args):
        for batch in pass_over(*args):
            handed_out_after.append(len(taken))  # batches the loop had taken when this one went to the worker
            yield batch

    run_order.pass_over = counted_pass
    batches = data.run_batches(CPU, Position(), epochs=3)
    for epoch in range(3):
        for _, batch in data.epoch_batches(batches, Position(0, epoch, 0)):
            taken.append(batch["indices"])
            assert batch["variants"] == [data.dataset.variant(i, epoch) for i in batch["indices"]]
    assert taken == [batch for epoch in range(3) for batch in data.batch_sampler.batches_for_epoch(epoch)]
    # 2 batches ahead from the start (the loader's prefetch per worker), then one more as each comes in: batch k
    # goes out while the loop takes batch k - 2, an epoch's first too (with a pass per epoch it would wait for the
    # last batch of the epoch before)
    assert handed_out_after == [0, 0, *range(len(taken) - 2)] and len(taken) == 3 * run_order.per_epoch
    assert next(batches, None) is None  # the pass ends with its last epoch


def test_draws_depend_only_on_seed_epoch_and_index_and_each_option_draws_alone(tmp_path):
    wide_and_tall(tmp_path)
    items = build_dataset([DatasetConfig(folder_path=str(tmp_path), resolution=[64])], None, 16).items
    item = next(item for item in items if item.record.path.name == "wide0.png")
    plan, centre = crop_plan(96, 64, item.bucket), centre_variant(item)
    assert item.bucket == (80, 48) and plan.resized == (80, 53) and (centre.left, centre.top) == (0, 2)
    flips = SampleOptions(flip_x=True)
    both = SampleOptions(flip_x=True, flip_y=True, random_crop=True)
    draws = [draw_variant(item, both, 7, epoch, 0) for epoch in range(64)]
    assert draws == [draw_variant(item, both, 7, epoch, 0) for epoch in range(64)]
    assert {v.top for v in draws} == set(range(6)) and {v.left for v in draws} == {0}  # the whole slack, no more
    # switching flip_y and the crop on leaves flip_x's draws as they were
    assert [draw_variant(item, flips, 7, e, 0).flip_x for e in range(64)] == [v.flip_x for v in draws]
    assert draws != [draw_variant(item, both, 8, epoch, 0) for epoch in range(64)]
    assert draw_variant(item, SampleOptions(), 7, 3, 0) == centre


def test_every_frame_of_a_clip_takes_the_same_crop_and_flips(tmp_path):
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, (96, 64, 3), dtype=np.uint8)) for _ in range(5)]
    frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    cfg = DatasetConfig(folder_path=str(tmp_path), resolution=[64], num_frames=5)
    (item,) = build_dataset([cfg], None, 16, frame_step=4).items
    assert item.frames == 5 and item.bucket == (48, 80)  # resized to 53x80: 5 columns of slack
    high, low = load_pixels(item, Variant(4, 0)), load_pixels(item, Variant(1, 0))
    assert high.shape == (3, 5, 80, 48) and torch.equal(high[..., :-3], low[..., 3:])  # each frame cut 3 further
    assert torch.equal(load_pixels(item, Variant(1, 0, flip_x=True, flip_y=True)), low.flip(-1).flip(-2))
    assert load_mask(item, Variant(1, 0, flip_x=True)).shape == (1, 80, 48)  # one mask for all the frames


# ---- the latent cache ----------------------------------------------------------------------------------------


def cached_dataset(cfg: DatasetConfig, adapter, tmp_path, seed: int = 3):
    """A dataset with its latent cache built (centre variants) and attached."""
    dataset = build_dataset([cfg], None, adapter.divisor, seed=seed)
    cache = LatentCache(dataset, {0: tmp_path / "cache"}, {0: cfg.cache_latents_to_disk},
                        adapter.encoder_identity("image"))
    cache.build(adapter, SOLO)
    dataset.latents = cache
    return dataset, cache


def latent_of_picture(picture: Image.Image, folder, adapter):
    """The adapter's latent distribution of a picture written as a PNG, read as a dataset sample (bucket-sized, so
    neither resized nor cropped)."""
    folder.mkdir(parents=True)
    picture.save(folder / "expected.png")
    (item,) = build_dataset([DatasetConfig(folder_path=str(folder), resolution=[64])], None, adapter.divisor).items
    assert item.bucket == picture.size
    return adapter.encode_latent_dist(load_pixels(item).unsqueeze(0))


@pytest.mark.parametrize("kind", ["flip", "crop"])
def test_a_cached_flip_or_crop_equals_the_latent_of_the_flipped_or_cropped_image(tmp_path, adapter, kind):
    source = noise_image(tmp_path / "data" / "wide.png", (96, 64))
    options = {"flip_x": True} if kind == "flip" else {"random_crop": True}
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], cache_latents_to_disk=True, **options)
    dataset, cache = cached_dataset(cfg, adapter, tmp_path)
    centre = centre_variant(dataset.items[0])
    epoch, variant = epoch_where(dataset, 0, lambda v: v != centre)
    sample = dataset[EpochIndex(0, epoch)]
    assert "pixels" in sample and sample["latent_key"] == cache.key(dataset.items[0], variant)
    batch = cache.complete(collate([sample]), adapter)
    entry = cache.get(0, variant)
    assert cache.entry_path(dataset.items[0], sample["latent_key"]).is_file()
    assert torch.equal(batch["latent_mean"][0], entry.dist.mean) and torch.equal(batch["latent_std"][0], entry.dist.std)
    # the picture as a user would make it by hand: resized as the crop plan says, cut at the drawn place, mirrored
    plan = crop_plan(96, 64, dataset.items[0].bucket)
    picture = Image.open(source).convert("RGB").resize(plan.resized, Image.Resampling.BICUBIC)
    picture = picture.crop((variant.left, variant.top, variant.left + 80, variant.top + 48))
    if variant.flip_x:
        picture = ImageOps.mirror(picture)
    expected = latent_of_picture(picture, tmp_path / "by_hand", adapter)
    assert torch.equal(entry.dist.mean, expected.mean[0]) and torch.equal(entry.dist.std, expected.std[0])
    assert not torch.equal(entry.dist.mean, cache.get(0).dist.mean)
    assert torch.equal(dataset[EpochIndex(0, epoch)]["latent_mean"], entry.dist.mean)  # found from now on
    assert load_file(str(cache.path(0)))["image_sizes"].tolist() == [64, 96, centre.top, centre.left, 48, 80]
    # SDXL's crop conditioning: the cut from the edges the picture shows (a mirror counts from the other edge)
    left = plan.resized[0] - 80 - variant.left if variant.flip_x else variant.left
    assert entry.sizes.tolist() == [64, 96, variant.top, left, 48, 80]


def test_a_mirrored_crop_is_reported_from_the_edges_the_picture_shows(tmp_path):
    """Kohya's rule: flipped left-right, the crop's left is the resized width less the crop's right edge; flipped
    top-bottom, likewise its top. The reported cut is where the mirrored picture sits in the mirrored resized image."""
    wide, tall = noise_image(tmp_path / "wide.png", (120, 64), seed=1), noise_image(tmp_path / "tall.png", (64, 120))
    for path, bucket, resized, cut in ((wide, (80, 48), (90, 48), (3, 0)), (tall, (48, 80), (48, 90), (0, 2))):
        width, height = Image.open(path).size
        item = TrainItem(ImageRecord(path, width, height, ""), bucket)
        assert crop_plan(width, height, bucket).resized == resized
        slack = (resized[0] - bucket[0], resized[1] - bucket[1])
        mirrored = Image.open(path).convert("RGB").resize(resized, Image.Resampling.BICUBIC)
        mirrored = ImageOps.flip(ImageOps.mirror(mirrored))
        for flip_x in (False, True):
            for flip_y in (False, True):
                variant = Variant(*cut, flip_x, flip_y)
                left = slack[0] - cut[0] if flip_x else cut[0]
                top = slack[1] - cut[1] if flip_y else cut[1]
                assert image_sizes(item, variant).tolist() == [height, width, top, left, bucket[1], bucket[0]]
                if flip_x and flip_y:  # the picture is the mirrored image's crop at the reported place
                    by_hand = np.asarray(mirrored.crop((left, top, left + bucket[0], top + bucket[1])), np.float32)
                    pixels = load_pixels(item, variant).permute(1, 2, 0).add(1.0).mul(127.5)
                    assert torch.allclose(pixels, torch.from_numpy(by_hand), atol=1e-3)
        centre = centre_variant(item)  # unflipped: as it always was
        assert image_sizes(item).tolist() == [height, width, centre.top, centre.left, bucket[1], bucket[0]]


def test_a_cached_dataset_keeps_every_variant_it_draws_and_batches_merge_them_in_order(tmp_path, adapter,
                                                                                     monkeypatch):
    wide_and_tall(tmp_path / "data")
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], cache_latents=True, flip_x=True,
                        random_crop=True)
    placement = ModulePlacement(CPU, low_vram=False)
    # a persistent worker: its copy of the dataset never sees the entries the loop adds to the in-memory cache
    train = TrainConfig(steps=4, batch_size=3, seed=3, num_workers=1, persistent_workers=True)
    data = TrainingData([cfg], None, train, adapter, placement)
    data.build_caches(SOLO)
    cache = data.dataset.latents
    assert cache.grows and placement.offloaded == []  # the image encoder stays for the variants to come
    centre_keys = set(cache.memory)
    encoded = []
    original = adapter.encode_latent_dist
    monkeypatch.setattr(adapter, "encode_latent_dist", lambda pixels: encoded.append(1) or original(pixels))
    data.dataloader = data.make_dataloader(pin_memory=False)
    drawn, mixed = set(), 0
    for epoch in (0, 1, 2):
        for _, batch in data.one_epoch(CPU, Position(0, epoch, 0)):
            assert "pending" not in batch and "pixels" not in batch and len(batch["latent_mean"]) == 3
            keys = [cache.key(data.dataset.items[i], v) for i, v in zip(batch["indices"], batch["variants"])]
            mixed += len({key in centre_keys for key in keys}) == 2
            for row, (index, variant) in enumerate(zip(batch["indices"], batch["variants"])):
                entry = cache.get(index, variant)
                assert torch.equal(batch["latent_mean"][row], entry.dist.mean)
                assert torch.equal(batch["latent_std"][row], entry.dist.std)
            drawn |= set(keys)
    assert mixed and len(drawn - centre_keys) == len(encoded) > 0  # each new variant encoded once
    assert set(cache.memory) == centre_keys | drawn
    encoded.clear()
    for epoch in (0, 1, 2):  # every variant of these epochs is kept, and found though the worker asks again
        list(data.one_epoch(CPU, Position(0, epoch, 0)))
    assert encoded == []


def test_a_batch_of_cached_and_new_variants_merges_its_rows_in_batch_order(tmp_path, adapter):
    wide_and_tall(tmp_path / "data")
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], cache_latents=True, flip_x=True)
    dataset, cache = cached_dataset(cfg, adapter, tmp_path)
    wides = [i for i, item in enumerate(dataset.items) if item.bucket == (80, 48)]
    flipped = [epoch_where(dataset, i, lambda v: v.flip_x)[0] for i in wides]
    plain = epoch_where(dataset, wides[1], lambda v: not v.flip_x)[0]
    picks = [(wides[0], flipped[0]), (wides[1], plain), (wides[2], flipped[2])]
    batch = collate([dataset[EpochIndex(index, epoch)] for index, epoch in picks])
    assert batch["pending"]["rows"] == [0, 2] and len(batch["latent_mean"]) == 1
    batch = cache.complete(batch, adapter)
    assert "pending" not in batch
    for row, (index, epoch) in enumerate(picks):
        assert torch.equal(batch["latent_mean"][row], cache.get(index, dataset.variant(index, epoch)).dist.mean)


def test_a_deleted_or_damaged_entry_is_encoded_again_from_its_image(tmp_path, adapter):
    """The cache of a dataset without variants emptied or damaged while training: the sample comes as pixels with
    its key (a pending row), `complete` encodes it from its image and writes the entry anew, and the cache notes the
    entry (the trainer warns once and counts it); the re-encoded latent is the one the build made."""
    noise_image(tmp_path / "data" / "img.png", (64, 64))
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], cache_latents_to_disk=True)
    dataset, cache = cached_dataset(cfg, adapter, tmp_path)
    built = cache.get(0).dist.mean.clone()
    for damage in (lambda path: path.unlink(), lambda path: path.write_bytes(b"damaged")):
        damage(cache.path(0))
        sample = dataset[EpochIndex(0, 1)]
        assert "pixels" in sample and sample["latent_key"] == cache.keys[0]
        assert str(cache.path(0)) in cache.damaged
        batch = cache.complete(collate([sample]), adapter)
        assert torch.equal(batch["latent_mean"][0], built) and torch.equal(cache.get(0).dist.mean, built)
        cache.damaged.clear()


def test_a_deleted_entry_of_a_dataset_with_variants_is_encoded_again_when_drawn(tmp_path, adapter):
    noise_image(tmp_path / "data" / "img.png", (64, 64))
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], cache_latents_to_disk=True, flip_x=True)
    dataset, cache = cached_dataset(cfg, adapter, tmp_path)
    written = cache.get(0).dist.mean
    cache.path(0).unlink()
    epoch, _ = epoch_where(dataset, 0, lambda v: not v.flip_x)
    sample = dataset[EpochIndex(0, epoch)]
    assert sample["latent_key"] == cache.keys[0] and "pixels" in sample  # a pending row: the encoder stayed
    batch = cache.complete(collate([sample]), adapter)
    assert cache.path(0).is_file() and torch.equal(batch["latent_mean"][0], written)


def test_datasets_without_flips_crops_or_masks_keep_their_cache_keys(tmp_path):
    path = noise_image(tmp_path / "data" / "img.png", (64, 64))
    half_mask(tmp_path / "masks" / "img.png", (64, 64))

    def cache(**options) -> LatentCache:
        cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], **options)
        return LatentCache(build_dataset([cfg], None, 16), {0: tmp_path / "cache"}, {0: True}, "identity")

    before = hashlib.sha256(f"{file_digest(path)}|64x64-center|identity".encode()).hexdigest()[:32]
    assert cache().keys == {0: before}
    augmenting = cache(flip_x=True, flip_y=True, random_crop=True)
    assert augmenting.keys == {0: before}  # the centre variant, unflipped, is the entry it always was
    item = augmenting.dataset.items[0]
    flips = {augmenting.key(item, Variant(0, 0, flip_x, flip_y)) for flip_x in (False, True)
             for flip_y in (False, True)}
    assert len(flips) == 4 and before in flips
    masked = cache(mask_path=str(tmp_path / "masks"))
    raised = cache(mask_path=str(tmp_path / "masks"), mask_min_value=0.5)
    assert len({before, masked.keys[0], raised.keys[0]}) == 3  # an entry holds its mask: its key says which
    half_mask(tmp_path / "masks" / "img.png", (64, 64), bright="left")
    assert cache(mask_path=str(tmp_path / "masks")).keys[0] != masked.keys[0]  # the mask file's content counts


# ---- masks ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["mse", "mae", "pseudo_huber"])
def test_a_masked_per_sample_loss_is_the_mean_over_the_area_it_trains(loss_type):
    prediction = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    target = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 1, 64, 64)
    mask[0, :, :, :32] = 0  # sample 0 trains its right half; sample 1 nothing
    mask[1] = 0
    weights = mask_weights(mask, prediction)
    assert weights.shape == (2, 1, 8, 8)
    loss = per_sample_loss(prediction, target, loss_type, weights=weights)
    elements = per_sample_loss(prediction[:1, :, :, 4:], target[:1, :, :, 4:], loss_type)
    assert torch.allclose(loss[0], elements[0]) and loss[1] == 0
    loss.sum().backward()
    assert (prediction.grad[0, :, :, :4] == 0).all() and (prediction.grad[1] == 0).all()
    assert (prediction.grad[0, :, :, 4:] != 0).all()
    assert mask_weights(mask, torch.zeros(2, 16, 3, 8, 8)).shape == (2, 1, 1, 8, 8)  # a clip: one mask, every frame


def test_a_mask_of_zeros_over_half_the_image_leaves_that_half_out_of_the_loss_and_the_lora_gradient(tmp_path,
                                                                                                 tiny_sd15):
    adapter = load_adapter()
    params = add_lora(adapter.unet, NetworkConfig(linear=4, linear_alpha=4), adapter.lora_target_modules())
    noise_image(tmp_path / "data" / "img.png", (64, 64))
    half_mask(tmp_path / "masks" / "img.webp", (64, 64), bright="right")  # any image extension
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], mask_path=str(tmp_path / "masks"))
    batch = collate([build_dataset([cfg], None, adapter.divisor)[0]])
    assert batch["mask"].shape == (1, 1, 64, 64) and "latent_mean" not in batch
    seen = {}
    predict, target = adapter.predict, adapter.noise_schedule.target
    adapter.predict = lambda *args, **kwargs: seen.setdefault("prediction", predict(*args, **kwargs))
    adapter.noise_schedule.target = lambda *args: seen.setdefault("target", target(*args))
    objective = DiffusionObjective(ObjectiveSection(), 7, adapter)
    result = objective.loss(batch, adapter.encode_prompts(["a photo"]), StepDraw(0, 0, 0, 0.0))
    prediction, target = seen["prediction"], seen["target"]
    trained = torch.zeros(1, 1, 8, 8)
    trained[..., 4:] = 1.0  # the mask's white half on the 8x8 latent grid
    manual = ((prediction.float() - target.float()) ** 2 * trained).sum() / (trained.sum() * prediction.shape[1])
    assert torch.allclose(result.loss, manual, rtol=1e-6)
    assert not torch.allclose(result.loss, ((prediction - target) ** 2).mean())
    lora = torch.autograd.grad(result.loss, params, retain_graph=True)
    by_hand = torch.autograd.grad(manual, params, retain_graph=True)
    assert any(g.abs().sum() > 0 for g in lora)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-9) for a, b in zip(lora, by_hand, strict=True))
    (towards_prediction,) = torch.autograd.grad(result.loss, prediction)
    assert (towards_prediction[..., :4] == 0).all() and (towards_prediction[..., 4:] != 0).all()


def test_a_mask_follows_its_images_flip_into_the_cache_and_min_value_raises_the_rest(tmp_path, adapter):
    noise_image(tmp_path / "data" / "img.png", (64, 64))
    half_mask(tmp_path / "masks" / "img.png", (64, 64), bright="left")
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], cache_latents_to_disk=True, flip_x=True,
                        mask_path=str(tmp_path / "masks"), mask_min_value=0.25)
    dataset, cache = cached_dataset(cfg, adapter, tmp_path)
    left, right = torch.ones(1, 8, 4), torch.full((1, 8, 4), 0.25)
    assert torch.equal(cache.get(0).mask, torch.cat([left, right], dim=-1))
    assert torch.equal(load_file(str(cache.path(0)))["mask"], cache.get(0).mask)  # the mask travels in the entry
    epoch, variant = epoch_where(dataset, 0, lambda v: v.flip_x)
    pixels_mask = load_mask(dataset.items[0], variant, 0.25)
    assert (pixels_mask[..., 32:] == 1).all() and (pixels_mask[..., :32] == 0.25).all()
    batch = cache.complete(collate([dataset[EpochIndex(0, epoch)]]), adapter)
    flipped = torch.cat([right, left], dim=-1)
    assert torch.equal(cache.get(0, variant).mask, flipped) and torch.equal(batch["mask"][0], flipped)
    assert torch.equal(dataset[EpochIndex(0, epoch)]["mask"], flipped)


def test_a_sample_without_a_mask_file_trains_everywhere_after_one_warning(tmp_path, caplog, adapter):
    for name in ("a", "b", "c"):
        noise_image(tmp_path / "data" / f"{name}.png", (64, 64))
    half_mask(tmp_path / "masks" / "b.png", (64, 64))
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], mask_path=str(tmp_path / "masks"))
    with caplog.at_level(logging.WARNING, logger="difftune"):
        dataset = build_dataset([cfg], None, 16)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"2 sample(s) of {tmp_path / 'data'} have no mask in {tmp_path / 'masks'} (e.g. a.png): "
                        "they train everywhere"]
    assert [item.record.mask for item in dataset.items] == [None, tmp_path / "masks" / "b.png", None]
    assert (dataset[0]["mask"] == 1).all() and (dataset[1]["mask"][..., :32] == 0).all()
    # in a job where another dataset has masks, a dataset without them carries all-ones masks, cached or not
    other = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], cache_latents=True)
    job = build_dataset([cfg, other], None, 16)
    job.latents = LatentCache(job, {1: tmp_path / "cache"}, {1: False}, adapter.encoder_identity("image"))
    job.latents.build(adapter, SOLO)
    assert job.latents.keys[3] == LatentCache(build_dataset([other], None, 16), {0: tmp_path / "cache"}, {0: False},
                                              adapter.encoder_identity("image")).keys[0]
    assert job[3]["mask"].shape == (1, 8, 8) and (job[3]["mask"] == 1).all() and job.latents.get(3).mask is None
    assert job[4]["mask"] is job[3]["mask"]  # one all-ones mask per grid: samples made once do not keep one each


def test_a_16_bit_mask_is_read_by_its_own_range(tmp_path):
    """A 16-bit grayscale PNG ramp reads as 0-1 (not clipped at 255 as an 8-bit conversion does); 32-bit integer and
    float pictures by their rule (`mask_values`); an RGB mask as its luminance."""
    noise_image(tmp_path / "data" / "img.png", (64, 64))
    ramp = (np.arange(64, dtype=np.float64) * 1040).astype(np.uint16)[None].repeat(64, axis=0)  # 0 .. 65520
    expected = (ramp / 65535.0).astype(np.float32)
    masks = tmp_path / "masks"
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], mask_path=str(masks))

    def mask_of(picture: Image.Image) -> torch.Tensor:
        masks.mkdir(exist_ok=True)
        picture.save(masks / "img.png")
        (item,) = build_dataset([cfg], None, 16).items
        return load_mask(item, centre_variant(item))[0]

    sixteen = mask_of(Image.fromarray(ramp))
    assert Image.open(masks / "img.png").mode in ("I;16", "I")  # a 16-bit PNG, as this Pillow opens it
    assert torch.allclose(sixteen, torch.from_numpy(expected), atol=1e-6) and sixteen.max() < 1
    eight = (ramp // 257).astype(np.uint8)
    gray = mask_of(Image.fromarray(eight))
    assert torch.equal(gray, torch.from_numpy(eight.astype(np.float32) / np.float32(255)))
    assert torch.equal(mask_of(Image.fromarray(np.stack([eight] * 3, axis=-1))), gray)  # RGB: its luminance
    # the modes PNG does not hold, read as pictures
    assert np.allclose(mask_values(Image.fromarray(ramp).convert("I")), expected)  # I within 16 bits: by 65535
    wide = np.array([[-5, 0, 2**30, 2**31 - 1]], dtype=np.int32)
    assert np.allclose(mask_values(Image.fromarray(wide)), [[0, 0, 0.5, 1]])  # beyond 16 bits: by 2**31 - 1
    floats = np.array([[-0.5, 0.25, 0.75, 1.5]], dtype=np.float32)
    assert np.array_equal(mask_values(Image.fromarray(floats)), [[0, 0.25, 0.75, 1]])  # F: as is, clipped
    big_endian = Image.frombytes("I;16B", (64, 64), ramp.astype(">u2").tobytes())
    assert np.allclose(mask_values(big_endian), expected)


def test_preflight_and_the_scan_name_a_missing_mask_folder(tmp_path):
    noise_image(tmp_path / "data" / "img.png", (64, 64))
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), mask_path=str(tmp_path / "masks"))
    process = SimpleNamespace(datasets=[DatasetConfig(folder_path=str(tmp_path / "data")), cfg], model=None)
    assert path_problems(process) == [f"datasets[1].mask_path: folder not found: {tmp_path / 'masks'}"]
    with pytest.raises(DatasetError, match="mask folder not found"):
        build_dataset([cfg], None, 16)


# ---- a whole run ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_augmented_masked_cached_run_resumes_exactly(tmp_path, tiny_sd15):
    """Flips, random crops and masks with a disk cache: the straight run encodes the variants it draws as it goes; the
    resumed run finds the ones drawn before it stopped (and all of the straight run's) in the shared cache folder, and
    trains bit for bit the same."""
    from helpers import assert_same_training, straight_and_resumed, trainer_process

    wide_and_tall(tmp_path / "data")
    for name in ("wide0", "tall1"):
        half_mask(tmp_path / "masks" / f"{name}.png", (96, 64) if name.startswith("wide") else (64, 96))
    dataset = {"folder_path": str(tmp_path / "data"), "resolution": [64], "cache_latents_to_disk": True,
               "cache_dir": str(tmp_path / "cache"), "flip_x": True, "flip_y": True, "random_crop": True,
               "mask_path": str(tmp_path / "masks"), "mask_min_value": 0.1}
    process = trainer_process(tmp_path, datasets=[dataset], train={"steps": 6, "batch_size": 2},
                              save={"save_every": 2})
    assert_same_training(*straight_and_resumed(tmp_path, process))
    assert len(list((tmp_path / "cache" / "latents").glob("*.safetensors"))) > 6  # variants beside the centres
