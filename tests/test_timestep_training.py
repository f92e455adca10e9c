"""Timestep samplers and loss options inside real training runs on the tiny model."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDPMScheduler
from helpers import make_images, trainer_process, write_job

from jobs.job import get_job
from toolkit.config.loader import load_config
from toolkit.diffusion.schedules import DDPMNoiseSchedule, FlowMatchNoiseSchedule, WuerstchenNoiseSchedule
from toolkit.errors import UserError
from toolkit.run.metrics import read_metrics


def test_u_maps_monotonically_into_each_familys_timesteps():
    u = torch.linspace(1e-6, 1 - 1e-6, 1001)
    ddpm = DDPMNoiseSchedule(DDPMScheduler(num_train_timesteps=1000))
    flow = FlowMatchNoiseSchedule()
    wuerstchen = WuerstchenNoiseSchedule()
    for schedule, low, high in ((ddpm, 0, 999), (flow, 0, 1000), (wuerstchen, 0, 1)):
        t = schedule.timesteps(u)
        assert (t[1:] >= t[:-1]).all() and t.min() >= low and t.max() <= high
        snr = schedule.snr(t)
        assert (snr[1:] <= snr[:-1] + 1e-6).all()  # more noise, lower SNR
    assert torch.allclose(flow.sigmas(flow.timesteps(u)), u)
    assert wuerstchen.timesteps(u).max() < 1


def run(tmp_path, registry, name, data, **train):
    logging = train.pop("logging", None)
    process = trainer_process(tmp_path, train=train, datasets=[{"folder_path": str(data), "resolution": [32]}])
    if logging:
        process["logging"] = logging
    config, path = load_config(str(write_job(tmp_path / f"{name}.yaml", name, process)), registry)
    job = get_job(config, path, registry)
    job.run()
    return read_metrics(tmp_path / "output" / name / "metrics.jsonl")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("small") / "data", 4, size=(32, 32))


@pytest.mark.slow
def test_blank_prompt_term_starts_at_zero_then_grows(tmp_path, registry, small_data):
    records = run(tmp_path, registry, "bpp", small_data, steps=6, lr=1e-2, blank_prompt_preservation=True)
    assert records[0]["loss_bpp"] < 1e-10  # a zero-initialised LoRA changes nothing
    assert records[-1]["loss_bpp"] > 1e-8
    assert all(r["loss"] == pytest.approx(r["loss_main"] + r["loss_bpp"], rel=1e-5) for r in records)


def blank_prompt_draws(probability: float, updates: int, seed: int = 42) -> list[bool]:
    """Which updates compute the blank-prompt term: the objective's own rule, a pure function of (seed, update)."""
    from types import SimpleNamespace

    from toolkit.config.sections import ObjectiveSection
    from toolkit.train.objective import DiffusionObjective

    section = ObjectiveSection(blank_prompt_preservation=True, blank_prompt_probability=probability)
    owner = SimpleNamespace(cfg=section, seed=seed)
    return [DiffusionObjective.blank_prompt_due(owner, index) for index in range(updates)]


def test_blank_prompt_probability_is_the_share_of_updates_drawn():
    share = sum(blank_prompt_draws(0.3, 4000)) / 4000
    assert share == pytest.approx(0.3, abs=0.02)
    assert blank_prompt_draws(0.3, 50) == blank_prompt_draws(0.3, 50)  # the same on any rerun or process count


@pytest.mark.slow
def test_the_trainer_computes_the_blank_prompt_term_on_exactly_the_drawn_updates(tmp_path, registry, small_data):
    records = run(tmp_path, registry, "share", small_data, steps=24, batch_size=1,  # the draw is per update
                  blank_prompt_preservation=True, blank_prompt_probability=0.3)
    assert ["loss_bpp" in r for r in records] == blank_prompt_draws(0.3, 24)
    assert 0 < sum("loss_bpp" in r for r in records) < 24


@pytest.mark.slow
def test_differential_guidance_scales_the_gradient(tmp_path, registry, small_data):
    plain = run(tmp_path, registry, "plain", small_data, steps=1, max_grad_norm=0)
    guided = run(tmp_path, registry, "guided", small_data, steps=1, max_grad_norm=0, differential_guidance_scale=2.0)
    assert guided[0]["grad_norm"] == pytest.approx(2 * plain[0]["grad_norm"], rel=1e-4)
    assert "loss_diff_guidance" in guided[0] and "loss_main" in plain[0]


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {"timestep_type": "sigmoid", "min_snr_gamma": 5.0, "loss_type": "pseudo_huber"},
    {"timestep_type": "weighted", "loss_type": "mae", "noise_offset": 0.05},
    {"timestep_type": "gaussian", "timestep_params": {"gaussian_std_start": 0.3, "gaussian_std_end": 0.05}},
    {"timestep_type": "fixed_cycle", "timestep_params": {"cycle": [0.9, 0.5, 0.1]}, "content_or_style": "style"},
    {"timestep_type": "shift", "timestep_params": {"shift": 3.0}, "timestep_range": [0.2, 0.8]},
])
def test_sampler_and_loss_options_train(tmp_path, registry, small_data, options):
    records = run(tmp_path, registry, "opt", small_data, steps=3, **options)
    assert len(records) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)


@pytest.mark.slow
def test_debug_timesteps_histogram_every_logged_update(tmp_path, registry, small_data):
    records = run(tmp_path, registry, "debug", small_data, steps=6, batch_size=2,
                  logging={"log_every": 3, "debug_timesteps": True})
    assert [r["step"] for r in records] == [3, 6]
    for record in records:
        assert len(record["timestep_hist"]) == 10 and sum(record["timestep_hist"]) == 3 * 2
        assert all(m is None or m > 0 for m in record["timestep_bin_loss"])
    plain = run(tmp_path, registry, "nodebug", small_data, steps=2)
    assert "timestep_hist" not in plain[0]


@pytest.mark.slow
def test_fixed_cycle_uses_one_value_per_update(tmp_path, registry, small_data):
    records = run(tmp_path, registry, "cycle", small_data, steps=3, batch_size=2,
                  timestep_type="fixed_cycle", timestep_params={"cycle": [0.95, 0.45, 0.05]},
                  logging={"debug_timesteps": True})
    bins = [r["timestep_hist"].index(2) for r in records]
    assert bins == [9, 4, 0]


@pytest.mark.slow
def test_dynamic_shift_on_a_ddpm_family_is_a_clear_error(tmp_path, registry, small_data):
    with pytest.raises(UserError, match="dynamic_shift: the sd15 scheduler defines no base/max shift"):
        run(tmp_path, registry, "dyn", small_data, steps=1, timestep_type="shift",
            timestep_params={"dynamic_shift": True})
