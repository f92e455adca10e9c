"""Training checkpoints: what is saved, how it is written safely, how the one to resume from is found.

A checkpoint is `checkpoints/step_XXXXXXXXX/` holding the LoRA (float32, so a resume is exact), the
optimizer, the LR scheduler, the grad scaler when fp16 uses one, one RNG file per rank and
`train_state.json`. It is written under `.tmp_step_XXXXXXXXX`; `train_state.json` is written last and
marks it complete; then the folder is renamed. A folder without the marker is never resumed from.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d{9})$")
TMP_PREFIX = ".tmp_"
COMPLETE_MARKER = "train_state.json"
LORA_FILE = "lora.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the folder and the mismatch."""


@dataclass
class TrainState:
    """`train_state.json`: where training stood when the checkpoint was written."""

    global_step: int
    epoch: int
    micro_batch_in_epoch: int
    world_size: int
    lr: float
    config_fingerprint: str = ""
    config: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    ranks: list = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def read(cls, folder: Path) -> TrainState:
        path = folder / COMPLETE_MARKER
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**data)
        except (OSError, ValueError, TypeError) as err:
            raise CheckpointError(f"{path}: unreadable train state: {err}") from err


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def library_versions() -> dict[str, str]:
    import accelerate
    import diffusers
    import peft
    import transformers

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__}


def scan_checkpoints(checkpoints_dir: Path) -> tuple[list[Path], list[Path]]:
    """(complete step folders oldest first, incomplete ones: no marker, or a temporary folder)."""
    if not checkpoints_dir.is_dir():
        return [], []
    complete, incomplete = [], []
    for path in sorted(checkpoints_dir.iterdir()):
        match = STEP_DIR.match(path.name)
        if path.is_dir() and match and (path / COMPLETE_MARKER).is_file():
            complete.append((int(match.group(1)), path))
        elif path.is_dir() and (match or path.name.startswith(TMP_PREFIX)):
            incomplete.append(path)
    return [path for _, path in sorted(complete)], incomplete


def prune(checkpoints_dir: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` complete checkpoints; incomplete folders are left alone."""
    complete, _ = scan_checkpoints(checkpoints_dir)
    removed = complete[:-keep] if keep else complete
    for path in removed:
        shutil.rmtree(path)
    return removed


def tmp_dir(checkpoints_dir: Path, step: int) -> Path:
    return checkpoints_dir / f"{TMP_PREFIX}{step_dir_name(step)}"


def begin(checkpoints_dir: Path, step: int) -> Path:
    """The temporary folder a checkpoint is written into (emptied if a crash left it behind)."""
    tmp = tmp_dir(checkpoints_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, state: TrainState) -> Path:
    """Write the completion marker, then move the folder to its final name."""
    (tmp / COMPLETE_MARKER).write_text(state.to_json(), encoding="utf-8")
    final = tmp.with_name(tmp.name[len(TMP_PREFIX):])
    replaced = None
    if final.exists():  # the same step saved again (resumed from an older checkpoint): swap, then delete
        replaced = final.with_name(f"{TMP_PREFIX}replaced_{final.name}")
        final.rename(replaced)
    tmp.rename(final)
    if replaced is not None:
        shutil.rmtree(replaced)
    return final


def rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng_rank{rank}.pt"


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_torch(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    # RNG states hold numpy arrays and Python tuples, which the weights-only unpickler refuses.
    return torch.load(path, map_location="cpu", weights_only=False)


def optimizer_problems(saved: dict, optimizer: torch.optim.Optimizer) -> list[str]:
    """Why a saved optimizer state does not fit the optimizer's parameters (empty when it fits)."""
    saved_groups, groups = saved.get("param_groups", []), optimizer.param_groups
    if len(saved_groups) != len(groups):
        return [f"{len(saved_groups)} optimizer param groups saved vs {len(groups)} now"]
    problems = []
    for index, (old, new) in enumerate(zip(saved_groups, groups)):
        if len(old["params"]) != len(new["params"]):
            problems.append(f"param group {index}: {len(old['params'])} parameters saved vs {len(new['params'])} now")
    if problems:
        return problems
    params = [p for group in groups for p in group["params"]]
    ids = [i for group in saved_groups for i in group["params"]]
    for position, (param_id, param) in enumerate(zip(ids, params)):
        for name, value in saved.get("state", {}).get(param_id, {}).items():
            # param-shaped moments (exp_avg, 8-bit state1, ...) must match; quantisation maps, absmax and
            # Adafactor's factored rows/columns have other ranks and are not compared
            same_rank = torch.is_tensor(value) and value.dim() >= 2 and value.dim() == param.dim()
            if same_rank and value.shape != param.shape:
                return [f"parameter {position}: optimizer state '{name}' has shape {tuple(value.shape)} vs "
                        f"{tuple(param.shape)} now"]
    return problems


def load_optimizer_keeping_hyperparameters(optimizer: torch.optim.Optimizer, saved: dict) -> list[str]:
    """Load the optimizer's moments and step counts but keep the current config's hyperparameters.

    Returns the hyperparameters that differ from the checkpoint, e.g. "weight_decay 0.01 -> 0.1".
    """
    current = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    changes = []
    for group, wanted in zip(optimizer.param_groups, current):
        for key, value in wanted.items():
            if key not in ("lr", "initial_lr") and group.get(key) != value:
                changes.append(f"{key} {group.get(key)} -> {value}")
            group[key] = value
    return sorted(set(changes))


class Checkpointer:
    """Writes checkpoints collectively: every rank writes its RNG file, the main process the rest."""

    def __init__(self, accelerator, checkpoints_dir: Path, keep: int):
        self.accelerator = accelerator
        self.dir = checkpoints_dir
        self.keep = keep

    def save(self, state: TrainState, write_payload) -> Path:
        """`write_payload(folder)` runs on the main process; call on every rank."""
        acc = self.accelerator
        tmp = tmp_dir(self.dir, state.global_step)
        if acc.is_main_process:
            begin(self.dir, state.global_step)
        acc.wait_for_everyone()
        torch.save(capture_rng(), rng_file(tmp, acc.process_index))
        if acc.is_main_process:
            write_payload(tmp)
        acc.wait_for_everyone()
        if acc.is_main_process:
            commit(tmp, state)
            prune(self.dir, self.keep)
        acc.wait_for_everyone()
        return self.dir / step_dir_name(state.global_step)

    def restore_rng(self, folder: Path, same_world: bool) -> bool:
        path = rng_file(folder, self.accelerator.process_index)
        if not same_world or not path.is_file():
            return False
        restore_rng(load_torch(path))
        return True


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts, with both values."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: unreadable: {err}") from err


def set_aside_newer(checkpoints_dir: Path, step: int, final_lora: Path) -> Path | None:
    """Move checkpoints newer than `step` (and the final LoRA) of an abandoned continuation into
    `checkpoints/abandoned_after_step_XXXXXXXXX/`, so that `resume: auto` and pruning follow the run that
    continues from `step`, and nothing is deleted."""
    newer = [p for p in (checkpoints_dir.iterdir() if checkpoints_dir.is_dir() else [])
             if STEP_DIR.match(p.name) and int(p.name[5:]) > step]
    moving = newer + ([final_lora] if final_lora.exists() and newer else [])
    if not moving:
        return None
    target = checkpoints_dir / f"abandoned_after_{step_dir_name(step)}"
    target.mkdir(exist_ok=True)
    for path in moving:
        path.rename(target / path.name)
    return target
