"""Optimizers: each one trains; Adafactor's bounded relative-step LR, logged LR and update RMS; safe loading."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from helpers import QUICKSTART_DATA, held_out_loss, trainer_process, write_job

import run
from jobs.job import get_job
from toolkit.config.loader import ConfigError, load_config
from toolkit.config.schema import DatasetConfig
from toolkit.data.dataset import build_dataset, load_pixels
from toolkit.run import checkpoint
from toolkit.run.metrics import read_metrics
from toolkit.train.optimizer_params import OPTIMIZER_PARAMS
from toolkit.train.optimizers import accepted_params
from toolkit.train.optimizers.adafactor import BoundedAdafactor


def job(tmp_path, registry, name, **train):
    process = trainer_process(tmp_path, train={"steps": 12, **train})
    config, path = load_config(str(write_job(tmp_path / f"{name}.yaml", name, process)), registry)
    return get_job(config, path, registry)


@pytest.mark.slow
@pytest.mark.parametrize("name, train", [
    ("adamw", {"optimizer": "adamw", "lr": 3e-3}),
    ("adamw8bit", {"optimizer": "adamw8bit", "lr": 3e-3}),
    ("lion8bit", {"optimizer": "lion8bit", "lr": 3e-4}),
    ("adafactor", {"optimizer": "adafactor", "lr": 0, "optimizer_params": {"max_lr": 3e-3}}),
    ("adafactor_fixed", {"optimizer": "adafactor", "lr": 3e-3, "optimizer_params": {"relative_step": False}}),
])
def test_each_optimizer_lowers_the_held_out_loss(tmp_path, registry, name, train):
    trained = job(tmp_path, registry, name, **train)
    trained.run()
    process = trained.processes[0]
    records = read_metrics(tmp_path / "output" / name / "metrics.jsonl")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    if name == "adamw":  # the run's AdamW is torch's fused one (fp32 on the CPU: nothing stands in its way)
        assert all(group["fused"] for group in process.optimizer.param_groups)
    dataset = build_dataset([DatasetConfig(folder_path=str(QUICKSTART_DATA), resolution=[64])], "shp", 16)
    square = [item for item in dataset.items if item.bucket == (64, 64)]
    pixels = torch.stack([load_pixels(item) for item in square])
    captions = [item.record.caption for item in square]
    unet = process.adapter.unet
    unet.eval()
    after = held_out_loss(process.adapter, unet, pixels, captions)
    unet.disable_adapters()
    before = held_out_loss(process.adapter, unet, pixels, captions)
    assert after < before, (before, after)


def planted_step(optimizer, params, scale):
    for param in params:
        param.grad = torch.full_like(param, scale)
    optimizer.step()


def test_relative_step_lr_stays_within_its_bounds():
    big = torch.nn.Parameter(torch.full((8, 8), 100.0))  # RMS 100: the relative LR would be 1.0
    small = torch.nn.Parameter(torch.full((8, 8), 1e-6))  # RMS ~0: the relative LR would be 1e-5
    optimizer = BoundedAdafactor([big, small], min_lr=1e-4, max_lr=1e-3)
    assert optimizer.get_avg_learning_rate() == 1e-3  # before any step: the bound, never 0 or an error
    for step in range(5):
        before = [p.detach().clone() for p in (big, small)]
        planted_step(optimizer, [big, small], 10.0 ** step)
        lrs = [float(optimizer.state[p]["effective_lr"]) for p in (big, small)]
        assert lrs == pytest.approx([1e-3, 1e-4])
        assert optimizer.get_avg_learning_rate() == pytest.approx(5.5e-4)
        measured = torch.stack([(p.detach() - b).pow(2).mean().sqrt() for p, b in zip((big, small), before)]).mean()
        assert float(optimizer.last_update_rms) == pytest.approx(float(measured), rel=1e-6)


def test_manual_lr_uses_the_configured_lr():
    param = torch.nn.Parameter(torch.ones(4, 4))
    optimizer = BoundedAdafactor([param], lr=5e-3, relative_step=False, scale_parameter=False)
    assert optimizer.get_avg_learning_rate() == 5e-3
    planted_step(optimizer, [param], 1.0)
    assert optimizer.get_avg_learning_rate() == 5e-3


@pytest.mark.slow
def test_metrics_log_adafactor_lr_and_update_rms(tmp_path, registry):
    trained = job(tmp_path, registry, "rms", steps=3, lr=0, optimizer="adafactor", optimizer_params={"max_lr": 1e-3})
    trained.run()
    records = read_metrics(tmp_path / "output" / "rms" / "metrics.jsonl")
    assert all(0 < r["lr"] <= 1e-3 and r["update_rms"] > 0 for r in records)


@pytest.mark.slow
def test_resume_applies_a_new_max_lr(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="difftune")
    process = trainer_process(tmp_path, train={"steps": 3, "lr": 0, "optimizer": "adafactor",
                                               "optimizer_params": {"max_lr": 1e-4}})
    assert run.main([str(write_job(tmp_path / "job.yaml", "bound", process))]) == 0
    process["train"].update(steps=6, optimizer_params={"max_lr": 1e-3})
    assert run.main([str(write_job(tmp_path / "job.yaml", "bound", process))]) == 0
    assert "max_lr 0.0001 -> 0.001" in caplog.text
    lrs = [r["lr"] for r in read_metrics(tmp_path / "output" / "bound" / "metrics.jsonl")]
    assert max(lrs[:3]) <= 1e-4 < min(lrs[3:])


@pytest.mark.parametrize("train, message", [
    ({"optimizer": "adafactor", "lr": 1e-3}, "a manual `lr` is ambiguous"),
    ({"optimizer": "adafactor", "lr_scheduler": "cosine"}, "an LR schedule or warmup would not apply"),
    ({"optimizer": "adamw", "lr": 0}, "`lr` must be above 0"),
    ({"optimizer": "sgd"}, "Input should be 'adamw', 'adamw8bit', 'lion8bit', 'adafactor', 'prodigy' or 'schedulefree_adamw'"),
    ({"optimizer": "adafactor", "optimizer_params": {"max_lrr": 1}}, "max_lrr not accepted by adafactor"),
])
def test_optimizer_choices_are_checked_with_the_config(tmp_path, registry, train, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("`", "`")):
        job(tmp_path, registry, "bad", **train)


def test_optimizer_state_of_another_rank_is_refused_naming_the_parameter():
    def state_for(rank):
        param = torch.nn.Parameter(torch.zeros(rank, 32))
        optimizer = torch.optim.AdamW([param])
        param.grad = torch.ones_like(param)
        optimizer.step()
        return optimizer

    problems = checkpoint.optimizer_problems(state_for(4).state_dict(), state_for(8))
    assert problems == ["parameter 0: optimizer state 'exp_avg' has shape (4, 32) vs (8, 32) now"]
    assert checkpoint.optimizer_problems(state_for(8).state_dict(), state_for(8)) == []


def test_adafactor_without_lr_loads_and_takes_its_defaults(tmp_path, registry):
    process = trainer_process(tmp_path, train={"steps": 2, "optimizer": "adafactor"})
    del process["train"]["lr"]
    config, _ = load_config(str(write_job(tmp_path / "job.yaml", "nolr", process)), registry)
    from toolkit.train.optimizers import build_optimizer

    optimizer = build_optimizer(config.config.process[0].train.optimization, [torch.nn.Parameter(torch.ones(4, 4))])
    assert optimizer.param_groups[0]["relative_step"] and optimizer.param_groups[0]["max_lr"] == 1e-4


def test_8bit_optimizers_explain_when_bitsandbytes_cannot_run(monkeypatch):
    import builtins

    from toolkit.train.optimizers import optimizer_class

    real_import = builtins.__import__

    def no_bitsandbytes(name, *args, **kwargs):
        if name.startswith("bitsandbytes"):
            raise ImportError("no backend for this device")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bitsandbytes)
    with pytest.raises(RuntimeError, match="adamw8bit needs bitsandbytes, which cannot run here .*use optimizer: adamw"):
        optimizer_class("adamw8bit")


@pytest.mark.parametrize("name", sorted(OPTIMIZER_PARAMS))
def test_the_table_of_optimizer_params_is_what_each_optimizer_takes(name):
    """The config checks `optimizer_params` against a table (no optimizer library loads then): it must equal the
    installed optimizer's real keyword arguments."""
    assert OPTIMIZER_PARAMS[name] == accepted_params(name)


@pytest.mark.parametrize("name", sorted(OPTIMIZER_PARAMS))
def test_every_optimizer_param_has_a_value_rule_its_own_default_passes(name):
    """Values are checked with the config too (a wrong one used to fail in the optimizer's constructor, after the
    model had loaded). The rules are held against the installed optimizer: the default of every keyword it takes
    (the wrapper's and transformers' Adafactor's both) passes its rule, so a rule cannot refuse what the library
    takes by default."""
    import inspect

    from toolkit.train.optimizer_params import optimizer_param_problems
    from toolkit.train.optimizers import optimizer_class

    signatures = [inspect.signature(optimizer_class(name)).parameters]
    if name == "adafactor":
        from transformers.optimization import Adafactor

        signatures.append(inspect.signature(Adafactor).parameters)
    defaults = {key: parameter.default for parameters in signatures for key, parameter in parameters.items()
                if key in OPTIMIZER_PARAMS[name] and parameter.default is not inspect.Parameter.empty}
    assert defaults, name
    for key, value in defaults.items():
        assert optimizer_param_problems(name, {key: value}) == [], (key, value)


@pytest.mark.parametrize("name, params, message", [
    ("adamw", {"betas": "0.9"}, "optimizer_params.betas` of adamw must be two numbers in [0, 1)"),
    ("adamw", {"betas": [0.9, 1.5]}, "must be two numbers in [0, 1)"),
    ("adamw", {"weight_decay": -1}, "optimizer_params.weight_decay` of adamw must be a number >= 0"),
    ("adamw", {"amsgrad": "yes"}, "must be true or false"),
    ("adafactor", {"eps": 1e-8}, "Adafactor's eps is a pair"),
    ("prodigy", {"d_coef": 0}, "must be a number > 0"),
    ("schedulefree_adamw", {"warmup_steps": 2.5}, "must be an integer >= 0"),
])
def test_wrong_optimizer_param_values_are_refused_with_the_config(name, params, message):
    from toolkit.config.sections import TrainConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(steps=10, optimizer=name, optimizer_params=params, lr=1.0 if name == "prodigy" else 1e-4)


def adamw(**optimizer_params):
    from toolkit.config.schema import TrainConfig

    return TrainConfig(steps=1, optimizer="adamw", optimizer_params=optimizer_params).optimization


def test_adamw_is_torchs_fused_step_unless_the_config_or_a_grad_scaler_decides():
    """The fused AdamW makes the same updates as torch's per-parameter one; it is not chosen where the config picks
    an implementation, asks for `differentiable`, an fp16 GradScaler scales the loss (accelerate could not tell a
    skipped step), or a parameter lives where torch has no fused kernels."""
    from toolkit.train.optimizers import build_optimizer

    start = [torch.randn(8, 4), torch.randn(4)]
    fused_params, plain_params = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    fused = build_optimizer(adamw(weight_decay=0.01), [{"params": fused_params[:1]}, {"params": fused_params[1:]}])
    plain = torch.optim.AdamW(plain_params, lr=1e-4, weight_decay=0.01)
    assert all(group["fused"] for group in fused.param_groups) and not plain.param_groups[0]["fused"]
    for step in range(5):
        grads = [torch.randn_like(t) * (step + 1) for t in start]
        for params, optimizer in ((fused_params, fused), (plain_params, plain)):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            optimizer.step()
    for ours, theirs in zip(fused_params, plain_params):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
        assert not torch.equal(ours, start[0] if ours.dim() == 2 else start[1])

    param = [torch.nn.Parameter(torch.ones(2))]
    for section, kwargs in ((adamw(foreach=True), {}), (adamw(fused=False), {}), (adamw(fused=None), {}),
                            (adamw(differentiable=True), {}), (adamw(), {"loss_scaled": True})):
        assert not build_optimizer(section, param, **kwargs).param_groups[0]["fused"], (section, kwargs)
    assert not build_optimizer(adamw(), [torch.nn.Parameter(torch.ones(2, device="meta"))]).param_groups[0]["fused"]
    assert build_optimizer(adamw(fused=True), param).param_groups[0]["fused"]


def test_a_checkpoint_of_the_other_adamw_implementation_resumes_with_its_step_counts_where_the_step_reads_them():
    """A checkpoint of torch's per-parameter AdamW (host step counts) loads into the fused one, silently, and steps
    on; loaded into a fused group, its counts go to the parameters' device, where the fused step reads them (torch
    leaves them where the saving optimizer kept them)."""
    from toolkit.train.optimizers import build_optimizer

    param = torch.nn.Parameter(torch.ones(3))
    before = torch.optim.AdamW([param], lr=1e-2)
    for _ in range(3):
        param.grad = torch.ones(3)
        before.step()
    resumed = build_optimizer(adamw(), [param])
    assert resumed.param_groups[0]["fused"]
    changes = checkpoint.load_optimizer_keeping_hyperparameters(resumed, before.state_dict())
    assert changes == []  # the implementation is not a setting the user changed: nothing to report
    assert resumed.param_groups[0]["fused"] and resumed.state[param]["step"].item() == 3
    param.grad = torch.ones(3)
    resumed.step()
    assert resumed.state[param]["step"].item() == 4

    # where the implementations keep their counts apart: a parameter on "meta" stands for an accelerator's
    on_meta = torch.nn.Parameter(torch.ones(3, device="meta"))
    fused_on_meta = torch.optim.AdamW([on_meta], fused=True)  # torch checks the device at the first step only
    checkpoint.load_optimizer_keeping_hyperparameters(fused_on_meta, before.state_dict())
    step = fused_on_meta.state[on_meta]["step"]
    assert step.device.type == "meta" and step.dtype == torch.float32
    assert fused_on_meta.state[on_meta]["exp_avg"].device.type == "meta"
