"""The accelerator a run trains with: device, mixed precision, gradient accumulation, compilation, trackers, and
the host (gloo) group that per-update decisions travel on."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import (
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)

from toolkit.config.sections import RuntimeSection
from toolkit.precision import Precision
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


def host_process_group(processes: int, timeout: timedelta | None = None):
    """A CPU (gloo) process group for the small decisions all processes share every update (stop, save,
    sample): a collective over the accelerator's NCCL group would make the host wait for the work queued
    before it. None with one process. Its own group also where the default one is gloo (CPU runs), so the
    code that GPU runs depend on is the code the CPU runs exercise."""
    if processes == 1:
        return None
    return torch.distributed.new_group(backend="gloo", timeout=timeout)


#: accelerate's launch settings for the sharding back ends (`accelerate launch --use_fsdp`, or `distributed_type: FSDP`
#: / `DEEPSPEED` in its config file)
SHARDING_LAUNCHES = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DeepSpeed"}


def refuse_sharded_launch() -> None:
    """Sharding is the job file's `train.sharding: fsdp` (torch's FSDP2 on a plain multi-process launch,
    toolkit/run/sharding.py), not accelerate's launch settings: a launch asking accelerate for FSDP or DeepSpeed is
    refused before anything loads, rather than trained some other way than asked (on the CPU accelerate even turns
    FSDP into plain multi-process)."""
    asked = [name for key, name in SHARDING_LAUNCHES.items() if os.environ.get(key, "").lower() in ("1", "true")]
    if asked:
        raise UserError(
            f"this launch asks accelerate for {asked[0]}, which difftune does not use: launch with "
            "`accelerate launch --multi_gpu` and set `train.sharding: fsdp` in the job file to split the denoiser over "
            "the GPUs (or leave it `none` for DDP, each GPU holding the whole base, quantized where model.quantize "
            "asks); see docs/multi-gpu.md.")


def enable_cpu_fp16(accelerator: Accelerator) -> None:
    """fp16 mixed precision where accelerate leaves it off: on the CPU, accelerate (1.16) keeps `mixed_precision="fp16"`
    in its state but sets neither autocast nor a GradScaler, so the run would silently train in float32. torch has
    both for the CPU (`torch.autocast("cpu", dtype=torch.float16)`, `torch.amp.GradScaler("cpu")`), so the two
    attributes accelerate reads are set as it sets them on CUDA: its model wrapper then autocasts in fp16, its
    `backward` scales the loss, its optimizer wrapper unscales and skips non-finite steps. The CPU runs the fp16
    code path a GPU run takes."""
    if accelerator.state.mixed_precision != "fp16":
        raise ValueError(f"enable_cpu_fp16 on an accelerator of mixed precision {accelerator.state.mixed_precision}")
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler(accelerator.device.type)


@dataclass(frozen=True)
class CacheWriters:
    """How the processes share the encoding and writing of cache entries (what the caches' `build` reads in place of
    the accelerator): every entry has one writer among the processes that see its folder, this one taking every
    `num_processes`-th from `process_index`. On a shared filesystem that is every process of the run; otherwise the
    processes of each machine, so that every machine holds every entry."""

    process_index: int
    num_processes: int
    #: the one process that logs the caches' progress
    is_main_process: bool
    accelerator: Accelerator

    def wait_for_everyone(self) -> None:
        self.accelerator.wait_for_everyone()


class RunAccelerator:
    """accelerate's Accelerator for one run, and the host group beside it; `close` forgets accelerate's
    process-wide state so that the next job of the same process can choose its own."""

    def __init__(self, runtime: RuntimeSection, device: str, run_dir: Path, tensorboard: bool = False,
                 unused_parameters: bool = False, model_dtype: str = "auto"):
        refuse_sharded_launch()
        #: whether every machine sees the run folder and the caches (`train.shared_filesystem`)
        self.shared_filesystem = runtime.shared_filesystem
        timeout = timedelta(seconds=runtime.collective_timeout_s)
        handlers = [InitProcessGroupKwargs(timeout=timeout)]
        target = target_device(device)
        if target.type == "cuda" and target.index is not None:
            torch.cuda.set_device(target.index)
        #: the run's dtypes (toolkit/precision.py): `model_dtype` for the frozen base, `runtime.dtype` for autocast
        self.precision = Precision.of(model_dtype, runtime.dtype, target)
        self.mixed_precision = self.precision.mixed_precision
        self.accelerator = Accelerator(
            # e.g. peft's LoKr/LoHa skip a dropped module entirely: its weights get no gradient that step
            kwargs_handlers=handlers + ([DistributedDataParallelKwargs(find_unused_parameters=True)]
                                        if unused_parameters else []),
            cpu=target.type == "cpu",
            mixed_precision=self.mixed_precision,
            # the trainer counts its accumulation windows itself (`train.gradient_accumulation`, by the micro-batch's
            # place in its epoch); accelerate's stays 1, which ACCELERATE_GRADIENT_ACCUMULATION_STEPS cannot change
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1),
            log_with="tensorboard" if tensorboard else None,
            project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard")),
            dynamo_plugin=dynamo_plugin(runtime),
        )
        if self.precision.scales_loss and self.accelerator.scaler is None:
            enable_cpu_fp16(self.accelerator)
        if torch.distributed.is_initialized():
            # accelerate drops a timeout equal to its own default and keeps its process group from job to job, so the
            # default group's timeout is set here (torch has no public call for it)
            from torch.distributed.distributed_c10d import _set_pg_timeout

            _set_pg_timeout(timeout)
        self.host_group = host_process_group(self.accelerator.num_processes, timeout)

    @property
    def processes_here(self) -> int:
        """The training processes on this machine (they share its cores): the launcher's LOCAL_WORLD_SIZE, else all
        of the run's."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.accelerator.num_processes))

    @property
    def writes_resume_files(self) -> bool:
        """Whether this process writes what a resume reads (checkpoints, the run folder's config): the main process
        of the run, or without a shared filesystem each machine's first process, into its machine's run folder."""
        acc = self.accelerator
        return acc.is_main_process if self.shared_filesystem else acc.is_local_main_process

    def writer_first(self):
        """The processes that write (a model's download, a tiny preset's build) go first, the others then read the
        finished files: the run's main process, or without a shared filesystem each machine's first."""
        acc = self.accelerator
        return acc.main_process_first() if self.shared_filesystem else acc.local_main_process_first()

    def cache_writers(self) -> CacheWriters:
        acc = self.accelerator
        if self.shared_filesystem:
            return CacheWriters(acc.process_index, acc.num_processes, acc.is_main_process, acc)
        return CacheWriters(acc.local_process_index, self.processes_here, acc.is_main_process, acc)

    def allow_unused_parameters(self) -> None:
        """Before the model is prepared: DDP expects parameters of the wrapped model that get no gradient in a step
        (e.g. the experts an update does not train); their gradients stay unset, so the optimizer skips them."""
        self.accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)

    def close(self) -> None:
        if self.host_group is not None:
            torch.distributed.destroy_process_group(self.host_group)
            self.host_group = None
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
