"""run.py with test instruments, for `accelerate launch` tests:

- DIFFTUNE_TEST_INTERRUPT_AFTER=N: the main process sends itself SIGINT right after update N (a real
  Ctrl-C through the real signal handler, timed deterministically; with DIFFTUNE_TEST_INTERRUPT_JOB=NAME, only in
  the job named NAME, which ends the launch: put it last);
- DIFFTUNE_TEST_FAIL_RANK=R: process R raises an error in its second micro-batch (with DIFFTUNE_TEST_FAIL_JOB=NAME,
  only in the job named NAME);
- DIFFTUNE_TEST_RECORD_INDICES=DIR: every process appends the sample indices of each micro-batch, and their files, to
  DIR/rank<R>.jsonl as {"job": name, "epoch": e, "indices": [...], "paths": [...]}.
- DIFFTUNE_TEST_CONTROL_AFTER=N:ACTION[,N:ACTION...]: right after update N the main process runs the real
  `python run.py --control RUN_FOLDER ACTION` in a subprocess (as a user in another terminal would).
- DIFFTUNE_TEST_RECORD_LORA=DIR: when training ends, every process writes its trained adapter weights (every
  component: the denoiser's or experts' and any text encoders', named as in a checkpoint) to
  DIR/<job name>_rank<R>.safetensors.
- DIFFTUNE_TEST_RECORD_WRITES=DIR:ROOT: every process appends to DIR/rank<R>.txt the path of every file it opens for
  writing or renames into place under ROOT (torch.save, text and metrics files, atomic writes' final names).
- DIFFTUNE_TEST_RECORD_MODEL_LOADS=DIR: every process appends to DIR/rank<R>.jsonl whether its model load
  asked for the sample-only models ({"sampling_models": bool}) and what it got ({"sampling_transformer": bool}).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import run  # noqa: E402
from jobs.process.base_sd_train_process import BaseSDTrainProcess  # noqa: E402
from toolkit.run import control  # noqa: E402
from toolkit.run.monitor import Monitor  # noqa: E402


@contextmanager
def wrapped(cls: type, name: str, wrap):
    """Replace method `name` of `cls` by `wrap(original)` for the duration of the block."""
    original = getattr(cls, name)
    setattr(cls, name, wrap(original))
    try:
        yield
    finally:
        setattr(cls, name, original)


def interrupt_after(step: int, job: str | None = None):
    def wrap(original):
        def after_update(self, update, readings, evaluated=None, extra=None):
            read = original(self, update, readings, evaluated, extra)
            if update.step == step and self.is_main and job in (None, self.name):
                os.kill(os.getpid(), signal.SIGINT)
            return read
        return after_update

    return wrapped(Monitor, "after_update", wrap)


@contextmanager
def control_after(plan: dict[int, list[str]]):
    """The real `run.py --control` after the planned updates; control/ is looked at by every decision meanwhile (not
    once per `POLL_S`), so a request acts at the update it follows, exactly."""
    def wrap(original):
        def after_update(self, update, readings, evaluated=None, extra=None):
            read = original(self, update, readings, evaluated, extra)
            for action in plan.get(update.step, []) if self.is_main else []:
                subprocess.run([sys.executable, str(Path(run.__file__)), "--control", str(self.folder.root), action],
                               check=True, capture_output=True)
            return read
        return after_update

    every_decision, control.POLL_S = control.POLL_S, 0.0
    try:
        with wrapped(Monitor, "after_update", wrap):
            yield
    finally:
        control.POLL_S = every_decision


def fail_on_rank(rank: int, job: str | None):
    def wrap(original):
        def train_step(self, batch, epoch, micro_batch):
            if self.accelerator.process_index == rank and micro_batch == 1 and job in (None, self.job.name):
                raise RuntimeError(f"injected failure on rank {rank}")
            return original(self, batch, epoch, micro_batch)
        return train_step

    return wrapped(BaseSDTrainProcess, "train_step", wrap)


def record_indices(folder: Path):
    def wrap(original):
        def train_step(self, batch, epoch, micro_batch):
            paths = [str(self.data.dataset.items[i].record.path) for i in batch["indices"]]
            line = json.dumps({"job": self.job.name, "epoch": epoch, "indices": batch["indices"], "paths": paths})
            with (folder / f"rank{self.accelerator.process_index}.jsonl").open("a") as handle:
                handle.write(line + "\n")
            return original(self, batch, epoch, micro_batch)
        return train_step

    return wrapped(BaseSDTrainProcess, "train_step", wrap)


def record_lora(folder: Path):
    from safetensors.torch import save_file

    from toolkit.network.lora import components_state_dict

    def wrap(original):
        def finish(self):
            state = components_state_dict([c.in_checkpoint() for c in self.components], torch.float32)
            save_file(state, str(folder / f"{self.job.name}_rank{self.accelerator.process_index}.safetensors"))
            return original(self)
        return finish

    return wrapped(BaseSDTrainProcess, "finish", wrap)


def record_model_loads(folder: Path):
    from toolkit.models.zimage.adapter import ZImageAdapter

    def wrap(original):
        def load(cls, model_cfg, device, dtype, debug_memory=False, sampling_models=True, empty_denoiser=False):
            adapter = original.__func__(cls, model_cfg, device, dtype, debug_memory, sampling_models, empty_denoiser)
            rank = int(os.environ.get("RANK", "0"))
            line = json.dumps({"sampling_models": sampling_models,
                               "sampling_transformer": adapter.sampling_transformer is not None})
            with (folder / f"rank{rank}.jsonl").open("a") as handle:
                handle.write(line + "\n")
            return adapter
        return classmethod(load)

    return wrapped(ZImageAdapter, "load", wrap)


@contextmanager
def record_writes(folder: Path, root: Path):
    import builtins
    import io

    rank = os.environ.get("RANK", "0")
    opened, renamed, replaced = builtins.open, os.rename, os.replace
    record = opened(folder / f"rank{rank}.txt", "a", buffering=1)
    root = root.resolve()

    def note(path) -> None:
        if isinstance(path, int):
            return
        resolved = Path(os.fsdecode(path)).resolve()
        if root in resolved.parents and folder.resolve() not in resolved.parents:
            record.write(f"{resolved}\n")

    def open_noting(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            note(file)
        return opened(file, mode, *args, **kwargs)

    def rename_noting(src, dst, *args, **kwargs):
        note(dst)
        return renamed(src, dst, *args, **kwargs)

    def replace_noting(src, dst, *args, **kwargs):
        note(dst)
        return replaced(src, dst, *args, **kwargs)

    builtins.open = io.open = open_noting
    os.rename, os.replace = rename_noting, replace_noting
    try:
        yield
    finally:
        builtins.open = io.open = opened
        os.rename, os.replace = renamed, replaced


if __name__ == "__main__":
    with ExitStack() as instruments:
        if "DIFFTUNE_TEST_INTERRUPT_AFTER" in os.environ:
            instruments.enter_context(interrupt_after(int(os.environ["DIFFTUNE_TEST_INTERRUPT_AFTER"]),
                                                      os.environ.get("DIFFTUNE_TEST_INTERRUPT_JOB")))
        if "DIFFTUNE_TEST_FAIL_RANK" in os.environ:
            instruments.enter_context(fail_on_rank(int(os.environ["DIFFTUNE_TEST_FAIL_RANK"]),
                                                   os.environ.get("DIFFTUNE_TEST_FAIL_JOB")))
        if "DIFFTUNE_TEST_CONTROL_AFTER" in os.environ:
            plan: dict[int, list[str]] = {}
            for item in os.environ["DIFFTUNE_TEST_CONTROL_AFTER"].split(","):
                step, action = item.split(":")
                plan.setdefault(int(step), []).append(action)
            instruments.enter_context(control_after(plan))
        if "DIFFTUNE_TEST_RECORD_WRITES" in os.environ:
            folder, root = os.environ["DIFFTUNE_TEST_RECORD_WRITES"].split(":")
            instruments.enter_context(record_writes(Path(folder), Path(root)))
        if "DIFFTUNE_TEST_RECORD_MODEL_LOADS" in os.environ:
            instruments.enter_context(record_model_loads(Path(os.environ["DIFFTUNE_TEST_RECORD_MODEL_LOADS"])))
        if "DIFFTUNE_TEST_RECORD_LORA" in os.environ:
            instruments.enter_context(record_lora(Path(os.environ["DIFFTUNE_TEST_RECORD_LORA"])))
        if "DIFFTUNE_TEST_RECORD_INDICES" in os.environ:
            instruments.enter_context(record_indices(Path(os.environ["DIFFTUNE_TEST_RECORD_INDICES"])))
        sys.exit(run.main(sys.argv[1:]))
