"""Training checkpoints: what is saved, how it is written safely, how the one to resume from is found.

A checkpoint is `checkpoints/step_XXXXXXXXX/` holding the LoRA (float32, so a resume is exact), its EMA when
`train.ema` keeps one (`ema.safetensors`, the same keys), the optimizer, the LR scheduler, the grad scaler when fp16
uses one, one RNG file per rank and `train_state.json`. It is written under `.tmp_step_XXXXXXXXX`; `train_state.json` is written last and
marks it complete; then the folder is renamed. A folder without the marker is never resumed from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from toolkit.errors import UserError
from toolkit.run.checkpoint_folders import (
    COMPLETE_MARKER,
    STEP_DIR,
    TMP_PREFIX,
    scan_checkpoints,
    step_dir_name,
)
from toolkit.train.plan import Position, resumed_position

from toolkit.run.sharding import Unsharded

if TYPE_CHECKING:
    from toolkit.models.base import LoraComponent
    from toolkit.train.ema import LoraEMA

log = logging.getLogger("difftune")

LORA_FILE = "lora.safetensors"
EMA_FILE = "ema.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"


class CheckpointError(UserError, RuntimeError):
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
    #: when the run's first start began (unix time), carried across resumes; 0 in checkpoints that predate it
    started_at: float = 0.0
    #: updates dropped for non-finite values before this checkpoint (`train.on_nan: skip`)
    skipped_updates: int = 0

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


def fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def library_versions() -> dict[str, str]:
    import accelerate
    import diffusers
    import peft
    import transformers

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__}


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


#: how torch computes a step, not a setting of the training (difftune may choose them: `adamw_implementation`): kept
#: from the config like the rest, not reported as a change
IMPLEMENTATION_FLAGS = frozenset({"fused", "foreach"})


def load_optimizer_keeping_hyperparameters(optimizer: torch.optim.Optimizer, saved: dict) -> list[str]:
    """Load the optimizer's moments, step counts and the running state some optimizers keep in their param groups
    (Prodigy's d, schedule-free's weight sum), but keep the current config's hyperparameters (the constructor's
    arguments; the LR is the schedule's, replayed).

    Returns the hyperparameters that differ from the checkpoint, e.g. "weight_decay 0.01 -> 0.1".
    """
    from toolkit.train.optimizers import hyperparameter_names

    settings = hyperparameter_names(optimizer) - {"lr", "initial_lr"}
    current = [{k: v for k, v in group.items() if k in settings} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    changes = []
    for group, wanted in zip(optimizer.param_groups, current):
        for key, value in wanted.items():
            if group.get(key) != value and key not in IMPLEMENTATION_FLAGS:
                changes.append(f"{key} {group.get(key)} -> {value}")
            group[key] = value
    place_step_counts(optimizer)
    return sorted(set(changes))


def place_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """torch's Adam family keeps a fused (or capturable) group's step counts on its parameters' device as float32,
    the others' on the host, and loads a checkpoint's counts where the optimizer that saved them kept them. A group
    whose implementation the config changed (a checkpoint from before difftune chose the fused AdamW, or
    `optimizer_params.fused` set or unset since) gets its counts where its step reads them."""
    for group in optimizer.param_groups:
        if "fused" not in group and "capturable" not in group:
            continue
        on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            step = state.get("step")
            if torch.is_tensor(step):
                state["step"] = step.to(dtype=torch.float32, device=param.device) if on_device else step.cpu()


@dataclass
class TrainedParts:
    """What a checkpoint saves and a resume loads besides the position: the adapter (on each trained component,
    `LoraComponent`s: the denoiser and any text encoders, each saved under its prefix), the optimizer, the LR
    scheduler, the fp16 grad scaler and the EMA of the adapter's weights."""

    components: list[LoraComponent]
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    scaler: Any = None
    ema: LoraEMA | None = None
    #: how the processes hold the trained weights (toolkit/run/sharding.py): sharded, a checkpoint gathers them
    sharding: Unsharded = field(default_factory=lambda: Unsharded())

    @property
    def in_checkpoint(self) -> list[LoraComponent]:
        """The components under the names a checkpoint's one LoRA file gives them (see LoraComponent.in_checkpoint)."""
        return [component.in_checkpoint() for component in self.components]


class Checkpoints:
    """Saving and resuming, in one part. `save` is collective: every rank writes its RNG file, the main process the
    rest (without a shared filesystem, each machine's first process, into its machine's folder), then the folder is
    committed and old ones pruned. `resume` validates a checkpoint against the built parts
    before it changes anything, then loads the adapter, optimizer, scaler and RNG and replays the LR schedule."""

    def __init__(self, accelerator, folder: Path, keep: int, parts: TrainedParts, config: dict,
                 lora_metadata: Callable[[int], dict[str, str]], debug_memory: bool = False, writes: bool | None = None):
        self.accelerator = accelerator
        #: whether this process writes checkpoints: the main process, or without a shared filesystem each machine's
        #: first (into its machine's folder); every process writes its own RNG file
        self.writes = accelerator.is_main_process if writes is None else writes
        self.dir = folder
        self.keep = keep
        self.parts = parts
        self.config = config
        self.lora_metadata = lora_metadata
        self.debug_memory = debug_memory
        #: the step of the newest checkpoint this run wrote or resumed from (-1: none)
        self.last_saved_step = -1
        #: when training began: now, or the first run's start when resumed
        self.started_at = time.time()
        #: the config of the checkpoint resumed from (empty on a fresh start)
        self.resumed_config: dict = {}

    # ---- save --------------------------------------------------------------------------------------

    def save(self, position: Position) -> Path:
        """Call on every rank."""
        acc = self.accelerator
        state = self.train_state(position)
        tmp = tmp_dir(self.dir, state.global_step)
        if self.writes:
            begin(self.dir, state.global_step)
        acc.wait_for_everyone()
        torch.save(capture_rng(), rng_file(tmp, acc.process_index))
        if self.writes or self.parts.sharding.enabled:  # sharded: every process gathers, the writers write
            self.write_payload(tmp, state.global_step, write=self.writes)
        acc.wait_for_everyone()
        if self.writes:
            commit(tmp, state)
            prune(self.dir, self.keep)
        acc.wait_for_everyone()
        self.last_saved_step = position.global_step
        return self.dir / step_dir_name(state.global_step)

    def train_state(self, position: Position) -> TrainState:
        """Where training is; called on every rank (it gathers each rank's step and LR)."""
        from accelerate.utils import gather_object

        lr = self.parts.lr_scheduler.get_last_lr()[0]
        rank = self.accelerator.process_index
        return TrainState(
            global_step=position.global_step, epoch=position.epoch, micro_batch_in_epoch=position.micro_batch_in_epoch,
            world_size=self.accelerator.num_processes, lr=lr, config_fingerprint=fingerprint(self.config),
            config=self.config, versions=library_versions(),
            ranks=gather_object([{"rank": rank, "global_step": position.global_step, "lr": lr}]),
            started_at=self.started_at, skipped_updates=position.skipped_updates,
        )

    def write_payload(self, folder: Path, step: int, write: bool = True) -> None:
        """Everything but the RNG files; a float32 LoRA so that a resume continues exactly. Sharded, the LoRA, its EMA
        and the optimizer state are gathered to full tensors (every process calls this; `write` on the main one): the
        files are those of an unsharded run, so a run resumes on any process count."""
        from toolkit.network.lora import write_components_file

        parts, sharding = self.parts, self.parts.sharding
        with sharding.gathered():
            if write:
                write_components_file(folder / LORA_FILE, parts.in_checkpoint, torch.float32, self.lora_metadata(step))
        if parts.ema is not None and parts.ema.started:
            with parts.ema.applied(), sharding.gathered():
                if write:
                    write_components_file(folder / EMA_FILE, parts.in_checkpoint, torch.float32,
                                          self.lora_metadata(step))
        optimizer_state = sharding.optimizer_state(parts.optimizer)
        if not write:
            return
        torch.save(optimizer_state, folder / OPTIMIZER_FILE)
        torch.save(parts.lr_scheduler.state_dict(), folder / SCHEDULER_FILE)
        if parts.scaler is not None:
            torch.save(parts.scaler.state_dict(), folder / SCALER_FILE)

    # ---- resume ------------------------------------------------------------------------------------

    def resume(self, folder: Path, micro_batches_per_epoch: int, gradient_accumulation: int) -> Position:
        """Load `folder` into the parts; returns where training continues."""
        state = TrainState.read(folder)
        self.load_trained_state(folder, state.global_step)
        world = self.accelerator.num_processes
        if state.world_size != world:
            log.warning("the checkpoint was written by %d processes, this run has %d: the LR continues at step %d, "
                        "but the data order from here differs from an uninterrupted run", state.world_size, world,
                        state.global_step)
        saved = Position(state.global_step, state.epoch, state.micro_batch_in_epoch, state.skipped_updates)
        position = resumed_position(saved, state.world_size, world, micro_batches_per_epoch, gradient_accumulation)
        self.fast_forward_lr_scheduler(state)
        same_world = state.world_size == world
        if not self.restore_rng(folder, same_world) and same_world:
            log.warning("%s: no RNG state for rank %d; library randomness will differ", folder,
                        self.accelerator.process_index)
        self.last_saved_step = state.global_step
        self.started_at = state.started_at or self.started_at
        self.resumed_config = state.config
        for change in config_changes(state.config, self.config):
            log.info("changed since the checkpoint: %s", change)
        log.info("resuming from %s at step %d (epoch %d, micro-batch %d)", folder, state.global_step, position.epoch,
                 position.micro_batch_in_epoch)
        return position

    def load_trained_state(self, folder: Path, step: int) -> None:
        from toolkit.device import memory_debug
        from toolkit.network.lora import (
            compare_lora_state,
            components_state_dict,
            load_lora_state,
            read_components_file,
        )

        parts, components, sharding = self.parts, self.parts.in_checkpoint, self.parts.sharding
        lora_file = folder / LORA_FILE
        saved_lora = load_safetensors(lora_file, lambda path: read_components_file(path, components))
        with sharding.gathered():  # sharded: the full shapes
            expected = components_state_dict(components, torch.float32)
        problems = compare_lora_state(expected, saved_lora)
        saved_optimizer = load_torch(folder / OPTIMIZER_FILE)
        problems += [f"{OPTIMIZER_FILE}: {problem}" for problem in optimizer_problems(saved_optimizer, parts.optimizer)]
        saved_ema = None
        if parts.ema is not None and (folder / EMA_FILE).is_file():
            saved_ema = load_safetensors(folder / EMA_FILE, lambda path: read_components_file(path, components))
            problems += [f"{EMA_FILE}: {problem}" for problem in compare_lora_state(expected, saved_ema)]
        if problems:
            raise CheckpointError(f"checkpoint {folder} does not match the current config: " + "; ".join(problems))
        # sharded: each process keeps its part of the full tensors
        with memory_debug("LoRA load", self.debug_memory), sharding.loading():
            for component in components:
                load_lora_state(component.module, saved_lora, component.prefix, str(lora_file))
        if saved_ema is not None:
            with parts.ema.loading(), sharding.loading():
                for component in components:
                    load_lora_state(component.module, saved_ema, component.prefix, str(folder / EMA_FILE))
        elif parts.ema is not None and step >= parts.ema.cfg.start_step:
            log.warning("%s has no EMA (train.ema was off or started later): the EMA starts from the weights of "
                        "step %d", folder, step)
            parts.ema.capture()
        saved_optimizer = sharding.optimizer_state_for(saved_optimizer, parts.optimizer)
        for change in load_optimizer_keeping_hyperparameters(parts.optimizer, saved_optimizer):
            log.info("optimizer setting changed since the checkpoint: %s", change)
        if parts.scaler is not None and (folder / SCALER_FILE).is_file():
            parts.scaler.load_state_dict(load_torch(folder / SCALER_FILE))

    def fast_forward_lr_scheduler(self, state: TrainState) -> None:
        """The LR is a function of the update index: replay the current schedule to the resumed step, so a
        changed `lr`, `steps` or schedule applies from here on."""
        scheduler = self.parts.lr_scheduler
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
            for _ in range(state.global_step):
                scheduler.step()
        now = scheduler.get_last_lr()[0]
        if not math.isclose(now, state.lr, rel_tol=1e-9, abs_tol=1e-15):
            log.info("LR at step %d: %.3g in the checkpoint, %.3g with the current schedule", state.global_step,
                     state.lr, now)

    def restore_rng(self, folder: Path, same_world: bool) -> bool:
        path = rng_file(folder, self.accelerator.process_index)
        if not same_world or not path.is_file():
            return False
        restore_rng(load_torch(path))
        return True


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts, with both values. Keys the old config lacks (added
    to the schema since it was written) are not changes."""
    changes = []
    for key in sorted(set(old) | set(new)):
        if key not in old:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


def load_safetensors(path: Path, read: Callable[[Path], dict[str, torch.Tensor]] | None = None
                     ) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file (through `read` when given); missing or damaged files are named."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        return read(path) if read is not None else load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: unreadable: {err}") from err


def set_aside_newer(checkpoints_dir: Path, step: int, final_loras: list[Path]) -> Path | None:
    """Move checkpoints newer than `step` (and the final LoRA) of an abandoned continuation into
    `checkpoints/abandoned_after_step_XXXXXXXXX/`, so that `resume: auto` and pruning follow the run that
    continues from `step`, and nothing is deleted."""
    newer = [p for p in (checkpoints_dir.iterdir() if checkpoints_dir.is_dir() else [])
             if STEP_DIR.match(p.name) and int(p.name[5:]) > step]
    moving = newer + ([p for p in final_loras if p.exists()] if newer else [])
    if not moving:
        return None
    target = checkpoints_dir / f"abandoned_after_{step_dir_name(step)}"
    target.mkdir(exist_ok=True)
    for path in moving:
        path.rename(target / path.name)
    return target
