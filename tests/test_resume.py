"""Checkpoints and resume: an interrupted and resumed run logs the same losses and LRs as an uninterrupted one."""

from __future__ import annotations

import json
import logging
import signal
import time

import pytest
import torch
from helpers import REPO, launch, make_images, trainer_process, write_job
from instrumented_run import interrupt_after
from safetensors.torch import load_file

import run
from toolkit.run import checkpoint
from toolkit.run.metrics import read_metrics
from toolkit.run.signals import GracefulStop

STEPS = 12


def resume_process(tmp_path, **train) -> dict:
    """Two datasets, shuffling, accumulation 2, LoRA, rank and module dropout (so library RNG matters too)."""
    extra = tmp_path / "extra"
    if not extra.exists():
        make_images(extra, 6, size=(64, 64))
    return trainer_process(
        tmp_path,
        network={"linear": 4, "linear_alpha": 4, "dropout": 0.1, "rank_dropout": 0.1, "module_dropout": 0.1},
        datasets=[{"folder_path": str(REPO / "config" / "examples" / "quickstart_data"), "resolution": [64]},
                  {"folder_path": str(extra), "resolution": [64], "num_repeats": 2}],
        train={"steps": STEPS, "gradient_accumulation": 2, "lr_scheduler": "linear", **train},
        save={"save_every": 4, "max_step_saves_to_keep": 3},
    )


def per_update(run_dir) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["epoch"]) for r in read_metrics(run_dir / "metrics.jsonl")]


def final_lora(run_dir, name):
    return load_file(str(run_dir / f"{name}.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    assert run.main([str(write_job(tmp / "job.yaml", "straight", resume_process(tmp)))]) == 0
    return tmp / "output" / "straight"


@pytest.mark.slow
def test_ctrl_c_then_rerun_continues_exactly_on_one_process(tmp_path, uninterrupted, caplog):
    caplog.set_level(logging.INFO, logger="difftune")
    job = write_job(tmp_path / "job.yaml", "straight", resume_process(tmp_path))
    with interrupt_after(5):
        assert run.main([str(job)]) == 0
    run_dir = tmp_path / "output" / "straight"
    assert "stopped at step 5" in caplog.text and "Run the same command again to resume" in caplog.text
    assert [p.name for p in checkpoint.scan_checkpoints(run_dir / "checkpoints")[0]] == [
        "step_000000004", "step_000000005"]
    assert not (run_dir / "straight.safetensors").exists()

    assert run.main([str(job)]) == 0
    assert "resuming from" in caplog.text
    assert per_update(run_dir) == per_update(uninterrupted)  # bit-identical losses and LRs, 1..12
    ours, theirs = final_lora(run_dir, "straight"), final_lora(uninterrupted, "straight")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def interrupted_jobs(tmp_path) -> list[str]:
    """The job the shared two-process launch (conftest.py `two_process_launch`) interrupts after 5 updates."""
    return [str(write_job(tmp_path / "job.yaml", "ddp", resume_process(tmp_path)))]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_then_rerun_continues_exactly_on_two_processes(two_process_launch):
    """Interrupted after 5 updates (the last job of the shared launch), then rerun; the same job under another name
    runs straight through in the rerun's launch (after it, in the same two processes) as the reference. In that
    launch too: a run saved by one process continues on two (`grow`)."""
    tmp_path, interrupted = two_process_launch
    job = tmp_path / "job.yaml"
    reference = write_job(tmp_path / "reference.yaml", "reference", resume_process(tmp_path))
    grow = resume_process(tmp_path, steps=4, lr_scheduler="constant")
    assert run.main([str(write_job(tmp_path / "grow.yaml", "grow", grow))]) == 0
    grow["train"]["steps"] = 6
    assert interrupted.returncode == 0, interrupted.stderr[-3000:]
    assert "stopped at step 5" in interrupted.stderr
    state = json.loads((tmp_path / "output" / "ddp" / "checkpoints" / "step_000000005" / "train_state.json").read_text())
    assert [r["global_step"] for r in state["ranks"]] == [5, 5]
    assert sorted(p.name for p in (tmp_path / "output" / "ddp" / "checkpoints" / "step_000000005").iterdir()) == [
        "lora.safetensors", "optimizer.pt", "rng_rank0.pt", "rng_rank1.pt", "scheduler.pt", "train_state.json"]

    resumed = launch(job, 2, cwd=tmp_path, extra_jobs=[str(reference), str(write_job(tmp_path / "grow.yaml", "grow",
                                                                                         grow))])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert per_update(tmp_path / "output" / "ddp") == per_update(tmp_path / "output" / "reference")
    assert len(per_update(tmp_path / "output" / "reference")) == STEPS
    # resumed on another process count: said, with what it changes (the data order), and the steps go on
    assert "written by 1 processes, this run has 2" in resumed.stderr and "data order" in resumed.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "output" / "grow" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_incomplete_checkpoints_are_ignored_and_named(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="difftune")
    short = write_job(tmp_path / "job.yaml", "crash", resume_process(tmp_path, steps=8))
    assert run.main([str(short)]) == 0
    checkpoints = tmp_path / "output" / "crash" / "checkpoints"
    # a save killed before its marker, and one killed while still under its temporary name
    (checkpoints / "step_000000008" / "train_state.json").unlink()
    (checkpoints / ".tmp_step_000000010").mkdir()
    (checkpoints / ".tmp_step_000000010" / "lora.safetensors").write_bytes(b"partial")

    longer = write_job(tmp_path / "job.yaml", "crash", resume_process(tmp_path, steps=STEPS))
    assert run.main([str(longer)]) == 0
    assert f"ignoring incomplete checkpoint {checkpoints / 'step_000000008'}" in caplog.text
    assert f"ignoring incomplete checkpoint {checkpoints / '.tmp_step_000000010'}" in caplog.text
    assert f"resuming from {checkpoints / 'step_000000004'}" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path / "output" / "crash" / "metrics.jsonl")] == list(range(1, 13))


@pytest.mark.slow
def test_rank_mismatch_fails_clearly_and_touches_nothing(tmp_path, caplog):
    first = write_job(tmp_path / "job.yaml", "mismatch", resume_process(tmp_path, steps=4))
    assert run.main([str(first)]) == 0
    run_dir = tmp_path / "output" / "mismatch"
    work = lambda p: p.is_file() and p.name != "status.json"  # noqa: E731 - status says what happened last
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if work(p)}

    process = resume_process(tmp_path, steps=8)
    process["network"]["linear"] = 8
    assert run.main([str(write_job(tmp_path / "job.yaml", "mismatch", process))]) == 1
    assert "rank 4 vs 8" in caplog.text and str(run_dir / "checkpoints" / "step_000000004") in caplog.text
    assert not [r for r in caplog.records if r.exc_info]  # a user error: one message, no traceback
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if work(p)} == before
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "rank 4 vs 8" in status["last_error"] and status["step"] == 4


@pytest.mark.slow
def test_new_steps_lr_and_optimizer_settings_apply_on_resume(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="difftune")
    base = {"lr_scheduler": "constant", "lr": 1e-3}
    assert run.main([str(write_job(tmp_path / "job.yaml", "change", resume_process(tmp_path, steps=4, **base)))]) == 0
    changed = resume_process(tmp_path, steps=6, lr_scheduler="constant", lr=2e-3,
                             optimizer_params={"weight_decay": 0.1})
    assert run.main([str(write_job(tmp_path / "job.yaml", "change", changed))]) == 0
    lrs = [r["lr"] for r in read_metrics(tmp_path / "output" / "change" / "metrics.jsonl")]
    assert lrs == pytest.approx([1e-3] * 4 + [2e-3] * 2)
    assert "train.lr: 0.001 -> 0.002" in caplog.text and "train.steps: 4 -> 6" in caplog.text
    assert "weight_decay 0.01 -> 0.1" in caplog.text


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        folder = tmp_path / checkpoint.step_dir_name(step)
        folder.mkdir()
        (folder / checkpoint.COMPLETE_MARKER).write_text("{}")
    (tmp_path / "step_000000010").mkdir()  # incomplete: never counted, never pruned
    checkpoint.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000006", "step_000000008", "step_000000010"]


def test_second_ctrl_c_exits_at_once_but_repeats_of_the_request_do_not():
    with GracefulStop(repeat_window=0.2) as stop:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the launcher forwarding the same Ctrl-C
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested
        time.sleep(0.3)
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.slow
def test_resume_stays_exact_with_both_caches_and_shuffled_tokens(tmp_path):
    process = resume_process(tmp_path, steps=8, cache_text_embeddings=True)
    for dataset in process["datasets"]:
        dataset.update(cache_latents_to_disk=True, cache_dir=str(tmp_path / "cache"), shuffle_tokens=True,
                       caption_dropout_rate=0.2, token_dropout_rate=0.2)
    straight = write_job(tmp_path / "a.yaml", "cached_a", process)
    assert run.main([str(straight)]) == 0
    stopped = write_job(tmp_path / "b.yaml", "cached_b", process)
    with interrupt_after(3):
        assert run.main([str(stopped)]) == 0
    assert run.main([str(stopped)]) == 0
    assert per_update(tmp_path / "output" / "cached_b") == per_update(tmp_path / "output" / "cached_a")


@pytest.mark.slow
def test_continuing_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="difftune")
    process = resume_process(tmp_path, steps=8)
    assert run.main([str(write_job(tmp_path / "job.yaml", "branch", process))]) == 0
    checkpoints = tmp_path / "output" / "branch" / "checkpoints"
    process["train"].update(resume=str(checkpoints / "step_000000004"), lr=5e-4)
    assert run.main([str(write_job(tmp_path / "job.yaml", "branch", process))]) == 0
    aside = checkpoints / "abandoned_after_step_000000004"
    assert sorted(p.name for p in aside.iterdir()) == ["branch.safetensors", "step_000000008"]
    assert "moved to" in caplog.text
    process["train"]["resume"] = "auto"
    assert run.main([str(write_job(tmp_path / "job.yaml", "branch", process))]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "output" / "branch" / "metrics.jsonl")] == list(range(1, 9))
    assert read_metrics(tmp_path / "output" / "branch" / "metrics.jsonl")[-1]["lr"] < 5e-4
