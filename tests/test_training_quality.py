"""Validation loss, EMA of the trained weights, Prodigy and schedule-free AdamW: end to end on the tiny SD 1.5 (exact
resume, the figures the metrics carry, the saved files), and their parts on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    QUICKSTART_DATA,
    assert_same_training,
    make_images,
    run_job,
    trainer_process,
    write_job,
)
from PIL import Image
from safetensors.torch import load_file

import run
from toolkit.config.loader import ConfigError, load_config
from toolkit.config.sections import DatasetConfig, EMAConfig, TrainConfig
from toolkit.data.dataset import DatasetError, scan_datasets
from toolkit.network.lora import components_state_dict
from toolkit.run.checkpoint import load_optimizer_keeping_hyperparameters
from toolkit.run.metrics import Throughput, read_metrics
from toolkit.train.ema import LoraEMA
from toolkit.train.optimizers import (
    build_optimizer,
    evaluation_weights,
    hyperparameter_names,
    optimizer_figures,
    start_training,
)
from toolkit.train.validation import HeldOut, Validation, noise_levels, split_held_out

VALIDATION = {"split": 0.25, "every": 2, "timesteps": 4, "batch_size": 2}


def quality_process(tmp_path: Path, train: dict, save_every: int = 1, **sections) -> dict:
    """8 updates on the shipped images with a validation split; every `save_every` update checkpointed (all kept)."""
    return trainer_process(tmp_path, train={"steps": 8, **train}, validation=VALIDATION,
                           save={"save_every": save_every, "max_step_saves_to_keep": 20, "formats": ["diffusers"]},
                           **sections)


def val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r}


def interrupted_and_resumed(tmp_path: Path, name: str, process: dict) -> Path:
    """The job stopped by Ctrl-C after 3 updates, then run again to the end: its run folder."""
    from instrumented_run import interrupt_after

    job = write_job(tmp_path / f"{name}.yaml", name, process)
    with interrupt_after(3):
        assert run.main([str(job)]) == 0
    assert not (Path(process["training_folder"]) / name / f"{name}.safetensors").exists()
    assert run.main([str(job)]) == 0
    return Path(process["training_folder"]) / name


# ---- end to end ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_schedule_free_with_ema_resumes_exactly_and_saves_its_average_weights(tmp_path, registry):
    """schedule-free AdamW + EMA (decay 0.8 every 2 updates from update 1) + validation + EMA samples: a Ctrl-C and
    rerun gives the same losses, validation losses and files (EMA included) bit for bit; the EMA follows an EMA
    computed here from the checkpoints' weights; the saved LoRA is the optimizer's eval-mode weights; EMA samples
    are not the live weights' and leave the weights and the RNG as they were; the held-out loss falls."""
    process = quality_process(
        tmp_path, {"optimizer": "schedulefree_adamw", "lr": 3e-3, "ema": {"decay": 0.8, "update_every": 2,
                                                                           "start_step": 1}},
        sample={"prompts": ["a shp circle"], "width": 64, "height": 64, "sample_steps": 2, "sample_every": 4,
                "use_ema": True})
    trainer, straight = run_job(tmp_path, registry, "straight", process)
    resumed = interrupted_and_resumed(tmp_path, "resumed", process)
    assert_same_training(straight, resumed)
    assert (straight / "straight.ema.safetensors").is_file() and (straight / "straight.ema.diffusers.safetensors").is_file()
    last = "checkpoints/step_000000008/ema.safetensors"
    assert_same_tensors(load_file(str(straight / last)), load_file(str(resumed / last.replace("straight", "resumed"))))

    # the EMA, recomputed from the weights each checkpoint holds
    weights = {s: load_file(str(straight / f"checkpoints/step_{s:09d}/lora.safetensors")) for s in range(1, 9)}
    reference = dict(weights[1])
    for step in range(2, 9):
        if (step - 1) % 2 == 0:
            reference = {k: torch.lerp(v, weights[step][k], 0.2) for k, v in reference.items()}
        saved = load_file(str(straight / f"checkpoints/step_{step:09d}/ema.safetensors"))
        assert saved.keys() == reference.keys()
        for key in reference:
            torch.testing.assert_close(saved[key], reference[key], rtol=1e-6, atol=1e-8)
    assert not all(torch.equal(reference[k], weights[8][k]) for k in reference)

    # the saved LoRA is schedule-free's x = y + (1 - 1/beta1)(z - y), not the training point y
    inner = trainer.optimizer.optimizer
    beta1 = inner.param_groups[0]["betas"][0]
    components = [c.in_checkpoint() for c in trainer.components]
    live = weights_now(components)
    kept = [p.detach().clone() for p in trainer.lora_params]
    with torch.no_grad():
        for param in trainer.lora_params:
            param.lerp_(inner.state[param]["z"], 1 - 1 / beta1)
    averaged = weights_now(components)
    with torch.no_grad():
        for param, value in zip(trainer.lora_params, kept):
            param.copy_(value)
    saved = load_file(str(straight / "straight.diffusers.safetensors"))
    assert_same_tensors(saved, averaged)
    assert not all(torch.equal(saved[k], live[k]) for k in live)

    # EMA samples: the EMA's, not the live weights'; rendering leaves the weights and the RNG untouched
    sampler = trainer.sampler
    ema_sample = pixels(straight / "samples/step_000000008_0.png")
    rng = torch.get_rng_state()
    assert pixels(sampler.render(98)[0]).equal(ema_sample)
    sampler.weights = lambda: evaluation_weights(trainer.optimizer)
    assert not pixels(sampler.render(99)[0]).equal(ema_sample)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, k) for p, k in zip(trainer.lora_params, kept))

    losses = val_losses(straight)
    assert sorted(losses) == [0, 2, 4, 6, 8] and losses[8] < losses[0]
    assert 'id="chart-val_loss"' in (straight / "report.html").read_text(encoding="utf-8")


@pytest.mark.slow
def test_prodigy_logs_its_estimate_resumes_exactly_and_lowers_the_held_out_loss(tmp_path, registry):
    process = quality_process(tmp_path, {"optimizer": "prodigy", "lr": 1.0, "optimizer_params": {"d0": 1e-4}},
                              save_every=0)
    straight = tmp_path / "output" / "straight"
    straight.mkdir(parents=True)  # a fresh start's folder with a stale step-0 line (a crash before any checkpoint)
    (straight / "metrics.jsonl").write_text('{"step": 0, "epoch": 0, "val_loss": 123.0}\n')
    assert run.main([str(write_job(tmp_path / "straight.yaml", "straight", process))]) == 0
    assert [r["val_loss"] != 123.0 for r in read_metrics(straight / "metrics.jsonl") if r["step"] == 0] == [True]
    resumed = interrupted_and_resumed(tmp_path, "resumed", process)
    assert_same_training(straight, resumed)
    records = [r for r in read_metrics(straight / "metrics.jsonl") if "loss" in r]
    d = [r["prodigy_d"] for r in records]
    assert d[-1] > d[0] >= 1e-4  # the estimate grows from d0
    assert all(r["lr"] == pytest.approx(r["prodigy_d"] * 1.0) for r in records)  # lr 1.0 by default
    losses = val_losses(straight)
    assert losses[8] < losses[0]


def validation_jobs(tmp: Path) -> list[str]:
    """The validation job of the shared two-process launch (conftest.py `two_process_launch`), into `tmp`/val2."""
    process = trainer_process(tmp, training_folder=str(tmp / "val2"), validation=VALIDATION,
                              train={"steps": 4, "batch_size": 1})
    return [str(write_job(tmp / "validation.yaml", "validation", process))]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_validation_loss_is_the_same_on_one_and_two_processes_and_never_trained_on(two_process_launch, tmp_path,
                                                                                       registry):
    """Before the first update (the same weights) the validation figures are bit-identical on 1 and 2 processes and in
    a second run; they change once the weights do; no held-out image is ever in a training batch."""
    launched, result = two_process_launch
    assert result.returncode == 0, result.stderr[-4000:]
    two = [r for r in read_metrics(launched / "val2" / "validation" / "metrics.jsonl") if "val_loss" in r]
    process = trainer_process(tmp_path, validation=VALIDATION, train={"steps": 4, "batch_size": 1})
    _, one_dir = run_job(tmp_path, registry, "validation", process)
    one = [r for r in read_metrics(one_dir / "metrics.jsonl") if "val_loss" in r]
    _, again_dir = run_job(tmp_path, registry, "again", {**process, "train": {**process["train"], "steps": 1}})
    again = [r for r in read_metrics(again_dir / "metrics.jsonl") if "val_loss" in r]
    figures = ("val_loss", "val_loss_low", "val_loss_mid", "val_loss_high")
    assert [one[0][k] for k in figures] == [two[0][k] for k in figures] == [again[0][k] for k in figures]
    assert one[0]["step"] == two[0]["step"] == 0
    assert two[-1]["step"] == 4 and two[-1]["val_loss"] != two[0]["val_loss"]

    scanned = scan_datasets([DatasetConfig(folder_path=str(QUICKSTART_DATA), resolution=[64])], "shp")
    _, held_out = split_held_out(scanned, [DatasetConfig(folder_path=str(QUICKSTART_DATA))], 0.25, 42)
    held = {str(r.path) for records in held_out for r in records}
    seen = set()
    for rank in (0, 1):
        for line in (launched / "seen" / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["job"] == "validation":
                seen.update(record["paths"])
    assert len(held) == 2 and seen and not seen & held
    assert seen | held == {str(p) for p in QUICKSTART_DATA.glob("*.png")}


def weights_now(components) -> dict[str, torch.Tensor]:
    """A copy of the components' adapter weights (the state dict's tensors may be the parameters themselves)."""
    return {k: v.clone() for k, v in components_state_dict(components, torch.float32).items()}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def pixels(path: Path) -> torch.Tensor:
    with Image.open(path) as image:
        return torch.from_numpy(__import__("numpy").asarray(image.convert("RGB"))).clone()


# ---- the parts ----------------------------------------------------------------------------------------------


def test_the_split_is_chosen_by_the_seed_and_leaves_regularisation_images_alone(tmp_path):
    make_images(tmp_path / "a", 6)
    make_images(tmp_path / "reg", 3)
    cfgs = [DatasetConfig(folder_path=str(tmp_path / "a")), DatasetConfig(folder_path=str(tmp_path / "reg"), is_reg=True)]
    scanned = scan_datasets(cfgs, None)
    kept, held = split_held_out(scanned, cfgs, 0.34, seed=1)
    assert split_held_out(scanned, cfgs, 0.34, seed=1) == (kept, held)
    assert len(held[0]) == 2 and held[1] == [] and kept[1] == scanned[1]
    assert sorted(kept[0] + held[0], key=lambda r: r.path) == scanned[0]
    others = {tuple(r.path for r in split_held_out(scanned, cfgs, 0.34, seed=s)[1][0]) for s in range(2, 12)}
    assert len(others) > 1  # another seed, another choice
    with pytest.raises(DatasetError, match="validation.split"):
        split_held_out([scanned[0][:1], scanned[1]], cfgs, 0.5, seed=1)


def test_noise_levels_are_evenly_spread_inside_the_range():
    assert noise_levels(4) == [0.125, 0.375, 0.625, 0.875]


def test_ema_follows_its_rule_and_gives_the_trained_weights_back_exactly():
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ema = LoraEMA(EMAConfig(decay=0.5, update_every=2, start_step=2), [param])
    ema.begin(0)
    assert not ema.started
    for step, value in [(1, 3.0), (2, 4.0), (3, 10.0), (4, 8.0)]:
        param.data.fill_(value)
        ema.after_update(step)
    # copied after update 2 (4.0); update 3 is not an EMA update; after update 4: 0.5 x 4 + 0.5 x 8
    assert ema.average[0].tolist() == [6.0, 6.0]
    with ema.applied():
        assert param.tolist() == [6.0, 6.0]
    assert param.tolist() == [8.0, 8.0]
    with ema.loading():
        param.data.fill_(1.5)
    assert ema.average[0].tolist() == [1.5, 1.5] and param.tolist() == [8.0, 8.0]


def schedule_free_after_steps(steps: int = 3):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    optimizer = build_optimizer(TrainConfig(steps=1, optimizer="schedulefree_adamw", lr=0.1).optimization, params)
    start_training(optimizer)
    for _ in range(steps):
        params[0].grad = torch.randn(4, 3)
        optimizer.step()
    return params[0], optimizer


def test_schedule_free_evaluation_weights_are_its_average_and_training_continues_from_the_exact_point():
    param, optimizer = schedule_free_after_steps()
    y = param.detach().clone()
    beta1 = optimizer.param_groups[0]["betas"][0]
    with evaluation_weights(optimizer):
        assert torch.allclose(param, y.lerp(optimizer.state[param]["z"], 1 - 1 / beta1))
        assert not torch.equal(param, y)
    assert torch.equal(param, y) and optimizer.param_groups[0]["train_mode"]
    optimizer.step()  # still in train mode: schedulefree refuses a step in eval mode


def test_a_resume_keeps_the_optimizers_running_state_and_the_configs_settings():
    """Prodigy keeps d in its param groups, schedule-free its weight sum: they come from the checkpoint; a changed
    weight decay comes from the config."""
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    prodigy = build_optimizer(TrainConfig(steps=1, optimizer="prodigy").optimization, params)
    for _ in range(3):
        params[0].grad = torch.randn(4, 3)
        prodigy.step()
    saved = prodigy.state_dict()
    fresh = build_optimizer(TrainConfig(steps=1, optimizer="prodigy", optimizer_params={"weight_decay": 0.1})
                            .optimization, params)
    changes = load_optimizer_keeping_hyperparameters(fresh, saved)
    assert changes == ["weight_decay 0 -> 0.1"]
    group = fresh.param_groups[0]
    assert group["d"] == saved["param_groups"][0]["d"] != group["d0"] and group["k"] == 3
    assert optimizer_figures(fresh) == {"prodigy_d": group["d"]}
    assert {"d", "k", "d_numerator"}.isdisjoint(hyperparameter_names(fresh))

    param, schedule_free = schedule_free_after_steps()
    weight_sum = schedule_free.param_groups[0]["weight_sum"]
    again = build_optimizer(TrainConfig(steps=1, optimizer="schedulefree_adamw", lr=0.1).optimization, [param])
    load_optimizer_keeping_hyperparameters(again, schedule_free.state_dict())
    assert again.param_groups[0]["weight_sum"] == weight_sum > 0 and again.param_groups[0]["k"] == 3


def test_learning_rate_free_settings_are_checked_with_the_config(tmp_path, registry):
    assert TrainConfig(steps=1, optimizer="prodigy").lr == 1.0
    process = trainer_process(tmp_path, train={"optimizer": "prodigy", "lr": 1e-4, "text_encoder_lr": 0.5},
                              network={"train_text_encoder": True})
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "p.yaml", "p", process)), registry)
    assert "looks like an Adam learning rate" in str(error.value) and "one step size" in str(error.value)
    process = trainer_process(tmp_path, train={"optimizer": "schedulefree_adamw", "lr_scheduler": "cosine"},
                              validation={"every": 5})
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "s.yaml", "s", process)), registry)
    assert "replaces the LR schedule" in str(error.value) and "config.process[0].validation: give `folder_path`" in str(
        error.value)
    with pytest.raises(ConfigError, match="the EMA would never start"):
        load_config(str(write_job(tmp_path / "n.yaml", "n", trainer_process(
            tmp_path, train={"steps": 4, "ema": {"start_step": 4}}))), registry)
    with pytest.raises(ConfigError, match="sample.use_ema: there is no EMA"):
        load_config(str(write_job(tmp_path / "e.yaml", "e", trainer_process(tmp_path, sample={"use_ema": True}))),
                    registry)


def test_validation_time_is_not_training_time(monkeypatch):
    clock = iter([0.0, 1.0, 5.0, 6.0])
    monkeypatch.setattr("toolkit.run.metrics.time.perf_counter", lambda: next(clock))
    throughput = Throughput()  # started at 0
    throughput.count(2)
    with throughput.paused():  # 1 -> 5
        pass
    assert throughput.read()["time"] == 2.0  # 6 - 0 - 4


def encode(validation: Validation, rank: int, processes: int) -> None:
    validation.encode_latents(rank, processes)
    validation.encode_prompts()


def test_validation_batches_are_fixed_whatever_the_process_count_and_masks_weight_a_split(tmp_path, tiny_sd15):
    """Each process evaluates its share of one fixed list of batches, and the losses summed over processes are the
    one-process table exactly; a split sample's loss mask weights its loss (a mask of zeros over its left half
    gives another figure than no mask)."""
    from toolkit.config.schema import ValidationConfig
    from toolkit.models.registry import model_config
    from toolkit.models.sd15.adapter import SD15Adapter

    adapter = SD15Adapter.load(model_config(arch="sd15", name_or_path="tiny"), torch.device("cpu"), torch.float32)
    make_images(tmp_path / "data", 5, size=(64, 64))
    make_images(tmp_path / "wide", 2, size=(96, 48))
    masks = tmp_path / "masks"
    masks.mkdir()
    for image in (tmp_path / "data").glob("*.png"):
        mask = Image.new("L", (64, 64), 255)
        mask.paste(0, (0, 0, 32, 64))
        mask.save(masks / image.name)
    cfgs = [DatasetConfig(folder_path=str(tmp_path / "data"), resolution=[64], mask_path=str(masks)),
            DatasetConfig(folder_path=str(tmp_path / "wide"), resolution=[64])]
    squares, wide = scan_datasets(cfgs, None)
    held_out = HeldOut([(cfgs[0], squares[:4]), (cfgs[1], wide)])  # as a split holds them out
    assert all(r.mask is not None for r in squares)
    cfg = ValidationConfig(split=0.5, batch_size=2, timesteps=3)
    train = TrainConfig(steps=1)

    def validation(unmasked: bool = False) -> Validation:
        sources = HeldOut([(c.model_copy(update={"mask_path": None}) if unmasked else c, [
            r.__class__(**{**r.__dict__, "mask": None}) if unmasked else r for r in records])
            for c, records in held_out.sources])
        return Validation(cfg, sources.items(adapter.divisor), train.objective, 42, adapter, sizes=False,
                          mask_min_values=sources.mask_min_values())

    whole = validation()
    assert [len(rows) for rows in whole.batch_rows()] == [2, 2, 2]  # 4 squares then 2 wide: sizes never mixed
    encode(whole, 0, 1)
    alone = whole.losses(adapter.unet)
    shares = []
    for rank in (0, 1):
        part = validation()
        encode(part, rank, 2)
        assert [b.number for b in part.batches] == list(range(rank, 3, 2))
        shares.append(part.losses(adapter.unet))
    assert torch.equal(shares[0] + shares[1], alone)
    assert whole.batches[0].mask is not None and whole.batches[-1].mask is None
    unmasked = validation(unmasked=True)
    encode(unmasked, 0, 1)
    plain = unmasked.losses(adapter.unet)
    assert torch.equal(plain[4:], alone[4:]) and not torch.equal(plain[:4], alone[:4])
    assert whole.figures(alone)["val_loss"] == alone.mean().item()


def test_a_missing_validation_folder_is_named_before_any_model_loads(tmp_path):
    from toolkit.config.preflight import path_problems
    from toolkit.config.schema import SDTrainerConfig

    process = SDTrainerConfig.model_validate(trainer_process(tmp_path, validation={"folder_path": str(tmp_path / "no")}))
    assert path_problems(process) == [f"validation.folder_path: folder not found: {tmp_path / 'no'}"]
    (tmp_path / "empty").mkdir()
    process = SDTrainerConfig.model_validate(trainer_process(tmp_path, validation={"folder_path": str(tmp_path / "empty")}))
    assert path_problems(process)[0].startswith("validation.folder_path: no images")
