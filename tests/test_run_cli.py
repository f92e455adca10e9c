"""run.py: several configs in order, --name, --recover, exit codes; the real CLI and accelerate launch."""

from __future__ import annotations

import json
import logging
import os

import pytest
import yaml
from helpers import REPO, trainer_process, write_job

import run


def broken_job(tmp_path):
    return write_job(tmp_path / "broken.yaml", "broken", trainer_process(tmp_path, datasets=[
        {"folder_path": str(tmp_path / "no_such_folder")}]))


@pytest.mark.slow
def test_recover_goes_on_after_a_failure_and_exit_code_says_it(tmp_path):
    good = write_job(tmp_path / "good.yaml", "good", trainer_process(tmp_path, train={"steps": 1}))
    assert run.main([str(broken_job(tmp_path)), str(good)]) == 1
    assert not (tmp_path / "output" / "good").exists()  # stopped at the first failure

    assert run.main([str(broken_job(tmp_path)), str(good), "--recover"]) == 1
    assert (tmp_path / "output" / "good" / "good.safetensors").is_file()


@pytest.mark.slow
def test_name_flag_fills_the_name_and_runs(tmp_path):
    job = {"job": "extension", "config": {"name": "[name]", "process": [trainer_process(tmp_path, train={"steps": 2})]}}
    (tmp_path / "shared.yaml").write_text(yaml.safe_dump(job))
    assert run.main([str(tmp_path / "shared.yaml"), "--name", "cat_v1"]) == 0
    assert (tmp_path / "output" / "cat_v1" / "cat_v1.safetensors").is_file()


@pytest.mark.slow
def test_rerun_of_a_finished_run_changes_nothing_and_resume_false_refuses(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="difftune")
    path = write_job(tmp_path / "job.yaml", "once", trainer_process(tmp_path, train={"steps": 1}))
    assert run.main([str(path)]) == 0
    run_dir = tmp_path / "output" / "once"
    # config.yaml is rewritten, status.json says who looked last; the work itself is untouched
    kept = lambda p: p.is_file() and p.name not in ("config.yaml", "status.json")  # noqa: E731
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if kept(p)}
    assert run.main([str(path)]) == 0
    assert "already complete at step 1" in caplog.text
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if kept(p)} == before
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"

    fresh = write_job(tmp_path / "job.yaml", "once", trainer_process(tmp_path, train={"steps": 1, "resume": False}))
    caplog.clear()
    assert run.main([str(fresh)]) == 1
    assert "train.resume is false" in caplog.text and "train.overwrite: true" in caplog.text
    assert not [r for r in caplog.records if r.exc_info]  # a user error: one message, no traceback
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if kept(p)} == before


def test_a_user_error_is_one_message_without_a_traceback(tmp_path, caplog, monkeypatch):
    """A missing dataset folder is found when the job file is checked, before any model loads (no run folder
    is created), and reported as one line naming the key; --debug (or DIFFTUNE_DEBUG=1) adds the traceback."""
    monkeypatch.delenv("DIFFTUNE_DEBUG", raising=False)
    assert run.main([str(broken_job(tmp_path))]) == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "config.process[0].datasets[0].folder_path: folder not found" in errors[0].getMessage()
    assert not any(r.exc_info for r in errors) and not (tmp_path / "output" / "broken").exists()
    caplog.clear()
    assert run.main([str(broken_job(tmp_path)), "--debug"]) == 1
    assert any(r.exc_info for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("DIFFTUNE_DEBUG", "1")
    assert run.main([str(broken_job(tmp_path))]) == 1
    assert any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize("launch_setting, name", [("ACCELERATE_USE_FSDP", "FSDP"),
                                                  ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")])
def test_a_sharded_launch_is_refused_before_any_model_loads(tmp_path, caplog, monkeypatch, launch_setting, name):
    """accelerate's FSDP or DeepSpeed launch (on the CPU accelerate would quietly run plain multi-process instead):
    one message naming it and what to do instead (`train.sharding: fsdp` on a --multi_gpu launch), before the model
    loads (no checkpoint, no metrics)."""
    monkeypatch.setenv(launch_setting, "true")
    path = write_job(tmp_path / "job.yaml", "sharded", trainer_process(tmp_path, model={"arch": "qwen_image",
                                                                                      "name_or_path": "missing"}))
    assert run.main([str(path)]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(f"this launch asks accelerate for {name}, which difftune does not use" in e and "--multi_gpu" in e
               and "train.sharding: fsdp" in e for e in errors), errors
    assert not (tmp_path / "output" / "sharded" / "checkpoints").exists()


def test_every_job_file_is_checked_before_the_first_one_trains(tmp_path, caplog):
    """A typo in the second file fails the command before the first file's job starts."""
    good = write_job(tmp_path / "good.yaml", "good", trainer_process(tmp_path, train={"steps": 1}))
    typo = trainer_process(tmp_path, train={"steps": 1, "learning_rat": 1e-4})
    bad = write_job(tmp_path / "typo.yaml", "typo", typo)
    assert run.main([str(good), str(bad)]) == 1
    assert "train.learning_rat: unknown key" in caplog.text
    assert not (tmp_path / "output" / "good").exists()


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    return env


@pytest.mark.slow
def test_a_later_job_may_read_what_an_earlier_one_wrote(tmp_path):
    """`run.py stage1.yaml stage2.yaml` where stage 2 starts from stage 1's LoRA: paths are checked per job."""
    first = write_job(tmp_path / "stage1.yaml", "stage1", trainer_process(tmp_path, train={"steps": 1}))
    lora = tmp_path / "output" / "stage1" / "stage1.safetensors"
    second = write_job(tmp_path / "stage2.yaml", "stage2", trainer_process(
        tmp_path, train={"steps": 1}, network={"type": "lora", "linear": 4, "linear_alpha": 4,
                                                "pretrained_lora_path": str(lora)}))
    assert run.main([str(first), str(second)]) == 0
    assert (tmp_path / "output" / "stage2" / "stage2.safetensors").is_file()
