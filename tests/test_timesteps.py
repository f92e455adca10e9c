"""Timestep samplers: each draws the distribution docs/timesteps.md documents, from an explicit generator.

Distribution checks compare 20k draws against the documented closed-form CDF: at the 5/25/50/75/95 %
empirical quantiles the CDF must read the quantile's level, and the sample mean must match
mean = integral_0^1 (1 - F(x)) dx.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from toolkit.diffusion.timestep_params import TimestepParams
from toolkit.diffusion.timesteps import (
    TIMESTEP_TYPES,
    ShiftSchedule,
    bell_weight,
    dynamic_shift,
    gaussian_std_at,
    main,
    sample_timestep_u,
    sample_uniform,
    shift_u,
)

N = 20_000
LEVELS = (0.05, 0.25, 0.5, 0.75, 0.95)
DOC = Path(__file__).resolve().parents[1] / "docs" / "timesteps.md"


def draw(kind: str, params: TimestepParams = TimestepParams(), seed: int = 0, n: int = N, **options):
    return sample_timestep_u(kind, params, n, torch.Generator().manual_seed(seed), **options)


def phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def mean_of_cdf(cdf) -> float:
    steps = 20_000
    return sum(1.0 - cdf((i + 0.5) / steps) for i in range(steps)) / steps


def assert_matches_cdf(u: torch.Tensor, cdf, cdf_tol: float = 0.015, mean_tol: float = 0.006) -> None:
    for level in LEVELS:
        q = torch.quantile(u.double(), level).item()
        assert abs(cdf(q) - level) < cdf_tol, f"CDF at the {level:.0%} quantile {q:.4f} reads {cdf(q):.4f}"
    assert abs(u.double().mean().item() - mean_of_cdf(cdf)) < mean_tol


def truncated_normal_cdf(mean: float, std: float):
    lo, hi = phi(-mean / std), phi((1.0 - mean) / std)
    return lambda x: (phi((x - mean) / std) - lo) / (hi - lo)


def truncated_normal_std(mean: float, std: float) -> float:
    a, b = -mean / std, (1.0 - mean) / std
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    z = phi(b) - phi(a)
    var = 1 + (a * pdf(a) - b * pdf(b)) / z - ((pdf(a) - pdf(b)) / z) ** 2
    return std * math.sqrt(var)


def lognorm_blend_cdf(x: float) -> float:
    # documented: 0.75 * [u = 1 - exp((z - 3)/3), z ~ N(0,1) cut at z < 3] + 0.25 * Uniform(0, 1)
    z_at = 3.0 + 3.0 * math.log(1.0 - x) if x < 1 else -math.inf
    lognormal = (phi(3.0) - phi(z_at)) / phi(3.0)
    return 0.75 * lognormal + 0.25 * x


# --- each sampler draws its documented distribution ----------------------------------------------------


def test_uniform_draws_uniform():
    assert_matches_cdf(draw("uniform").u, lambda x: x)


def test_uniform_kind_equals_legacy_sample_uniform_so_switching_keeps_runs_identical():
    legacy = sample_uniform(64, torch.Generator().manual_seed(5))
    assert torch.equal(draw("uniform", seed=5, n=64).u, legacy)


def test_sigmoid_is_logit_normal_with_mean_and_std():
    mean, std = -0.5, 1.3
    cdf = lambda x: phi((math.log(x / (1 - x)) - mean) / std)  # noqa: E731
    assert_matches_cdf(draw("sigmoid", TimestepParams(mean=mean, std=std)).u, cdf)


def test_sigmoid_mean_defaults_to_zero_in_logit_space():
    assert abs(torch.median(draw("sigmoid").u).item() - 0.5) < 0.01


def test_lognorm_blend_is_the_documented_mixture():
    assert_matches_cdf(draw("lognorm_blend").u, lognorm_blend_cdf)


def test_shift_moves_uniform_draws_by_the_time_shift():
    s = 3.0
    u = draw("shift", TimestepParams(shift=s)).u
    assert_matches_cdf(u, lambda x: x / (s - (s - 1) * x))  # inverse of s*u / (1 + (s-1) u)
    assert abs(u.mean().item() - s / (s - 1) * (1 - math.log(s) / (s - 1))) < 0.006


def test_shift_u_equals_diffusers_exponential_time_shift():
    from diffusers import FlowMatchEulerDiscreteScheduler

    t = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    mu = 0.8
    expected = FlowMatchEulerDiscreteScheduler()._time_shift_exponential(mu, 1.0, t)
    torch.testing.assert_close(shift_u(t, math.exp(mu)), expected)


def test_dynamic_shift_is_exp_of_diffusers_calculate_shift():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    for seq_len, args in [(256, ()), (4096, ()), (1024, ()), (2304, (0.4, 1.3, 128, 8192))]:
        expected = math.exp(calculate_shift(seq_len, *_diffusers(args)))
        assert dynamic_shift(seq_len, *args) == pytest.approx(expected)
    assert dynamic_shift(256) == pytest.approx(math.exp(0.5))  # base length -> base_shift
    assert dynamic_shift(4096) == pytest.approx(math.exp(1.15))  # max length -> max_shift


def _diffusers(args: tuple) -> tuple:
    # ours: (base_shift, max_shift, base_len, max_len); diffusers: (base_len, max_len, base_shift, max_shift)
    return (args[2], args[3], args[0], args[1]) if args else ()


def test_shift_schedule_reads_the_flow_scheduler_config():
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = FlowMatchEulerDiscreteScheduler(base_shift=0.3, max_shift=1.2, max_image_seq_len=8192).config
    schedule = ShiftSchedule.from_scheduler_config(config)
    assert schedule == ShiftSchedule(0.3, 1.2, 256, 8192)
    assert schedule.shift_for(1024) == pytest.approx(dynamic_shift(1024, 0.3, 1.2, 256, 8192))


def test_dynamic_shift_sampler_uses_the_image_sequence_length():
    schedule = ShiftSchedule()
    dynamic = draw("shift", TimestepParams(dynamic_shift=True), n=256, image_seq_len=1024,
                   shift_schedule=schedule)
    static = draw("shift", TimestepParams(shift=schedule.shift_for(1024)), n=256)
    torch.testing.assert_close(dynamic.u, static.u)
    with pytest.raises(ValueError, match="image_seq_len"):
        draw("shift", TimestepParams(dynamic_shift=True), n=4)


@pytest.mark.parametrize("pixels, shift", [(512, 1.8776), (768, 2.3319), (1024, 3.1582)])
def test_the_sigmoid_based_dynamic_shift_is_kohyas_flux_shift(pixels, shift):
    """kohya sd-scripts' FLUX.1 `flux_shift` (library/flux_train_utils.py): s = sigmoid(sigmoid_scale * randn),
    mu = 0.5 + (1.15 - 0.5) (L - 256) / (4096 - 256) with L = (h // 2) (w // 2) of the latent, sigma =
    e^mu / (e^mu + 1/s - 1). difftune's shift with shift_base sigmoid and dynamic_shift draws the same sigma from the
    same generator, at the shifts kohya's docs quote (3.1582 at 1024 px); its `shift` is the same with a fixed s."""
    latent = pixels // 8
    seq_len = (latent // 2) * (latent // 2)
    scale = 1.3
    ours = draw("shift", TimestepParams(dynamic_shift=True, shift_base="sigmoid", std=scale), n=4096,
                image_seq_len=seq_len, shift_schedule=ShiftSchedule()).u
    generator = torch.Generator().manual_seed(0)
    s = torch.sigmoid(scale * torch.randn(4096, generator=generator))
    mu = 0.5 + (1.15 - 0.5) * (seq_len - 256) / (4096 - 256)
    kohya = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    torch.testing.assert_close(ours, kohya.clamp(1e-6, 1 - 1e-6), rtol=1e-6, atol=1e-6)
    assert math.exp(mu) == pytest.approx(shift, abs=1e-4)
    fixed = draw("shift", TimestepParams(shift=3.0, shift_base="sigmoid", std=scale), n=4096).u
    torch.testing.assert_close(fixed, (3.0 * s / (1 + 2.0 * s)).clamp(1e-6, 1 - 1e-6), rtol=1e-6, atol=1e-6)
    uniform = draw("shift", TimestepParams(dynamic_shift=True), n=4096, image_seq_len=seq_len,
                   shift_schedule=ShiftSchedule()).u
    assert not torch.allclose(uniform, ours, atol=1e-2)  # the base draw matters


def test_weighted_draws_uniform_with_bell_weights_that_average_to_one():
    result = draw("weighted")
    assert_matches_cdf(result.u, lambda x: x)
    assert result.loss_weight.shape == (N,)
    assert abs(result.loss_weight.mean().item() - 1.0) < 0.01
    grid = (torch.arange(1_000_000, dtype=torch.float64) + 0.5) / 1_000_000
    assert bell_weight(grid).double().mean().item() == pytest.approx(1.0, abs=1e-6)  # exact, not sampled
    ends = bell_weight(torch.tensor([0.0, 0.5, 1.0]))
    assert ends[0].item() == pytest.approx(0.0, abs=1e-6) and ends[2].item() == pytest.approx(0.0, abs=1e-6)
    assert ends[1].item() == pytest.approx(1.5795, abs=1e-3)


def test_weighted_weights_keep_mean_one_under_bias_and_range():
    result = draw("weighted", content_or_style="content", timestep_range=(0.2, 0.9))
    assert abs(result.loss_weight.mean().item() - 1.0) < 0.01


def test_only_weighted_returns_a_loss_weight():
    for kind in TIMESTEP_TYPES:
        weight = draw(kind, TimestepParams(cycle=(0.5,)), n=8).loss_weight
        assert (weight is not None) == (kind == "weighted"), kind


def test_gaussian_is_a_normal_truncated_to_the_unit_interval():
    mean, std = 0.3, 0.2
    u = draw("gaussian", TimestepParams(mean=mean, gaussian_std=std)).u
    assert_matches_cdf(u, truncated_normal_cdf(mean, std))
    assert (u < 0.01).float().mean().item() < 0.02  # truncated, not clamped: no pile at the edge


def test_gaussian_curriculum_std_moves_linearly_with_progress():
    params = TimestepParams(gaussian_std_start=0.1, gaussian_std_end=0.3)
    for progress, nominal in [(0.0, 0.1), (0.5, 0.2), (1.0, 0.3)]:
        assert gaussian_std_at(progress, params) == pytest.approx(nominal)
        measured = draw("gaussian", params, progress=progress).u.double().std().item()
        assert measured == pytest.approx(truncated_normal_std(0.5, nominal), rel=0.03), progress
    assert gaussian_std_at(0.7, TimestepParams(gaussian_std=0.15)) == 0.15  # no curriculum: fixed std


def test_fixed_cycle_visits_the_values_in_order_one_per_update():
    params = TimestepParams(cycle=[0.9, 0.5, 0.1])
    seen = [draw("fixed_cycle", params, n=3, update_index=i).u for i in range(7)]
    assert all(torch.all(u == u[0]) for u in seen)  # one value for the whole batch
    assert [round(u[0].item(), 6) for u in seen] == [0.9, 0.5, 0.1, 0.9, 0.5, 0.1, 0.9]


def test_fixed_cycle_continues_after_a_simulated_resume():
    params = TimestepParams(cycle=(0.8, 0.6, 0.4, 0.2))
    uninterrupted = [draw("fixed_cycle", params, n=2, update_index=i).u for i in range(11)]
    # a resumed run knows only the update index it restarts at, and gets a fresh generator
    fresh = torch.Generator().manual_seed(999)
    resumed = [sample_timestep_u("fixed_cycle", params, 2, fresh, update_index=i).u for i in range(6, 11)]
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[6:], resumed))


# --- content_or_style and timestep_range on top of any sampler -------------------------------------------

BASES = [("uniform", TimestepParams()), ("sigmoid", TimestepParams()), ("lognorm_blend", TimestepParams()),
         ("shift", TimestepParams()), ("weighted", TimestepParams()), ("gaussian", TimestepParams())]


@pytest.mark.parametrize("kind,params", BASES)
def test_content_has_more_mass_at_high_noise_and_style_less(kind, params):
    above = {mode: (draw(kind, params, content_or_style=mode).u > 0.5).float().mean().item()
             for mode in ("balanced", "content", "style")}
    assert above["content"] > above["balanced"] + 0.05 > above["style"] + 0.1


def test_content_and_style_are_the_documented_cubic_maps():
    assert_matches_cdf(draw("uniform", content_or_style="content").u, lambda x: 1 - (1 - x) ** (1 / 3))
    assert_matches_cdf(draw("uniform", content_or_style="style").u, lambda x: x ** (1 / 3))


@pytest.mark.parametrize("kind,params", BASES + [("fixed_cycle", TimestepParams(cycle=(0.95, 0.05)))])
@pytest.mark.parametrize("mode", ["balanced", "content", "style"])
def test_timestep_range_limits_hold(kind, params, mode):
    lo, hi = 0.2, 0.7
    draws = [draw(kind, params, n=2000, content_or_style=mode, timestep_range=(lo, hi), update_index=i).u
             for i in range(2)]
    u = torch.cat(draws)
    assert lo < u.min().item() and u.max().item() < hi


def test_timestep_range_rescales_instead_of_clipping():
    lo, hi = 0.2, 0.7
    u = draw("uniform", timestep_range=[lo, hi]).u
    assert_matches_cdf(u, lambda x: min(max((x - lo) / (hi - lo), 0.0), 1.0))
    # within 1e-3 of each edge the flat density puts 0.2 % of the draws (40); a clip would put thousands
    for edge in (lo, hi):
        assert ((u - edge).abs() < 1e-3).sum().item() < 100


def test_draws_stay_inside_the_open_unit_interval_for_extreme_parameters():
    cases = [("sigmoid", TimestepParams(std=30.0), "balanced"),
             ("gaussian", TimestepParams(gaussian_std=5.0), "style"),
             ("shift", TimestepParams(shift=50.0), "content"),
             ("lognorm_blend", TimestepParams(), "content"),
             ("uniform", TimestepParams(), "style")]
    for kind, params, mode in cases:
        u = draw(kind, params, content_or_style=mode).u
        assert 0.0 < u.min().item() and u.max().item() < 1.0, (kind, mode)
        assert u.dtype == torch.float32


def test_same_seed_gives_the_same_draws():
    for kind in TIMESTEP_TYPES:
        params = TimestepParams(cycle=(0.5,))
        assert torch.equal(draw(kind, params, seed=3, n=32).u, draw(kind, params, seed=3, n=32).u), kind


@pytest.mark.parametrize("call,message", [
    (lambda: draw("cosine", n=2), "timestep_type"),
    (lambda: draw("uniform", n=2, content_or_style="texture"), "content_or_style"),
    (lambda: draw("uniform", n=2, timestep_range=(0.6, 0.4)), "timestep_range"),
    (lambda: draw("uniform", n=2, timestep_range=(-0.1, 0.4)), "timestep_range"),
    (lambda: draw("fixed_cycle", n=2), "cycle"),
    (lambda: TimestepParams(cycle=(0.5, 1.0)), r"cycle\[1\]"),
    (lambda: TimestepParams(gaussian_std_start=0.1), "gaussian_std_end"),
    (lambda: TimestepParams(std=0.0, shift=-1.0), "std.*shift"),
    (lambda: draw("gaussian", n=2, progress=1.5), "progress"),
])
def test_bad_parameters_raise_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- the density plot in docs/timesteps.md --------------------------------------------------------------


def test_density_plot_has_one_40_bin_line_per_sampler():
    lines = main(n=5000).splitlines()
    for kind in TIMESTEP_TYPES:
        assert any(line.startswith(kind) for line in lines), kind
    assert all(len(line.split("|")[1]) == 40 for line in lines)


def test_docs_show_the_current_density_plot():
    assert main() in DOC.read_text(encoding="utf-8"), "regenerate with: python -m toolkit.diffusion.timesteps"
