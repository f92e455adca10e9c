"""Optimizers from `train.optimizer` and `train.optimizer_params`, and what the trainer needs to know of them: the
LR an update used, their own figures for the metrics (Prodigy's d), their hyperparameters (kept from the config on
a resume, unlike their running state), and schedule-free's evaluation weights (docs/optimizers.md)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from toolkit.config.sections import OptimizerSection
from toolkit.train.optimizer_params import uses_relative_step  # noqa: F401 (re-exported)
from toolkit.train.weights import weights_restored


def _bitsandbytes(name: str):
    try:
        import bitsandbytes.optim as bnb_optim
    except Exception as err:  # missing, or no backend for this device
        raise RuntimeError(f"optimizer {name} needs bitsandbytes, which cannot run here ({err}); "
                           "use optimizer: adamw (or adafactor for less memory)") from err
    return {"adamw8bit": bnb_optim.AdamW8bit, "lion8bit": bnb_optim.Lion8bit}[name]


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    if name == "adamw":
        return torch.optim.AdamW
    if name in ("adamw8bit", "lion8bit"):
        return _bitsandbytes(name)
    if name == "adafactor":
        from toolkit.train.optimizers.adafactor import BoundedAdafactor

        return BoundedAdafactor
    if name == "prodigy":
        from prodigyopt import Prodigy

        return Prodigy
    if name == "schedulefree_adamw":
        from schedulefree import AdamWScheduleFree

        return AdamWScheduleFree
    raise ValueError(f"unknown optimizer '{name}'")


def accepted_params(name: str) -> set[str]:
    """The keyword arguments `train.optimizer_params` may give the optimizer `name`."""
    cls = optimizer_class(name)
    names = set(inspect.signature(cls).parameters)
    if name == "adafactor":  # the wrapper passes the rest on to transformers' Adafactor
        from transformers.optimization import Adafactor

        names |= set(inspect.signature(Adafactor).parameters)
    return names - {"params", "lr", "kwargs", "self"}


def build_optimizer(section: OptimizerSection, params: list[torch.nn.Parameter] | list[dict],
                    loss_scaled: bool = False) -> torch.optim.Optimizer:
    """The optimizer over the trained parameters, or over parameter groups (a group's own `lr` wins over `lr`);
    `optimizer_params` were checked with the config. `adamw` runs torch's fused implementation where it can
    (`adamw_implementation`); `loss_scaled`: an fp16 GradScaler scales the loss."""
    kwargs = dict(section.optimizer_params)
    if section.optimizer == "adamw":
        kwargs |= adamw_implementation(params, kwargs, loss_scaled)
    return optimizer_class(section.optimizer)(params, lr=section.lr, **kwargs)


def adamw_implementation(params: list[torch.nn.Parameter] | list[dict], given: dict, loss_scaled: bool) -> dict:
    """`{"fused": True}`: torch's fused AdamW, one kernel per device and dtype over all parameters instead of a dozen
    operations per parameter (the same update rule: on the CPU a LoRA's AdamW step takes a third of the time; on a
    GPU it is the fastest of torch's three). `{}` (torch's own choice) where the config chooses (`foreach` or
    `fused`, `null` included) or asks for `differentiable`, where a parameter is on a device without fused kernels,
    for sharded parameters (`train.sharding: fsdp`; DTensors, which torch 2.14's fused kernel refuses), and with an fp16
    GradScaler: accelerate tells a skipped update by whether the optimizer's step ran, and a fused
    step always runs (it skips inside), so the LR schedule would advance over skipped updates."""
    if loss_scaled or "fused" in given or "foreach" in given or given.get("differentiable"):  # `null`: torch's choice
        return {}
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    supported = fused_devices()
    if not tensors or any(p.device.type not in supported or not torch.is_floating_point(p) for p in tensors):
        return {}
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in tensors):  # sharded: torch's fused kernel refuses DTensors (2.14)
        return {}
    return {"fused": True}


def fused_devices() -> set[str]:
    """Device types with torch's fused optimizer kernels: torch's own list (a private function: CPU and CUDA where a
    later torch moved it)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return set(_get_fused_kernels_supported_devices())
    except ImportError:
        return {"cpu", "cuda"}


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer itself, out of accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def is_prodigy(optimizer: torch.optim.Optimizer) -> bool:
    group = unwrapped(optimizer).param_groups[0]
    return "d" in group and "d0" in group


def is_schedule_free(optimizer: torch.optim.Optimizer) -> bool:
    return "train_mode" in unwrapped(optimizer).param_groups[0]


def logged_lr(optimizer: torch.optim.Optimizer, scheduled_lr: float, figures: dict[str, float] | None = None) -> float:
    """The LR an update used, read after its step: the optimizer's own average when it picks LRs itself
    (relative-step Adafactor), Prodigy's step size d x lr (d as it was for the step: `figures`, taken before it),
    schedule-free's LR with its own warmup, else the scheduler's."""
    inner = unwrapped(optimizer)
    group = inner.param_groups[0]
    average = getattr(inner, "get_avg_learning_rate", None)
    if average is not None and group.get("relative_step"):
        return average()
    if figures and "prodigy_d" in figures:
        return figures["prodigy_d"] * scheduled_lr
    if is_schedule_free(inner) and "scheduled_lr" in group:
        return float(group["scheduled_lr"])
    return scheduled_lr


def optimizer_figures(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """An optimizer's own figures for a metrics line, taken before the step they describe: Prodigy's distance
    estimate d (`prodigy_d`; a step updates it for the next one). Host values: reading them waits for nothing."""
    if is_prodigy(optimizer):
        return {"prodigy_d": float(unwrapped(optimizer).param_groups[0]["d"])}
    return {}


def update_rms(optimizer: torch.optim.Optimizer) -> float | None:
    return getattr(unwrapped(optimizer), "last_update_rms", None)


def hyperparameter_names(optimizer: torch.optim.Optimizer) -> set[str]:
    """The param-group keys that are settings (the constructor's arguments, through `**kwargs` to the classes it
    builds on), as opposed to the running state some optimizers keep in their groups (Prodigy's d and k,
    schedule-free's k, weight sum and mode): a resume takes the former from the config, the latter from the
    checkpoint."""
    names: set[str] = set()
    for cls in type(unwrapped(optimizer)).__mro__:
        init = cls.__dict__.get("__init__")
        if init is None or cls is torch.optim.Optimizer or cls is object:
            continue
        parameters = inspect.signature(init).parameters
        names |= {n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            break
    return names - {"self", "params"}


def start_training(optimizer: torch.optim.Optimizer) -> None:
    """Put a schedule-free optimizer in train mode (its parameters are then the point gradients are taken at);
    nothing for the others."""
    if is_schedule_free(optimizer):
        unwrapped(optimizer).train()


@contextmanager
def evaluation_weights(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The weights to sample, validate and save with: a schedule-free optimizer's averaged (eval-mode) point, else
    the trained weights as they are. Training continues from exactly the weights it left (copied back, not
    recomputed: switching schedule-free's mode back and forth is not exact in floating point, and a resumed run
    must see the same weights as an uninterrupted one)."""
    if not is_schedule_free(optimizer) or not unwrapped(optimizer).param_groups[0]["train_mode"]:
        yield
        return
    inner = unwrapped(optimizer)
    params = [p for group in inner.param_groups for p in group["params"]]
    with weights_restored(params):
        inner.eval()
        try:
            yield
        finally:
            for group in inner.param_groups:
                group["train_mode"] = True
