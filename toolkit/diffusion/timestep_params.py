"""Timestep sampler parameters, checked without torch (config validation uses them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimestepParams:
    """Sampler parameters; the integrator maps `train.timestep_params.*` onto these fields."""

    #: sigmoid: mean of the normal in logit space (None = 0.0); gaussian: mean in u-space (None = 0.5)
    mean: float | None = None
    #: sigmoid: std of the normal in logit space
    std: float = 1.0
    #: shift: the flow-matching time shift s in u -> s*u / (1 + (s-1)*u); 1.0 is no shift
    shift: float = 3.0
    #: shift: compute s from the image sequence length and the scheduler's base/max shift instead
    dynamic_shift: bool = False
    #: shift: the draws the shift moves: "uniform", or "sigmoid" (the sigmoid sampler's logit-normal, mean and std)
    shift_base: str = "uniform"
    #: gaussian: std in u-space when no curriculum is set
    gaussian_std: float = 0.2
    #: gaussian curriculum: std at progress 0 and at progress 1 (both or neither)
    gaussian_std_start: float | None = None
    gaussian_std_end: float | None = None
    #: fixed_cycle: u values visited in order, one per optimizer update
    cycle: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "cycle", tuple(float(c) for c in self.cycle))
        errors = [
            f"timestep_params.{name} must be > 0, got {value}"
            for name, value in (("std", self.std), ("shift", self.shift), ("gaussian_std", self.gaussian_std),
                                ("gaussian_std_start", self.gaussian_std_start),
                                ("gaussian_std_end", self.gaussian_std_end))
            if value is not None and not value > 0
        ]
        if self.shift_base not in ("uniform", "sigmoid"):
            errors.append(f"timestep_params.shift_base must be 'uniform' or 'sigmoid', got {self.shift_base!r}")
        if (self.gaussian_std_start is None) != (self.gaussian_std_end is None):
            errors.append("timestep_params.gaussian_std_start and gaussian_std_end: set both or neither")
        errors += [f"timestep_params.cycle[{i}] must be in (0, 1), got {c}"
                   for i, c in enumerate(self.cycle) if not 0.0 < c < 1.0]
        if errors:
            raise ValueError("; ".join(errors))
