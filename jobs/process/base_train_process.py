"""BaseTrainProcess: the run folder (start fresh or resume), the resolved config dump and the accelerator."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)

from toolkit import checkpoint
from toolkit.device import mixed_precision

from .base_process import BaseProcess

log = logging.getLogger("difftune")


class RunFolderError(RuntimeError):
    """The run folder holds work this run would overwrite."""


def host_process_group(processes: int):
    """A CPU (gloo) process group for the small decisions all processes share every update (stop, save,
    sample): a collective over the accelerator's NCCL group would make the host wait for the work queued
    before it. None with one process. Its own group also where the default one is gloo (CPU runs), so the
    code that GPU runs depend on is the code the CPU runs exercise."""
    if processes == 1:
        return None
    return torch.distributed.new_group(backend="gloo")


class BaseTrainProcess(BaseProcess):
    accelerator: Accelerator
    host_group = None

    @property
    def run_dir(self) -> Path:
        return Path(self.config.training_folder) / self.job.name

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def final_lora_path(self) -> Path:
        return self.run_dir / f"{self.job.name}.safetensors"

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def target_device(self) -> torch.device:
        """The device type the config asks for (each process's index is accelerate's business)."""
        wanted = self.config.device
        if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise RuntimeError(f"device '{wanted}' was asked for, but CUDA is not available here")
        return torch.device(wanted if wanted != "auto" else "cuda")

    def setup_accelerator(self) -> Accelerator:
        device = self.target_device()
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device.index)
        self.mixed_precision = mixed_precision(self.config.train.dtype, device)
        tensorboard = self.config.logging.tensorboard
        network = self.config.network
        # peft's LoKr/LoHa skip a dropped module's computation entirely: its weights get no gradient that step,
        # which DDP must be told to expect (LoRA's own module dropout multiplies by 0 instead)
        unused = network.type != "lora" and network.module_dropout > 0
        self.accelerator = Accelerator(
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)] if unused else None,
            cpu=device.type == "cpu",
            mixed_precision=self.mixed_precision,
            gradient_accumulation_steps=self.config.train.gradient_accumulation,
            log_with="tensorboard" if tensorboard else None,
            project_config=ProjectConfiguration(project_dir=str(self.run_dir),
                                                logging_dir=str(self.run_dir / "tensorboard")),
            # batches come from pinned memory (see the DataLoader); their copies need not stop the host
            dataloader_config=DataLoaderConfiguration(non_blocking=device.type == "cuda"),
            dynamo_plugin=self.dynamo_plugin(),
        )
        self.host_group = host_process_group(self.accelerator.num_processes)
        return self.accelerator

    def dynamo_plugin(self) -> TorchDynamoPlugin:
        """torch.compile as `train.compile` says: the job file decides, not accelerate's launch settings."""
        train = self.config.train
        launcher = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
        if launcher != "no" and not train.compile:
            log.warning("the launcher asks for torch.compile (dynamo backend %s); this job's train.compile is "
                        "false, so the model is not compiled", launcher)
        # static shapes: each bucket shape compiles once. Automatic dynamic shapes compiled far slower here and
        # failed in inductor on the SD UNet's resampling sizes (torch 2.14).
        return TorchDynamoPlugin(backend=train.compile_backend if train.compile else "no", mode="default",
                                 fullgraph=False, dynamic=False, use_regional_compilation=False)

    def teardown_accelerator(self) -> None:
        """Forget accelerate's process-wide state so the next job of this process can choose its own."""
        if self.host_group is not None:
            torch.distributed.destroy_process_group(self.host_group)
            self.host_group = None
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()

    def saved_work(self) -> list[Path]:
        """What a fresh start would overwrite: complete checkpoints and the final LoRA."""
        complete, _ = checkpoint.scan_checkpoints(self.checkpoints_dir)
        return complete + [p for p in [self.final_lora_path] if p.exists()]

    def find_resume_checkpoint(self) -> Path | None:
        """The checkpoint to continue from, or None to start fresh. Reads only; refuses to overwrite work."""
        train = self.config.train
        if train.overwrite:
            return None
        if train.resume not in (False, "auto"):
            folder = Path(train.resume)
            if not (folder / checkpoint.COMPLETE_MARKER).is_file():
                raise checkpoint.CheckpointError(f"train.resume: {folder} is not a complete checkpoint folder")
            return folder
        complete, incomplete = checkpoint.scan_checkpoints(self.checkpoints_dir)
        for folder in incomplete:
            log.warning("ignoring incomplete checkpoint %s (its save did not finish)", folder)
        if train.resume == "auto" and complete:
            return complete[-1]
        if self.saved_work():
            names = ", ".join(str(p) for p in self.saved_work()[-2:])
            reason = "train.resume is false" if train.resume is False else "there is no checkpoint to resume from"
            raise RunFolderError(
                f"run folder {self.run_dir} already holds saved work ({names}) and {reason}; "
                "set train.overwrite: true to start over, or choose another config.name"
            )
        return None

    def open_run_folder(self) -> None:
        """Remove what `train.overwrite` replaces, then write the resolved config (main process)."""
        self.accelerator.wait_for_everyone()
        if self.is_main:
            if self.config.train.overwrite:
                for path in [self.checkpoints_dir, self.final_lora_path, self.run_dir / "metrics.jsonl",
                             self.run_dir / "samples"]:
                    if path.exists():
                        log.warning("train.overwrite: removing %s", path)
                        shutil.rmtree(path) if path.is_dir() else path.unlink()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            resolved = self.job.config.model_dump(mode="json")
            resolved["config"]["process"] = [self.config.model_dump(mode="json")]
            tmp = self.run_dir / ".config.yaml.tmp"
            tmp.write_text(yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8")
            tmp.replace(self.run_dir / "config.yaml")
        self.accelerator.wait_for_everyone()
