"""BaseTrainProcess: the run folder, the resolved config dump and the accelerator."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from toolkit.device import mixed_precision

from .base_process import BaseProcess

log = logging.getLogger("difftune")


class RunFolderError(RuntimeError):
    """The run folder holds work this run would overwrite."""


class BaseTrainProcess(BaseProcess):
    accelerator: Accelerator

    @property
    def run_dir(self) -> Path:
        return Path(self.config.training_folder) / self.job.name

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
        self.accelerator = Accelerator(
            cpu=device.type == "cpu",
            mixed_precision=self.mixed_precision,
            gradient_accumulation_steps=self.config.train.gradient_accumulation,
        )
        return self.accelerator

    def teardown_accelerator(self) -> None:
        """Forget accelerate's process-wide state so the next job of this process can choose its own."""
        self.accelerator.wait_for_everyone()
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()

    def existing_outputs(self) -> list[Path]:
        names = ["checkpoints", f"{self.job.name}.safetensors", "metrics.jsonl", "samples"]
        return [self.run_dir / n for n in names if (self.run_dir / n).exists()]

    def prepare_run_folder(self) -> None:
        """Refuse to write over an earlier run unless `train.overwrite`; then dump the resolved config."""
        existing = self.existing_outputs()
        if existing and not self.config.train.overwrite:
            raise RunFolderError(
                f"run folder {self.run_dir} already holds {', '.join(p.name for p in existing)}; "
                "set train.overwrite: true to start over, or choose another config.name"
            )
        self.accelerator.wait_for_everyone()
        if self.is_main:
            for path in existing:
                log.warning("train.overwrite: removing %s", path)
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            resolved = self.job.config.model_dump(mode="json")
            resolved["config"]["process"] = [self.config.model_dump(mode="json")]
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8")
        self.accelerator.wait_for_everyone()
