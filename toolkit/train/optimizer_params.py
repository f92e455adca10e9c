"""What `train.optimizer_params` may hold for each optimizer, known without importing torch or bitsandbytes:
the config check runs before any library loads. tests/test_optimizers.py compares this table with the real
signatures of the installed optimizers, so it cannot drift from them."""

from __future__ import annotations

from typing import Any, Callable

OPTIMIZER_PARAMS: dict[str, frozenset[str]] = {
    "adamw": frozenset({"amsgrad", "betas", "capturable", "differentiable", "eps", "foreach", "fused", "maximize",
                        "weight_decay"}),
    "adamw8bit": frozenset({"amsgrad", "args", "betas", "eps", "is_paged", "min_8bit_size", "optim_bits",
                            "weight_decay"}),
    "lion8bit": frozenset({"args", "betas", "is_paged", "min_8bit_size", "weight_decay"}),
    "adafactor": frozenset({"beta1", "clip_threshold", "decay_rate", "eps", "max_lr", "min_lr", "relative_step",
                            "scale_parameter", "warmup_init", "weight_decay"}),
    "prodigy": frozenset({"beta3", "betas", "d0", "d_coef", "decouple", "eps", "fsdp_in_use", "growth_rate",
                          "safeguard_warmup", "slice_p", "use_bias_correction", "weight_decay"}),
    "schedulefree_adamw": frozenset({"betas", "eps", "foreach", "r", "warmup_steps", "weight_decay",
                                     "weight_lr_power"}),
}


#: what a value of `optimizer_params` must be: (a test of the value, what it should be, in words)
ValueRule = tuple[Callable[[Any], bool], str]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(low: float | None = None, *, above: bool = False, below: float | None = None, whole: bool = False,
           optional: bool = False) -> ValueRule:
    """A number (an integer with `whole`) at least `low` (above it with `above`) and under `below`; None allowed
    with `optional`."""
    def test(value: Any) -> bool:
        if value is None:
            return optional
        if not _number(value) or (whole and not isinstance(value, int)):
            return False
        return ((low is None or (value > low if above else value >= low)) and (below is None or value < below))
    bounds = ([f"{'>' if above else '>='} {low:g}"] if low is not None else []) + (
        [f"< {below:g}"] if below is not None else [])
    words = ("an integer" if whole else "a number") + (f" {' and '.join(bounds)}" if bounds else "")
    return test, words + (" or null" if optional else "")


def pair(low: float, below: float | None, words: str) -> ValueRule:
    """Two numbers, each at least `low` and under `below` (betas: [0.9, 0.999])."""
    def test(value: Any) -> bool:
        return (isinstance(value, (list, tuple)) and len(value) == 2
                and all(_number(v) and v >= low and (below is None or v < below) for v in value))
    return test, words


FLAG: ValueRule = (lambda value: isinstance(value, bool), "true or false")
FLAG_OR_NULL: ValueRule = (lambda value: value is None or isinstance(value, bool), "true, false or null")
ANYTHING: ValueRule = (lambda value: True, "")

#: each accepted key's rule, by meaning; an optimizer whose key means something else has its own entry below
PARAM_VALUES: dict[str, ValueRule] = {
    "betas": pair(0, 1, "two numbers in [0, 1), e.g. [0.9, 0.999]"), "eps": number(0, above=True),
    "weight_decay": number(0), "amsgrad": FLAG, "maximize": FLAG, "capturable": FLAG, "differentiable": FLAG,
    "foreach": FLAG_OR_NULL, "fused": FLAG_OR_NULL, "is_paged": FLAG, "optim_bits": (lambda v: v in (8, 32), "8 or 32"),
    "min_8bit_size": number(0, whole=True), "args": ANYTHING, "beta1": number(0, below=1, optional=True),
    "clip_threshold": number(0, above=True), "decay_rate": number(below=0), "relative_step": FLAG,
    "scale_parameter": FLAG, "warmup_init": FLAG, "min_lr": number(0), "max_lr": number(0, above=True),
    "beta3": number(0, below=1, optional=True), "decouple": FLAG, "use_bias_correction": FLAG,
    "safeguard_warmup": FLAG, "d0": number(0, above=True), "d_coef": number(0, above=True),
    "growth_rate": number(1), "fsdp_in_use": FLAG, "slice_p": number(1, whole=True),
    "warmup_steps": number(0, whole=True), "r": number(0), "weight_lr_power": number(0),
}
OWN_VALUES: dict[tuple[str, str], ValueRule] = {
    ("adafactor", "eps"): pair(0, None, "two small positive numbers, e.g. [1e-30, 1e-3] (Adafactor's eps is a pair)"),
    ("prodigy", "eps"): number(0, above=True, optional=True),
}


def optimizer_param_problems(name: str, params: dict[str, Any]) -> list[str]:
    """Keys of `optimizer_params` the chosen optimizer does not take, and values it would refuse (or misread)
    only once the model has loaded."""
    accepted = OPTIMIZER_PARAMS[name]
    unknown = sorted(set(params) - accepted)
    problems = []
    if unknown:
        problems.append(f"`optimizer_params` {', '.join(unknown)} not accepted by {name} (valid: "
                        f"{', '.join(sorted(accepted))})")
    for key in sorted(set(params) & accepted):
        test, words = OWN_VALUES.get((name, key), PARAM_VALUES[key])
        if not test(params[key]):
            problems.append(f"`optimizer_params.{key}` of {name} must be {words}, got {params[key]!r}")
    return problems


def uses_relative_step(name: str, params: dict[str, Any]) -> bool:
    """Adafactor picks its own LR unless `relative_step: false` (transformers' default is true)."""
    return name == "adafactor" and params.get("relative_step", True)
