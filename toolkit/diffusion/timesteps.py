"""Timestep samplers: draw u in (0, 1) per sample; each model family maps u to its own timestep.

Convention: u near 1 is high noise (pure noise at 1), u near 0 is almost clean. SD maps u to an integer
DDPM t, flow matching to sigma = u, Wuerstchen to its continuous t.

One draw of `sample_timestep_u` is, in order:
  1. the sampler (`timestep_type`) draws u, and for `weighted` a loss weight per sample;
  2. `content_or_style` bends u with a monotone map (T2I-Adapter's cubic sampling);
  3. a guard keeps u inside [EPS, 1 - EPS] against float rounding (sigmoid(20) is 1.0 in float32);
  4. `timestep_range` rescales u linearly into [min, max]; rescaling, not clipping, keeps the shape and
     piles no mass on the edges.
Every draw comes from the explicit CPU generator passed in, so a step's draws are a pure function of
that generator's seed (see toolkit/train/seeding.py).

`python -m toolkit.diffusion.timesteps` prints the density of every sampler (docs/timesteps.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch

from toolkit.diffusion.timestep_params import TimestepParams

TimestepType = Literal["uniform", "sigmoid", "lognorm_blend", "shift", "weighted", "gaussian", "fixed_cycle"]
ContentOrStyle = Literal["balanced", "content", "style"]
TIMESTEP_TYPES: tuple[str, ...] = get_args(TimestepType)
CONTENT_OR_STYLE: tuple[str, ...] = get_args(ContentOrStyle)

#: draws are kept in [EPS, 1 - EPS]; float32 still resolves 1 - 1e-6 (its spacing near 1 is 6e-8). The guard
#: moves only draws within 1e-6 of an end (e.g. 1 % of `style`'s u^3), where every family's timestep is
#: already at its extreme, so it changes no training signal.
EPS = 1e-6

# lognorm_blend constants (ai-toolkit's blend): 75 % log-normal with log-std 1/3, 25 % uniform
LOGNORM_FRACTION = 0.75
LOGNORM_SIGMA = 1.0 / 3.0
LOGNORM_Z_MAX = 3.0  # the log-normal is cut at its 3-sigma point, which maps to u = 0

# weighted: bell b(u) = exp(-2 (u - 1/2)^2), lowered to 0 at the ends and divided by its mean on (0, 1)
_BELL_FLOOR = math.exp(-0.5)
_BELL_MEAN = math.sqrt(math.pi / 2.0) * math.erf(1.0 / math.sqrt(2.0)) - _BELL_FLOOR


class TimestepDraw(NamedTuple):
    """u per sample, and a loss weight per sample where the sampler defines one (else None)."""

    u: torch.Tensor
    loss_weight: torch.Tensor | None


@dataclass(frozen=True)
class ShiftSchedule:
    """A flow-matching scheduler's dynamic-shift line (diffusers' FlowMatchEulerDiscreteScheduler keys)."""

    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096

    @classmethod
    def from_scheduler_config(cls, config: Mapping) -> ShiftSchedule:
        """Read the four keys from a diffusers scheduler config; missing keys take diffusers' defaults."""
        return cls(**{k: config[k] for k in cls.__dataclass_fields__ if config.get(k) is not None})

    def shift_for(self, image_seq_len: int) -> float:
        return dynamic_shift(image_seq_len, self.base_shift, self.max_shift,
                             self.base_image_seq_len, self.max_image_seq_len)


# --- samplers: each returns u of shape [batch] in float32 -------------------------------------------


def sample_uniform(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(batch_size, generator=generator)


def sample_sigmoid(batch_size: int, generator: torch.Generator, mean: float = 0.0,
                   std: float = 1.0) -> torch.Tensor:
    """Logit-normal (SD3): u = sigmoid(mean + std * z), z ~ N(0, 1)."""
    return torch.sigmoid(mean + std * torch.randn(batch_size, generator=generator))


def sample_lognorm_blend(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """75 % log-normal, 25 % uniform, chosen per sample.

    Log-normal part: x = exp(z / 3) with z ~ N(0, 1) cut at z < 3, scaled by its cut-off and reversed,
    u = 1 - x / e = 1 - exp((z - 3) / 3): median 1 - 1/e = 0.632, most mass on mid-to-high noise
    (ai-toolkit's 1 - x / max(x) with the batch max replaced by a fixed 3-sigma point, so draws are
    per sample and do not depend on the batch). The cut is drawn exactly, by inverse CDF, not clipped.
    """
    cut = torch.special.ndtr(torch.tensor(LOGNORM_Z_MAX, dtype=torch.float64))
    z = torch.special.ndtri(torch.rand(batch_size, generator=generator, dtype=torch.float64) * cut)
    lognormal = 1.0 - torch.exp(LOGNORM_SIGMA * (z - LOGNORM_Z_MAX))
    uniform = torch.rand(batch_size, generator=generator, dtype=torch.float64)
    pick = torch.rand(batch_size, generator=generator) < LOGNORM_FRACTION
    return torch.where(pick, lognormal, uniform).float()


def shift_u(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Flow-matching time shift (SD3, Flux): u -> shift*u / (1 + (shift - 1)*u); shift > 1 adds noise."""
    return shift * u / (1.0 + (shift - 1.0) * u)


def dynamic_shift(image_seq_len: int, base_shift: float = 0.5, max_shift: float = 1.15,
                  base_image_seq_len: int = 256, max_image_seq_len: int = 4096) -> float:
    """exp(mu), mu linear in the image sequence length, exactly as diffusers' `calculate_shift`.

    mu = m * image_seq_len + b with m = (max_shift - base_shift) / (max_len - base_len) and
    b = base_shift - m * base_len. The image sequence length is the number of latent patches,
    (latent_h / patch) * (latent_w / patch). Using shift = exp(mu) in `shift_u` equals diffusers'
    `time_shift(mu, 1.0, t)`.
    """
    m = (max_shift - base_shift) / (max_image_seq_len - base_image_seq_len)
    b = base_shift - m * base_image_seq_len
    return math.exp(image_seq_len * m + b)


def sample_shift(batch_size: int, generator: torch.Generator, shift: float, base: str = "uniform",
                 mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Uniform draws, or the sigmoid sampler's logit-normal ones (`base`), moved by the time shift. The sigmoid
    base with the dynamic shift is kohya's `flux_shift`, with a fixed one its `shift`."""
    u = sample_sigmoid(batch_size, generator, mean, std) if base == "sigmoid" else sample_uniform(batch_size,
                                                                                                  generator)
    return shift_u(u, shift)


def bell_weight(u: torch.Tensor) -> torch.Tensor:
    """Loss weight w(u) = (exp(-2 (u - 1/2)^2) - exp(-1/2)) / Z, Z = sqrt(pi/2) erf(1/sqrt 2) - exp(-1/2).

    ai-toolkit's `weighted` bell in closed form: 0 at u = 0 and u = 1, 1.58 at u = 1/2, and exactly
    mean 1 for u ~ Uniform(0, 1) (Z = 0.2491 is its integral), so the loss scale is unchanged.
    """
    return (torch.exp(-2.0 * (u.float() - 0.5) ** 2) - _BELL_FLOOR) / _BELL_MEAN


def sample_weighted(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform draws; the bell lives in the loss weight, not in where the timesteps fall."""
    u = sample_uniform(batch_size, generator)
    return u, bell_weight(u)


def gaussian_std_at(progress: float, params: TimestepParams) -> float:
    """gaussian_std, or the curriculum std: start + (end - start) * progress, progress in [0, 1]."""
    if params.gaussian_std_start is None or params.gaussian_std_end is None:
        return params.gaussian_std
    return params.gaussian_std_start + (params.gaussian_std_end - params.gaussian_std_start) * progress


def sample_gaussian(batch_size: int, generator: torch.Generator, mean: float = 0.5,
                    std: float = 0.2) -> torch.Tensor:
    """Normal(mean, std) truncated to (0, 1), drawn by inverse CDF.

    Truncating (redrawing the tails) rather than clamping keeps the density smooth at 0 and 1, where a
    clamp would pile the tails onto the two extreme timesteps.
    """
    lo, hi = torch.special.ndtr(torch.tensor([(0.0 - mean) / std, (1.0 - mean) / std], dtype=torch.float64))
    v = lo + (hi - lo) * torch.rand(batch_size, generator=generator, dtype=torch.float64)
    return (mean + std * torch.special.ndtri(v)).float()


def fixed_cycle_u(cycle: Sequence[float], update_index: int, batch_size: int) -> torch.Tensor:
    """cycle[update_index % len(cycle)] for the whole batch: a pure function of the update index, so a
    resumed run continues the cycle where it stopped, and all micro-batches of one update share the value."""
    if not cycle:
        raise ValueError("timestep_type 'fixed_cycle' needs a non-empty timestep_params.cycle")
    return torch.full((batch_size,), float(cycle[update_index % len(cycle)]))


# --- modifiers applied on top of any sampler ---------------------------------------------------------


def bias_content_or_style(u: torch.Tensor, mode: ContentOrStyle) -> torch.Tensor:
    """T2I-Adapter's cubic sampling (arXiv 2302.08453, sec. 3.4), as a monotone map of u.

    balanced: u; content: 1 - (1 - u)^3 (toward high noise, composition); style: u^3 (toward low
    noise, texture). On uniform u, content puts 79.4 % of the mass above 0.5 and style 20.6 %.
    """
    if mode == "balanced":
        return u
    if mode == "content":
        return 1.0 - (1.0 - u) ** 3
    if mode == "style":
        return u**3
    raise ValueError(f"content_or_style must be one of {CONTENT_OR_STYLE}, got {mode!r}")


def apply_timestep_range(u: torch.Tensor, timestep_range: Sequence[float]) -> torch.Tensor:
    """Rescale u from (0, 1) into (min, max): u -> min + (max - min) * u."""
    lo, hi = (float(x) for x in timestep_range)
    if not 0.0 <= lo < hi <= 1.0:
        got = list(timestep_range)
        raise ValueError(f"timestep_range must be [min, max] with 0 <= min < max <= 1, got {got}")
    if (lo, hi) == (0.0, 1.0):
        return u  # 0 + 1 x u, exactly
    return lo + (hi - lo) * u


# --- the entry point ----------------------------------------------------------------------------------


def sample_timestep_u(
    kind: TimestepType,
    params: TimestepParams,
    batch_size: int,
    generator: torch.Generator,
    *,
    content_or_style: ContentOrStyle = "balanced",
    timestep_range: Sequence[float] = (0.0, 1.0),
    progress: float = 0.0,
    update_index: int = 0,
    image_seq_len: int | None = None,
    shift_schedule: ShiftSchedule | None = None,
) -> TimestepDraw:
    """Draw u in (0, 1) per sample with `kind`, then apply content_or_style and timestep_range.

    progress: training progress in [0, 1] (gaussian curriculum). update_index: optimizer updates done
    before this one (fixed_cycle). image_seq_len and shift_schedule: needed for shift with
    dynamic_shift. The loss weight (weighted only) is a function of the sampler's own draw, so it keeps
    mean 1 whatever bias and range follow, and its bell spans the trained range.
    """
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"progress must be in [0, 1], got {progress}")
    if update_index < 0:
        raise ValueError(f"update_index must be >= 0, got {update_index}")
    u, weight = _draw(kind, params, batch_size, generator, progress, update_index,
                      image_seq_len, shift_schedule)
    u = bias_content_or_style(u, content_or_style).clamp(EPS, 1.0 - EPS)
    return TimestepDraw(apply_timestep_range(u, timestep_range), weight)


def _draw(kind: str, params: TimestepParams, batch_size: int, generator: torch.Generator, progress: float,
          update_index: int, image_seq_len: int | None, shift_schedule: ShiftSchedule | None,
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if kind == "uniform":
        return sample_uniform(batch_size, generator), None
    if kind == "sigmoid":
        return sample_sigmoid(batch_size, generator, _or(params.mean, 0.0), params.std), None
    if kind == "lognorm_blend":
        return sample_lognorm_blend(batch_size, generator), None
    if kind == "shift":
        return sample_shift(batch_size, generator, _shift_value(params, image_seq_len, shift_schedule),
                            params.shift_base, _or(params.mean, 0.0), params.std), None
    if kind == "weighted":
        return sample_weighted(batch_size, generator)
    if kind == "gaussian":
        std = gaussian_std_at(progress, params)
        return sample_gaussian(batch_size, generator, _or(params.mean, 0.5), std), None
    if kind == "fixed_cycle":
        return fixed_cycle_u(params.cycle, update_index, batch_size), None
    raise ValueError(f"timestep_type must be one of {TIMESTEP_TYPES}, got {kind!r}")


def _or(value: float | None, default: float) -> float:
    # `mean` means logit-space for sigmoid and u-space for gaussian, so its default depends on the sampler
    return default if value is None else value


def _shift_value(params: TimestepParams, image_seq_len: int | None, schedule: ShiftSchedule | None) -> float:
    if not params.dynamic_shift:
        return params.shift
    if image_seq_len is None or schedule is None:
        raise ValueError("timestep_params.dynamic_shift needs image_seq_len and the model's ShiftSchedule")
    return schedule.shift_for(image_seq_len)


# --- `python -m toolkit.diffusion.timesteps`: ASCII densities from the real samplers -----------------------

_BLOCKS = " ▁▂▃▄▅▆▇█"


def density_line(u: torch.Tensor, bins: int = 40, weights: torch.Tensor | None = None) -> str:
    """One character per bin of (0, 1), height proportional to the (weighted) count; blank is empty."""
    index = (u * bins).long().clamp(0, bins - 1)
    counts = torch.bincount(index, weights=None if weights is None else weights.double(), minlength=bins)
    levels = (counts.double() / counts.max() * (len(_BLOCKS) - 1)).round().long()
    levels = torch.where(counts > 0, levels.clamp(min=1), 0)  # a thin bar still shows that a bin has mass
    return "".join(_BLOCKS[int(level)] for level in levels)


def _demo_rows(n: int, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    def draw(kind: str, label: str, params: TimestepParams = TimestepParams(), **options):
        result = sample_timestep_u(kind, params, n, torch.Generator().manual_seed(seed), **options)
        return label, result.u, result.loss_weight

    cycle = TimestepParams(cycle=(0.9, 0.5, 0.1))
    cycled = torch.cat([sample_timestep_u("fixed_cycle", cycle, 1, torch.Generator(), update_index=i).u
                        for i in range(300)])
    curriculum = TimestepParams(gaussian_std_start=0.05, gaussian_std_end=0.3)
    rows = [
        draw("uniform", "uniform"),
        draw("sigmoid", "sigmoid mean=0 std=1"),
        draw("sigmoid", "sigmoid mean=-1 std=1", TimestepParams(mean=-1.0)),
        draw("lognorm_blend", "lognorm_blend"),
        draw("shift", "shift shift=3"),
        draw("shift", "shift dynamic 1024px Flux", TimestepParams(dynamic_shift=True),
             image_seq_len=4096, shift_schedule=ShiftSchedule()),
        draw("shift", "shift sigmoid dyn 512px", TimestepParams(dynamic_shift=True, shift_base="sigmoid"),
             image_seq_len=1024, shift_schedule=ShiftSchedule()),
        draw("weighted", "weighted (u x weight)"),
        draw("gaussian", "gaussian mean=.5 std=.2"),
        draw("gaussian", "gaussian curriculum p=0", curriculum, progress=0.0),
        draw("gaussian", "gaussian curriculum p=1", curriculum, progress=1.0),
        ("fixed_cycle .9 .5 .1", cycled, None),
        draw("uniform", "uniform + content", content_or_style="content"),
        draw("uniform", "uniform + style", content_or_style="style"),
        draw("uniform", "uniform + range [.2,.8]", timestep_range=(0.2, 0.8)),
    ]
    weighted = next(row for row in rows if row[0].startswith("weighted"))
    rows.insert(rows.index(weighted), ("weighted (draws)", weighted[1], None))
    return rows


def main(n: int = 200_000, seed: int = 0, bins: int = 40) -> str:
    width = 26
    header = f"{'u = 0 (clean)':<{bins // 2}}{'u = 1 (noise)':>{bins - bins // 2}}"
    lines = [f"{'sampler':<{width}} |{header}|  mean  P(u>.5)"]
    for label, u, weights in _demo_rows(n, seed):
        w = torch.ones_like(u) if weights is None else weights
        mean, above = (u * w).sum() / w.sum(), (w * (u > 0.5)).sum() / w.sum()
        lines.append(f"{label:<{width}} |{density_line(u, bins, weights)}|  {mean:.3f}  {above:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
