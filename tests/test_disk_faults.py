"""A full disk and a read-only run folder, for real: the run folder on a small tmpfs (root can mount one here), or,
where nothing can be mounted, a subprocess whose file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the kernel
refuse the write. The run stops with one message naming the path and the space needed, leaves nothing partial under
a final name, and the same command resumes exactly once there is space."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_same_training, trainer_process, write_job
from instrumented_run import wrapped

import run
from toolkit.run.checkpoint_folders import scan_checkpoints
from toolkit.run.disk import DiskProblem, disk_error, space_warning, tree_bytes
from toolkit.run.monitor import Monitor

REPO = Path(__file__).resolve().parents[1]


def mounted(folder: Path, options: str) -> bool:
    """A tmpfs at `folder` (root only); False where it cannot be mounted."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    folder = tmp_path / "disk"
    if not mounted(folder, "size=16m"):
        pytest.skip("no tmpfs can be mounted here (test_a_file_size_limit_... covers the write error)")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path) -> Path:
    """Take every free byte of `folder`'s file system."""
    filler = folder / "filler"
    with filler.open("wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 2**16)
                handle.flush()
        except OSError:
            pass
    return filler


def test_disk_errors_are_told_apart_from_other_errors():
    assert disk_error(OSError(28, "No space left on device")) is not None
    assert disk_error(RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"))
    wrapped_error = RuntimeError("save failed")
    wrapped_error.__cause__ = OSError(30, "Read-only file system")
    assert disk_error(wrapped_error) is not None
    assert disk_error(OSError(2, "No such file or directory")) is None and disk_error(ValueError("x")) is None


def test_the_free_space_check_warns_when_the_checkpoints_cannot_fit(tmp_path):
    assert space_warning(tmp_path, 2**20, 3, 0) is None
    warning = space_warning(tmp_path, 2**50, 3, 2**20)
    assert warning.startswith(f"{tmp_path}: the run's files need about") and "save.max_step_saves_to_keep" in warning


def test_a_full_disk_stops_the_run_cleanly_and_the_rerun_resumes_exactly(small_disk, tmp_path, caplog):
    """The disk fills up after update 3; the checkpoint of update 4 cannot be written: one message (the path, the
    reason, the checkpoint's size against the free space), the checkpoint of update 2 complete and the newest, no
    file under a final name left partial. With the space freed the same command resumes and trains exactly as a run
    that never stopped."""
    caplog.set_level(logging.ERROR, logger="difftune")
    straight_process = trainer_process(tmp_path, train={"steps": 6}, save={"save_every": 2})
    assert run.main([str(write_job(tmp_path / "straight.yaml", "straight", straight_process))]) == 0
    checkpoint = tree_bytes(tmp_path / "output" / "straight" / "checkpoints" / "step_000000002")
    process = trainer_process(small_disk, train={"steps": 6}, save={"save_every": 2})
    job = write_job(tmp_path / "full.yaml", "full", process)

    def fill_after_three(original):
        def after_update(self, update, readings, evaluated=None, extra=None):
            read = original(self, update, readings, evaluated, extra)
            if update.step == 3:
                fill(small_disk)
            return read
        return after_update

    with wrapped(Monitor, "after_update", fill_after_three):
        assert run.main([str(job)]) == 1
    message = next(r.message for r in caplog.records if r.message.startswith("could not write"))
    assert "No space left on device" in message and "writing a checkpoint, which needs about" in message
    assert f"{checkpoint / 2**20:.1f} MiB" in message and "resumes from the checkpoint of update 2" in message
    folder = small_disk / "output" / "full"
    complete, incomplete = scan_checkpoints(folder / "checkpoints")
    assert [p.name for p in complete] == ["step_000000002"] and not (folder / "full.safetensors").exists()
    finals = [p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".") and ".tmp" not in str(p)]
    for path in finals:  # every file under a final name is whole: safetensors and json parse
        if path.suffix == ".json":
            import json

            json.loads(path.read_text())
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            load_file(str(path))
    (small_disk / "filler").unlink()
    assert run.main([str(job)]) == 0
    assert_same_training(tmp_path / "output" / "straight", folder)


def test_a_read_only_run_folder_is_named_and_its_checkpoint_kept(small_disk, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="difftune")
    process = trainer_process(small_disk, train={"steps": 2}, save={"save_every": 2})
    job = write_job(tmp_path / "ro.yaml", "ro", process)
    assert run.main([str(job)]) == 0
    before = tree_bytes(small_disk / "output" / "ro" / "checkpoints")
    assert subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True).returncode == 0
    process["train"]["steps"] = 4
    job.write_text(write_job(tmp_path / "ro2.yaml", "ro", process).read_text())
    assert run.main([str(job)]) == 1
    message = next(r.message for r in caplog.records if r.message.startswith("could not write"))
    assert "Read-only file system" in message and str(small_disk) in message
    assert tree_bytes(small_disk / "output" / "ro" / "checkpoints") == before


@pytest.mark.slow
def test_a_file_size_limit_makes_the_kernel_refuse_the_write(tmp_path):
    """Without a mount: a subprocess whose files may not grow past 64 KiB (RLIMIT_FSIZE; SIGXFSZ ignored, so the
    write fails with EFBIG). Its first checkpoint cannot be written: one message, exit 1, no checkpoint or LoRA
    under a final name; the same command without the limit then trains as a run that never failed."""
    process = trainer_process(tmp_path, train={"steps": 2}, save={"save_every": 2})
    job = write_job(tmp_path / "limited.yaml", "limited", process)
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); sys.argv = ['run.py', sys.argv[1], '--quiet']; "
            "import run; sys.exit(run.main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, str(job)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "could not write" in done.stderr and "File too large" in done.stderr
    folder = tmp_path / "output" / "limited"
    complete, _ = scan_checkpoints(folder / "checkpoints")
    assert complete == [] and not (folder / "limited.safetensors").exists()
    assert run.main([str(job)]) == 0
    straight = write_job(tmp_path / "straight.yaml", "straight", process)
    assert run.main([str(straight)]) == 0
    assert_same_training(tmp_path / "output" / "straight", folder)


def test_disk_problem_is_a_user_error():
    from toolkit.errors import UserError

    assert issubclass(DiskProblem, UserError)


def test_caches_that_cannot_be_written_fall_back_to_encoding_live(small_disk, tmp_path, caplog):
    """The latent and text-embedding caches on a full disk (datasets[].cache_dir): one warning each, the latents and
    captions encoded live instead, and the run trains to the end."""
    from helpers import QUICKSTART_DATA

    from toolkit.run.metrics import read_metrics

    caplog.set_level(logging.WARNING, logger="difftune")
    fill(small_disk)
    process = trainer_process(tmp_path, train={"steps": 3, "cache_text_embeddings": True},
                              datasets=[{"folder_path": str(QUICKSTART_DATA), "resolution": [64],
                                         "cache_latents_to_disk": True, "cache_dir": str(small_disk / "cache")}])
    assert run.main([str(write_job(tmp_path / "live.yaml", "live", process))]) == 0
    warnings = [r.message for r in caplog.records if "cannot be written" in r.message]
    assert len(warnings) == 2 and "latents are encoded live" in warnings[0] and "captions are encoded live" in \
        warnings[1]
    records = [r for r in read_metrics(tmp_path / "output" / "live" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]


def test_a_run_whose_checkpoints_cannot_fit_is_warned_at_its_start(small_disk, tmp_path, caplog):
    """The free-space check at the start: 1000 checkpoints kept on a 16 MiB disk cannot fit; the run says so before
    its first update (and trains while the space lasts)."""
    caplog.set_level(logging.WARNING, logger="difftune")
    process = trainer_process(small_disk, train={"steps": 1}, save={"max_step_saves_to_keep": 1000})
    assert run.main([str(write_job(tmp_path / "space.yaml", "space", process))]) == 0
    assert any("1000 checkpoints of about" in r.message and "is free there" in r.message for r in caplog.records)
    caplog.clear()
    process["save"]["max_step_saves_to_keep"] = 2
    process["train"]["steps"] = 2
    assert run.main([str(write_job(tmp_path / "space.yaml", "space", process))]) == 0
    assert not any("is free there" in r.message for r in caplog.records)
