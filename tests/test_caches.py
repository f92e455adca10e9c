"""Captions, the latent cache and the text-embedding cache: fresh, exact, and correct on every process."""

from __future__ import annotations

import json
import os
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from helpers import make_image, make_images, trainer_process, write_job

from jobs.job import get_job
from toolkit.config.loader import load_config
from toolkit.config.schema import DatasetConfig
from toolkit.config.sections import TrainConfig
from toolkit.data.captions import process_caption
from toolkit.data.dataset import build_dataset
from toolkit.data.latent_cache import LatentCache
from toolkit.data.text_cache import CachedCaptions
from toolkit.data.training_data import TrainingData
from toolkit.device import ModulePlacement
from toolkit.files import write_atomic
from toolkit.models.registry import model_config
from toolkit.models.sd15.adapter import SD15Adapter
from toolkit.run.metrics import read_metrics
from toolkit.train.plan import Position, TrainingPlan
from toolkit.train.seeding import seeded_generator

SOLO = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True, wait_for_everyone=lambda: None,
                       device=torch.device("cpu"))
CAPTION = "sks, red, round, shiny, small, outdoors"


@pytest.fixture(scope="module")
def adapter(tiny_sd15):
    return SD15Adapter.load(model_config(arch="sd15", name_or_path="tiny"), torch.device("cpu"), torch.float32)


def views(n: int = 2000, **options) -> list[str]:
    return [process_caption(CAPTION, seeded_generator(1, "caption", 0, i), **options) for i in range(n)]


def test_shuffle_keeps_the_first_segments_and_moves_the_rest():
    shuffled = views(200, shuffle=True)
    assert all(v.startswith("sks, ") and sorted(v.split(", ")) == sorted(CAPTION.split(", ")) for v in shuffled)
    assert len(set(shuffled)) > 50
    kept = views(200, shuffle=True, keep_tokens=3)
    assert all(v.startswith("sks, red, round, ") for v in kept)


def test_caption_and_token_dropout_rates_and_the_trigger_survives():
    dropped = views(caption_dropout_rate=0.25)
    assert dropped.count("") / len(dropped) == pytest.approx(0.25, abs=0.03)
    words = views(token_dropout_rate=0.3, keep_tokens=0, trigger_word="sks")
    assert all(v.startswith("sks") for v in words)  # the trigger segment is never dropped
    kept_share = sum(len(v.split(", ")) - 1 for v in words) / (5 * len(words))
    assert kept_share == pytest.approx(0.7, abs=0.03)


def latent_cache_for(folder, adapter):
    cfg = DatasetConfig(folder_path=str(folder), resolution=[64], cache_latents_to_disk=True)
    dataset = build_dataset([cfg], None, adapter.divisor)
    cache = LatentCache(dataset, {0: folder / "_difftune_cache"}, {0: True}, adapter.encoder_identity("image"))
    return dataset, cache


def test_latent_cache_hits_unchanged_images_and_reencodes_replaced_ones(tmp_path, adapter, monkeypatch):
    for i, color in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
        make_image(tmp_path / f"img{i}.png", (64, 64), color=color)
    encoded = []
    original = adapter.encode_latent_dist
    monkeypatch.setattr(adapter, "encode_latent_dist", lambda pixels: encoded.append(1) or original(pixels))

    dataset, cache = latent_cache_for(tmp_path, adapter)
    cache.build(adapter, SOLO)
    assert len(encoded) == 3 and len(list((tmp_path / "_difftune_cache" / "latents").glob("*.safetensors"))) == 3
    from toolkit.data.dataset import load_pixels
    direct = original(load_pixels(dataset.items[0]).unsqueeze(0))
    assert torch.equal(cache.get(0)[0].mean, direct.mean[0]) and torch.equal(cache.get(0)[0].std, direct.std[0])

    encoded.clear()
    _, again = latent_cache_for(tmp_path, adapter)
    again.build(adapter, SOLO)
    assert encoded == []  # every image hit the cache

    make_image(tmp_path / "img1.png", (64, 64), color=(250, 250, 0))  # same name, new content
    _, changed = latent_cache_for(tmp_path, adapter)
    changed.build(adapter, SOLO)
    assert len(encoded) == 1
    assert changed.keys[1] != again.keys[1] and changed.keys[0] == again.keys[0]
    assert not torch.equal(changed.get(1)[0].mean, again.get(1)[0].mean)


def test_a_sample_that_never_changes_is_made_once_and_only_from_the_cache_attached(tmp_path, adapter, monkeypatch):
    """A latent kept in memory of a dataset that draws no variants is the same sample at every draw: it is made
    once. One kept on disk, or of a dataset that flips, is made at each draw; attaching another cache starts over."""
    for name in ("still", "flipped", "disk"):
        make_images(tmp_path / name, 2, size=(64, 64))
    cfgs = [DatasetConfig(folder_path=str(tmp_path / "still"), resolution=[64], cache_latents=True),
            DatasetConfig(folder_path=str(tmp_path / "flipped"), resolution=[64], cache_latents=True, flip_x=True),
            DatasetConfig(folder_path=str(tmp_path / "disk"), resolution=[64], cache_latents_to_disk=True)]
    dataset = build_dataset(cfgs, None, adapter.divisor)
    roots = {i: tmp_path / name / "_difftune_cache" for i, name in enumerate(("still", "flipped", "disk"))}

    def attach() -> LatentCache:
        cache = LatentCache(dataset, roots, {0: False, 1: False, 2: True}, adapter.encoder_identity("image"))
        cache.build(adapter, SOLO)
        dataset.latents = cache
        return cache

    cache = attach()
    looked_up = Counter()
    original = LatentCache.get
    monkeypatch.setattr(LatentCache, "get", lambda self, index, variant=None: looked_up.update([index]) or
                        original(self, index, variant))
    first = [dataset[i] for i in range(6)]
    again = [dataset[i] for i in range(6)]
    assert looked_up == Counter({i: 2 for i in range(2, 6)} | {0: 1, 1: 1})
    assert again[0] is first[0] and torch.equal(again[0]["latent_mean"], cache.get(0).dist.mean)
    assert again[4] is not first[4] and torch.equal(again[4]["latent_mean"], first[4]["latent_mean"])
    replaced = attach()
    assert dataset[0] is not first[0] and dataset.latents is replaced and looked_up[0] == 3  # made again


def test_encoder_identity_follows_the_weights(adapter):
    before = adapter.encoder_identity("image")
    weight = next(adapter.vae.parameters())
    with torch.no_grad():
        weight.add_(1e-3)
        changed = adapter.encoder_identity("image")
        weight.sub_(1e-3)
    assert changed != before and adapter.encoder_identity("text") != before


def test_copies_and_repeats_share_entries_and_every_copy_reads_back(tmp_path, adapter, monkeypatch):
    for folder in ("a", "b", "c"):
        make_image(tmp_path / folder / "same.png", (64, 64), color=(10, 200, 30))
    cfgs = [DatasetConfig(folder_path=str(tmp_path / "a"), resolution=[64], cache_latents_to_disk=True),
            DatasetConfig(folder_path=str(tmp_path / "b"), resolution=[64], cache_latents_to_disk=True, num_repeats=3),
            DatasetConfig(folder_path=str(tmp_path / "c"), resolution=[64], cache_latents=True, num_repeats=3)]
    dataset = build_dataset(cfgs, None, adapter.divisor)
    encoded = []
    original = adapter.encode_latent_dist
    monkeypatch.setattr(adapter, "encode_latent_dist", lambda pixels: encoded.append(1) or original(pixels))
    roots = {i: tmp_path / name / "_difftune_cache" for i, name in enumerate("abc")}
    cache = LatentCache(dataset, roots, {0: True, 1: True, 2: False}, adapter.encoder_identity("image"))
    cache.build(adapter, SOLO)
    assert len(encoded) == 3  # one per cache folder, and one for the three in-memory repeats
    assert all(torch.equal(cache.get(i)[0].mean, cache.get(0)[0].mean) for i in range(len(dataset)))


def test_each_atomic_write_takes_a_temporary_name_of_its_own(tmp_path):
    """The process id alone repeats across hosts sharing a file system: a random part makes each name its own."""
    names = []
    for text in ("a", "b"):
        write_atomic(tmp_path / "entry", lambda tmp, text=text: names.append(tmp.name) or tmp.write_text(text))
    assert names[0] != names[1]
    assert all(name.startswith(f".entry.{os.getpid()}-") and name.endswith(".tmp") for name in names)
    assert os.listdir(tmp_path) == ["entry"] and (tmp_path / "entry").read_text() == "b"


def test_partly_written_cache_files_are_never_read(tmp_path, adapter):
    make_image(tmp_path / "img.png", (64, 64))
    _, cache = latent_cache_for(tmp_path, adapter)
    cache.path(0).parent.mkdir(parents=True)
    (cache.path(0).parent / f".{cache.path(0).name}.123.tmp").write_bytes(b"half")
    cache.build(adapter, SOLO)
    assert cache.get(0)[0].mean.shape == (4, 8, 8)


def training_data(tmp_path, adapter, cached: list[bool]) -> tuple[TrainingData, list]:
    """The data part of a job over one dataset per entry of `cached` (5 images of one size each, latents cached in
    memory where it says True), its caches built; batches of 2. Also the batches of epochs 0-2 as ordered before
    the caches were built."""
    cfgs = [DatasetConfig(folder_path=str(make_images(tmp_path / f"data{i}", 5, size=(64, 64))), resolution=[64],
                          cache_latents=cache) for i, cache in enumerate(cached)]
    train = TrainConfig(steps=4, batch_size=2, seed=3)
    data = TrainingData(cfgs, None, train, adapter, ModulePlacement(torch.device("cpu"), low_vram=False))
    before = [data.batch_sampler.batches_for_epoch(epoch) for epoch in range(3)]
    data.build_caches(SOLO)
    return data, before


def test_a_cached_and_an_uncached_dataset_of_one_size_never_share_a_batch(tmp_path, adapter):
    data, _ = training_data(tmp_path, adapter, [True, False])
    cache = data.dataset.latents
    data.dataloader = data.make_dataloader(pin_memory=False)
    for epoch in (0, 1):
        seen = []
        for _, batch in data.one_epoch(torch.device("cpu"), Position(0, epoch, 0)):
            kinds = {cache.covers(index) for index in batch["indices"]}
            assert len(kinds) == 1 and ("latent_mean" in batch) == kinds.pop() and ("pixels" in batch) != (
                "latent_mean" in batch)
            seen += batch["indices"]
        assert sorted(seen) == list(range(10))  # every sample once
    assert len(data.batch_sampler) == 6  # 5 cached in 3 batches, 5 uncached in 3


@pytest.mark.parametrize("cached", [[True, True], [False, False]])
def test_all_datasets_cached_or_none_keep_the_batch_order(tmp_path, adapter, cached):
    data, before = training_data(tmp_path, adapter, cached)
    assert (data.dataset.latents is not None) == cached[0]
    assert [data.batch_sampler.batches_for_epoch(epoch) for epoch in range(3)] == before
    assert any(len({i < 5 for i in batch}) == 2 for epoch in before for batch in epoch)  # they do share batches


def text_cache_for(tmp_path, adapter, shuffle: bool, trigger: str | None = "sks", captions=("a, b, c, d",)):
    for i, caption in enumerate(captions):
        make_image(tmp_path / "data" / f"img{i}.png", (64, 64), caption=caption)
    cfg = DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], shuffle_tokens=shuffle)
    dataset = build_dataset([cfg], None, adapter.divisor)
    cache = CachedCaptions(adapter, dataset, [cfg], seed=3, trigger_word=trigger, roots={0: tmp_path / "cache"})
    return cache


def test_cached_segments_are_shuffled_per_epoch_around_rows_that_stay(tmp_path, adapter):
    cache = text_cache_for(tmp_path, adapter, shuffle=True)
    cache.build(SOLO)
    stored = cache.load("a, b, c, d")["embeds"]  # start, a , b , c , d, end, padding: a segment is one token here
    first, again, second = (cache.embeds_for([0], epoch).embeds[0] for epoch in (0, 0, 1))
    assert torch.equal(first, again)  # a function of (seed, epoch, sample)
    assert not torch.equal(first, second)
    moving = [3, 5, 7]  # b, c and d; a stays first (keep_tokens 1), the commas stay between the segments
    for view in (first, second):
        assert torch.equal(view[:3], stored[:3]) and torch.equal(view[4], stored[4]) and torch.equal(view[6], stored[6])
        assert torch.equal(view[8:], stored[8:])  # end token and padding
        assert {tuple(view[i].tolist()) for i in moving} == {tuple(stored[i].tolist()) for i in moving}


def test_without_shuffle_cached_embeddings_never_change(tmp_path, adapter):
    cache = text_cache_for(tmp_path, adapter, shuffle=False)
    cache.build(SOLO)
    views_ = [cache.embeds_for([0], epoch).embeds for epoch in range(4)]
    assert all(torch.equal(v, views_[0]) for v in views_)
    assert torch.equal(views_[0][0], cache.load("a, b, c, d")["embeds"])


def test_a_batch_of_one_caption_is_the_row_a_larger_batch_gives_it(tmp_path, adapter, monkeypatch):
    """SD 1.x rows (embeddings and lengths), and rows with a mask and a pooled embedding as other families cache them."""
    cache = text_cache_for(tmp_path, adapter, shuffle=False, captions=("a, b", "c"))
    cache.build(SOLO)

    def agree() -> None:
        both = cache.embeds_for([1, 0], 0)
        for row, index in enumerate((1, 0)):
            one = cache.embeds_for([index], 0)
            assert one.embeds.shape[0] == 1 and torch.equal(one.embeds[0], both.embeds[row])
            assert torch.equal(one.lengths, both.lengths[row: row + 1])
            for name in ("attention_mask", "pooled"):
                mine, theirs = getattr(one, name), getattr(both, name)
                assert (mine is None and theirs is None) or torch.equal(mine[0], theirs[row])

    agree()
    assert cache.embeds_for([0], 0).attention_mask is None
    rows = {i: {"embeds": torch.randn(5, 8), "attention_mask": torch.tensor([True] * (3 + i) + [False] * (2 - i)),
                "pooled": torch.randn(4), "length": torch.tensor([3 + i])} for i in (0, 1)}
    monkeypatch.setattr(cache, "view", lambda index, epoch: dict(rows[index]))
    agree()
    assert cache.embeds_for([1], 0).attention_mask.tolist() == [[True] * 4 + [False]]


def test_empty_caption_uses_the_trigger_or_explains_the_fix(tmp_path, adapter):
    with_trigger = text_cache_for(tmp_path / "t", adapter, shuffle=False, captions=("",))
    with_trigger.build(SOLO)
    assert torch.equal(with_trigger.embeds_for([0], 0).embeds[0], with_trigger.load("sks")["embeds"])
    without = text_cache_for(tmp_path / "n", adapter, shuffle=False, trigger=None, captions=("",))
    with pytest.raises(ValueError, match="empty caption.*default_caption, or set trigger_word"):
        without.build(SOLO)


def run_job(tmp_path, registry, name, **overrides):
    process = trainer_process(tmp_path, **overrides)
    config, path = load_config(str(write_job(tmp_path / f"{name}.yaml", name, process)), registry)
    job = get_job(config, path, registry)
    job.run()
    return job.processes[0], read_metrics(tmp_path / "output" / name / "metrics.jsonl")


@pytest.mark.slow
def test_training_with_both_caches_leaves_the_encoders_unused(tmp_path, registry, monkeypatch):
    from jobs.process.base_sd_train_process import BaseSDTrainProcess as SDTrainer

    calls = Counter()
    original_train = SDTrainer.train

    def train_with_hooks(self):
        self.adapter.vae.encoder.register_forward_hook(lambda *a: calls.update(["vae"]))
        self.adapter.text_encoder.register_forward_hook(lambda *a: calls.update(["text"]))
        original_train(self)

    monkeypatch.setattr(SDTrainer, "train", train_with_hooks)
    data = make_images(tmp_path / "data", 6, size=(64, 64))
    datasets = [{"folder_path": str(data), "resolution": [64], "cache_latents_to_disk": True,
                 "shuffle_tokens": True, "caption_dropout_rate": 0.2}]
    trainer, cached = run_job(tmp_path, registry, "cached", datasets=datasets,
                              train={"steps": 6, "cache_text_embeddings": True})
    assert calls == Counter()
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in cached)
    assert trainer.adapter.vae.device.type == "cpu" and trainer.adapter.text_encoder.device.type == "cpu"
    assert trainer.placement.offloaded == [trainer.adapter.vae, trainer.adapter.text_encoder]


@pytest.mark.slow
def test_training_leaves_in_memory_cache_entries_as_they_were(tmp_path, registry, monkeypatch):
    """A batch of one sample carries the caches' own tensors (`batch_of`): training must never write into them."""
    from jobs.process.base_sd_train_process import BaseSDTrainProcess as SDTrainer

    seen = {}
    original_train = SDTrainer.train

    def train_and_look(self):
        latents, captions = self.data.dataset.latents, self.data.conditioning
        keys = [captions.own_key(index) for index in range(len(self.data.dataset))]

        def entries():
            return ([t.clone() for e in latents.memory.values() for t in (e.dist.mean, e.dist.std)]
                    + [t.clone() for key in keys for t in captions.load(key).values()])

        seen["before"] = entries()
        original_train(self)
        seen["after"] = entries()

    monkeypatch.setattr(SDTrainer, "train", train_and_look)
    data = make_images(tmp_path / "data", 3, size=(64, 64))
    datasets = [{"folder_path": str(data), "resolution": [64], "cache_latents": True}]
    run_job(tmp_path, registry, "one_per_batch", datasets=datasets,
            train={"steps": 4, "batch_size": 1, "cache_text_embeddings": True})
    assert len(seen["before"]) >= 6 and len(seen["after"]) == len(seen["before"])
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], seen["after"], strict=True))


@pytest.mark.slow
def test_cached_latents_train_like_live_encoding(tmp_path, registry):
    data = make_images(tmp_path / "data", 6, size=(64, 64))
    live = [{"folder_path": str(data), "resolution": [64]}]
    cached = [{**live[0], "cache_latents": True}]
    _, a = run_job(tmp_path, registry, "live", datasets=live, train={"steps": 4})
    _, b = run_job(tmp_path, registry, "memory", datasets=cached, train={"steps": 4})
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-4)


def epoch_views(folder, processes, job):
    seen = {}
    for rank in range(processes):
        for line in (folder / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["job"] == job:
                seen.setdefault(record["epoch"], []).extend(record["indices"])
    return seen


#: name: (images, batch size, cached): 8 images in batches of 2 shard evenly over 2 processes; 5 batches of 1 do not
SHARD_CASES = {"even": (8, 2, True), "uneven": (5, 1, False)}


def every_sample_jobs(tmp_path) -> list[str]:
    """The sharding jobs of the shared two-process launch (conftest.py `two_process_launch`): one cached, one live,
    two epochs each."""
    files = []
    for name, (images, batch, cached) in SHARD_CASES.items():
        data = make_images(tmp_path / f"data_{name}", images, size=(64, 64))
        dataset = {"folder_path": str(data), "resolution": [64], "cache_latents_to_disk": cached}
        process = trainer_process(tmp_path, datasets=[dataset], train={
            "steps": None, "epochs": 2, "batch_size": batch, "cache_text_embeddings": cached})
        files.append(str(write_job(tmp_path / f"{name}.yaml", name, process)))
    return files


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_sample_once_per_epoch_on_two_processes(two_process_launch):
    """8 images in batches of 2 shard evenly over 2 processes; 5 batches of 1 do not, so accelerate repeats one
    batch, which the plan announces. Both jobs (cached and live) in the shared launch, one after the other."""
    tmp_path, result = two_process_launch
    assert result.returncode == 0, result.stderr[-3000:]
    for name, (images, batch, _) in SHARD_CASES.items():
        plan = TrainingPlan.create(images, images // batch, 2, 1, steps=None, epochs=2)
        announced = json.loads((tmp_path / "output" / name / "plan.json").read_text())
        assert announced["batches repeated to even shards"] == plan.repeated_batches
        views_by_epoch = epoch_views(tmp_path / "seen", 2, name)
        assert sorted(views_by_epoch) == [0, 1]
        for indices in views_by_epoch.values():
            counts = Counter(indices)
            assert set(counts) == set(range(images))  # every sample, and nothing else
            assert len(indices) - images == plan.repeated_batches * batch
