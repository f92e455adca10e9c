"""Reference images (`datasets[].control_path`, image-editing families) as data: pairs found by base name and
refused by name when missing (or let go with `control_optional`), sized by the family's rule, cropped and mirrored
with their targets, batched and cached with them, and the config's checks. No model is loaded here."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import inline_job
from PIL import Image

from toolkit.config.loader import ConfigError, load_config
from toolkit.config.sections import DatasetConfig
from toolkit.data.dataset import (
    DatasetError,
    Variant,
    build_dataset,
    collate,
    crop_plan,
    load_pixels,
    load_references,
    reference_sizes,
    reference_window,
    scan_folder,
)
from toolkit.models.config import ReferenceFacts

TARGET = ReferenceFacts(slots=1, optional=True, size="target")
BUDGET = ReferenceFacts(slots=3, optional=True, size="budget", multiple=16)


def noise_picture(path: Path, size: tuple[int, int], seed: int, caption: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    values = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(values).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def paired(tmp_path: Path, names=("a", "b", "c"), size=(48, 32), reference_size=None, missing=()) -> DatasetConfig:
    for index, name in enumerate(names):
        noise_picture(tmp_path / "targets" / f"{name}.png", size, index, caption=f"edit {name}")
        if name not in missing:
            noise_picture(tmp_path / "refs" / f"{name}.jpg", reference_size or size, 100 + index)
    return DatasetConfig(folder_path=str(tmp_path / "targets"), control_path=str(tmp_path / "refs"), resolution=[32])


def test_pairs_are_found_by_base_name_with_any_image_extension(tmp_path):
    records = scan_folder(paired(tmp_path), None)
    assert [r.path.name for r in records] == ["a.png", "b.png", "c.png"]
    assert [[ref.path.name for ref in r.references] for r in records] == [["a.jpg"], ["b.jpg"], ["c.jpg"]]
    assert records[0].references[0].width == 48 and records[0].references[0].height == 32


def test_every_target_without_its_reference_is_named_in_one_refusal(tmp_path):
    cfg = paired(tmp_path, names=("a", "b", "c", "d"), missing=("b", "d"))
    with pytest.raises(DatasetError) as refused:
        scan_folder(cfg, None)
    message = str(refused.value)
    assert "2 target(s)" in message and "b.png: missing" in message and "d.png: missing" in message
    assert "a.png" not in message and "control_optional" in message


def test_control_optional_trains_the_unpaired_targets_without_one_and_says_so(tmp_path, caplog):
    cfg = paired(tmp_path, missing=("b",)).model_copy(update={"control_optional": True})
    with caplog.at_level(logging.WARNING, logger="difftune"):
        records = scan_folder(cfg, None)
    assert [len(r.references) for r in records] == [1, 0, 1]
    assert "b.png: missing" in caplog.text


def test_an_unreadable_reference_is_named_like_a_missing_one(tmp_path):
    cfg = paired(tmp_path)
    (tmp_path / "refs" / "c.jpg").write_bytes(b"not an image")
    with pytest.raises(DatasetError, match=r"c.png: unreadable c.jpg"):
        scan_folder(cfg, None)


def test_several_slots_pair_each_folder_in_order(tmp_path):
    paired(tmp_path)
    for index, name in enumerate("abc"):
        noise_picture(tmp_path / "refs2" / f"{name}.webp", (32, 32), 200 + index)
    cfg = DatasetConfig(folder_path=str(tmp_path / "targets"),
                        control_path=[str(tmp_path / "refs"), str(tmp_path / "refs2")])
    records = scan_folder(cfg, None)
    assert [ref.path.name for ref in records[1].references] == ["b.jpg", "b.webp"]


def one_item(tmp_path, rules, **cfg_changes):
    cfg = paired(tmp_path, names=("a",), **{k: v for k, v in cfg_changes.items() if k in ("size", "reference_size")})
    dataset = build_dataset([cfg], None, 16, references=rules)
    return dataset, dataset.items[0]


@pytest.mark.parametrize("where, flip_x, flip_y", [(None, False, False), ("start", True, False),
                                                   ("end", False, True), ("middle", True, True)])
def test_a_target_sized_reference_of_the_targets_size_is_cut_and_mirrored_as_the_target(tmp_path, where, flip_x,
                                                                                       flip_y):
    """A reference that is the target's own picture gives the target's pixels under every crop and mirror: the pair
    keeps showing the same region (fails if the reference is centre-cropped, or left unmirrored)."""
    dataset, item = one_item(tmp_path, TARGET, size=(80, 32))
    shutil.copyfile(item.record.path, item.record.references[0].path)  # the reference is the target's own picture
    plan = crop_plan(80, 32, item.bucket)
    slack_x, slack_y = plan.resized[0] - item.bucket[0], plan.resized[1] - item.bucket[1]
    assert max(slack_x, slack_y) > 2  # room to crop in
    variant = None
    if where is not None:
        at = {"start": 0.0, "middle": 1 / 3, "end": 1.0}[where]
        variant = Variant(round(at * slack_x), round(at * slack_y), flip_x, flip_y)
    target = load_pixels(item, variant)
    reference = load_references(item, variant, TARGET)[0]
    assert torch.equal(reference, target)


def test_a_target_sized_reference_of_another_size_takes_the_targets_bucket(tmp_path):
    dataset, item = one_item(tmp_path, TARGET, size=(48, 32), reference_size=(96, 96))
    assert reference_sizes(item, TARGET) == (item.bucket,)
    assert load_references(item, None, TARGET)[0].shape == (3, item.bucket[1], item.bucket[0])


def test_a_budget_sized_reference_keeps_its_aspect_at_the_targets_area(tmp_path):
    """A square reference of a wide target: square, about the bucket's area, sides multiples of 16; a reference of the
    target's aspect ratio is cut with the target's crop window."""
    dataset, item = one_item(tmp_path, BUDGET, size=(96, 32), reference_size=(80, 80))
    (width, height), = reference_sizes(item, BUDGET)
    assert width == height and width % 16 == 0
    assert abs(width * height - item.bucket[0] * item.bucket[1]) <= 16 * (width + height)
    assert reference_window(item, item.record.references[0], None) == (0.0, 0.0, 80.0, 80.0)


def test_a_budget_sized_reference_of_the_targets_aspect_is_cut_and_mirrored_with_it(tmp_path):
    """A reference of the target's aspect ratio (twice its size) shows the window the target's crop takes, at the same
    fractions, and is mirrored with it."""
    dataset, item = one_item(tmp_path, BUDGET, size=(96, 40), reference_size=(192, 80))
    plan = crop_plan(96, 40, item.bucket)
    slack_x, slack_y = plan.resized[0] - item.bucket[0], plan.resized[1] - item.bucket[1]
    assert max(slack_x, slack_y) > 0
    crop = Variant(slack_x, slack_y, True, False)  # the far corner
    left, top, right, bottom = reference_window(item, item.record.references[0], crop)
    assert (left, top) == (pytest.approx(slack_x / plan.resized[0] * 192), pytest.approx(slack_y / plan.resized[1] * 80))
    assert (right - left, bottom - top) == (pytest.approx(item.bucket[0] / plan.resized[0] * 192, abs=1e-6),
                                            pytest.approx(item.bucket[1] / plan.resized[1] * 80, abs=1e-6))
    mirrored = load_references(item, crop, BUDGET)[0]
    plain = load_references(item, Variant(slack_x, slack_y), BUDGET)[0]
    assert torch.equal(mirrored, plain.flip(-1))
    assert not torch.equal(plain, load_references(item, Variant(0, 0), BUDGET)[0])  # the window moved with the crop


def test_references_batch_by_size_and_wait_with_their_pending_rows(tmp_path):
    cfg = paired(tmp_path, names=("a", "b"), size=(32, 32))
    noise_picture(tmp_path / "refs" / "b.jpg", (64, 32), 7)  # b's reference is wide: another budget size
    dataset = build_dataset([cfg], None, 16, references=BUDGET)
    keys = dataset.bucket_keys()
    assert keys[0][:4] == keys[1][:4] and keys[0][4] != keys[1][4]
    samples = [dataset[0], dict(dataset[0], latent_key="k")]
    batch = collate(samples)
    assert batch["reference_pixels_0"].shape[0] == 1 and batch["pending"]["reference_pixels_0"].shape[0] == 1


def job_with(tmp_path, model: str, dataset: str, validation: str = "") -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "refs").mkdir(exist_ok=True)
    path = inline_job(tmp_path / "job.yaml", model)
    text = path.read_text().replace("datasets: [{folder_path: data}]", f"datasets: [{{folder_path: data{dataset}}}]")
    if validation:
        text += f"      validation: {{{validation}}}\n"
    path.write_text(text)
    return path


@pytest.mark.parametrize("model, dataset, validation, message", [
    ("arch: flux, name_or_path: tiny", ", control_path: refs", "",
     "datasets[0].control_path: the flux family (FLUX.1) takes no reference images"),
    ("arch: flux_kontext, name_or_path: tiny", ", control_path: [refs, refs]", "",
     "datasets[0].control_path: FLUX.1 Kontext takes at most 1 reference image(s) per sample, not 2 folders"),
    ("arch: flux_kontext, name_or_path: tiny", ", control_optional: true", "",
     "datasets[0].control_optional: there is no control_path"),
    ("arch: flux_kontext, name_or_path: tiny", ", control_path: data", "",
     "datasets[0].control_path: the image folder itself"),
    ("arch: flux_kontext, name_or_path: tiny", ", control_path: refs", "folder_path: data, every: 5",
     "validation.control_path: the training targets have references"),
    ("arch: flux_kontext, name_or_path: tiny", "", "split: 0.5, control_path: refs",
     "validation.control_path: a split's samples keep their dataset's references"),
])
def test_config_refuses_references_where_they_cannot_apply(tmp_path, monkeypatch, registry, model, dataset,
                                                           validation, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        load_config(str(job_with(tmp_path, model, dataset, validation)), registry)
    assert message in str(refused.value)


def test_a_missing_reference_folder_is_named_before_anything_loads(tmp_path, monkeypatch, caplog):
    from run import main

    monkeypatch.chdir(tmp_path)
    path = job_with(tmp_path, "arch: flux_kontext, name_or_path: tiny", ", control_path: [absent]")
    noise_picture(tmp_path / "data" / "a.png", (32, 32), 0)
    with caplog.at_level(logging.ERROR, logger="difftune"):
        assert main([str(path)]) == 1
    assert "datasets[0].control_path: folder not found: absent" in caplog.text


def test_more_references_than_the_loaded_model_takes_are_refused_by_key(tmp_path, monkeypatch, registry):
    """Qwen-Image-Edit's family takes three references, its first version one: known once the model's files are
    read, then two folders, or a sample with two references, are refused by key."""
    from jobs.process.base_sd_train_process import refuse_extra_references
    from toolkit.errors import UserError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "refs2").mkdir()
    path = job_with(tmp_path, "arch: qwen_image_edit, name_or_path: tiny", ", control_path: [refs, refs2]")
    config, _ = load_config(str(path), registry)
    process = config.config.process[0]
    refuse_extra_references(process, ReferenceFacts(slots=3, size="budget"))
    with pytest.raises(UserError, match=r"datasets\[0\].control_path: this model takes 1 reference image\(s\) per "
                                        r"sample, not 2"):
        refuse_extra_references(process, ReferenceFacts(slots=1, size="budget"))


def test_an_unpaired_target_stops_the_job_by_name_before_the_model_loads(tmp_path, monkeypatch, caplog):
    """Through run.py: the pairs are read with the dataset folders, before any model loads (the model here could not
    load at all: a hub id, offline), and the unpaired target is named."""
    from run import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = paired(tmp_path, names=("a", "b"), missing=("b",))
    path = job_with(tmp_path, "arch: flux_kontext, name_or_path: tiny", "")
    text = path.read_text().replace("folder_path: data}", f"folder_path: {cfg.folder_path}, control_path: "
                                    f"{cfg.control_path}}}")
    path.write_text(text.replace("name_or_path: tiny", "name_or_path: nobody/no-such-model"))
    with caplog.at_level(logging.ERROR, logger="difftune"):
        assert main([str(path)]) == 1
    assert "1 target(s)" in caplog.text and "b.png: missing" in caplog.text
