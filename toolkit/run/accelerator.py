"""The accelerator a run trains with: device, mixed precision, gradient accumulation, compilation, trackers, and
the host (gloo) group that per-update decisions travel on."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)

from toolkit.config.sections import RuntimeSection
from toolkit.device import mixed_precision
from toolkit.errors import UserError

log = logging.getLogger("difftune")


def target_device(wanted: str) -> torch.device:
    """The device type the config asks for (each process's index is accelerate's business)."""
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"device: '{wanted}' was asked for, but CUDA is not available here")
    return torch.device(wanted if wanted != "auto" else "cuda")


def dynamo_plugin(runtime: RuntimeSection) -> TorchDynamoPlugin:
    """torch.compile as `train.compile` says: the job file decides, not accelerate's launch settings."""
    launcher = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if launcher != "no" and not runtime.compile:
        log.warning("the launcher asks for torch.compile (dynamo backend %s); this job's train.compile is "
                    "false, so the model is not compiled", launcher)
    # static shapes: each bucket shape compiles once. Automatic dynamic shapes compiled far slower here and
    # failed in inductor on the SD UNet's resampling sizes (torch 2.14).
    return TorchDynamoPlugin(backend=runtime.compile_backend if runtime.compile else "no", mode="default",
                             fullgraph=False, dynamic=False, use_regional_compilation=False)


def host_process_group(processes: int):
    """A CPU (gloo) process group for the small decisions all processes share every update (stop, save,
    sample): a collective over the accelerator's NCCL group would make the host wait for the work queued
    before it. None with one process. Its own group also where the default one is gloo (CPU runs), so the
    code that GPU runs depend on is the code the CPU runs exercise."""
    if processes == 1:
        return None
    return torch.distributed.new_group(backend="gloo")


class RunAccelerator:
    """accelerate's Accelerator for one run, and the host group beside it; `close` forgets accelerate's
    process-wide state so that the next job of the same process can choose its own."""

    def __init__(self, runtime: RuntimeSection, device: str, run_dir: Path, gradient_accumulation: int,
                 tensorboard: bool = False, unused_parameters: bool = False):
        target = target_device(device)
        if target.type == "cuda" and target.index is not None:
            torch.cuda.set_device(target.index)
        self.mixed_precision = mixed_precision(runtime.dtype, target)
        self.accelerator = Accelerator(
            # e.g. peft's LoKr/LoHa skip a dropped module entirely: its weights get no gradient that step
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)] if unused_parameters else None,
            cpu=target.type == "cpu",
            mixed_precision=self.mixed_precision,
            gradient_accumulation_steps=gradient_accumulation,
            log_with="tensorboard" if tensorboard else None,
            project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard")),
            # batches come from pinned memory (see the DataLoader); their copies need not stop the host
            dataloader_config=DataLoaderConfiguration(non_blocking=target.type == "cuda"),
            dynamo_plugin=dynamo_plugin(runtime),
        )
        self.host_group = host_process_group(self.accelerator.num_processes)

    def close(self) -> None:
        if self.host_group is not None:
            torch.distributed.destroy_process_group(self.host_group)
            self.host_group = None
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
