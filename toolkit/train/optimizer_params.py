"""What `train.optimizer_params` may hold for each optimizer, known without importing torch or bitsandbytes:
the config check runs before any library loads. tests/test_optimizers.py compares this table with the real
signatures of the installed optimizers, so it cannot drift from them."""

from __future__ import annotations

from typing import Any

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


def optimizer_param_problems(name: str, params: dict[str, Any]) -> list[str]:
    """Keys of `optimizer_params` the chosen optimizer does not take."""
    accepted = OPTIMIZER_PARAMS[name]
    unknown = sorted(set(params) - accepted)
    if not unknown:
        return []
    return [f"`optimizer_params` {', '.join(unknown)} not accepted by {name} (valid: {', '.join(sorted(accepted))})"]


def uses_relative_step(name: str, params: dict[str, Any]) -> bool:
    """Adafactor picks its own LR unless `relative_step: false` (transformers' default is true)."""
    return name == "adafactor" and params.get("relative_step", True)
