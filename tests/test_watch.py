"""Watching and steering a run: samples, metrics, report.html, control requests and status.json."""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, launch, run_job, trainer_process, write_job
from PIL import Image

import run
from toolkit.config.loader import ConfigError
from toolkit.run import control
from toolkit.run.metrics import read_metrics

INSTRUMENTED = REPO / "tests" / "instrumented_run.py"
PROMPTS = ["[trigger], a red circle", "a blue square"]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory, registry, tiny_sd15):
    """6 updates with samples every 2 (and a baseline), next to the same run without samples."""
    tmp = tmp_path_factory.mktemp("watch")
    runs = {}
    for name, sample in (("with", {"sample_every": 2, "prompts": PROMPTS, "sample_at_start": True,
                                   "sample_steps": 2, "width": 64, "height": 64, "seed": 7}),
                         ("without", {})):
        process = trainer_process(tmp, train={"steps": 6}, save={"save_every": 3}, sample=sample)
        runs[name] = run_job(tmp, registry, name, process)
    return runs


@pytest.mark.slow
def test_samples_are_written_with_their_metadata(sampled):
    _, run_dir = sampled["with"]
    names = sorted(p.name for p in (run_dir / "samples").iterdir())
    assert names == [f"step_{step:09d}_{i}.png" for step in (0, 2, 4, 6) for i in (0, 1)]
    info = Image.open(run_dir / "samples" / "step_000000004_1.png").text
    assert info["prompt"] == "a blue square" and info["seed"] == "8" and info["step"] == "4"  # walk_seed: 7 + 1
    assert info["model"] == "tiny"
    assert Image.open(run_dir / "samples" / "step_000000002_0.png").text["prompt"] == "shp, a red circle"


@pytest.mark.slow
def test_sampling_does_not_change_training(sampled):
    with_samples = read_metrics(sampled["with"][1] / "metrics.jsonl")
    without = read_metrics(sampled["without"][1] / "metrics.jsonl")
    assert [r["loss"] for r in with_samples] == [r["loss"] for r in without]
    assert [r["grad_norm"] for r in with_samples] == [r["grad_norm"] for r in without]


@pytest.mark.slow
def test_metrics_lines_carry_throughput_and_memory(sampled):
    records = read_metrics(sampled["without"][1] / "metrics.jsonl")
    for record in records:
        assert record["samples_per_s"] > 0 and record["rss_mib"] > 0
        assert {"step", "epoch", "loss", "loss_main", "lr", "grad_norm", "time"} <= set(record)


def svg_series(page: str) -> dict[str, int]:
    """Series name -> number of points of each polyline in the page."""
    return {html_name: len(points.split())
            for html_name, points in re.findall(r'data-series="([^"]+)" points="([^"]*)"', page)}


@pytest.mark.slow
def test_report_plots_every_metric_and_shows_the_samples(sampled):
    _, run_dir = sampled["with"]
    page = (run_dir / "report.html").read_text()
    records = read_metrics(run_dir / "metrics.jsonl")
    series = svg_series(page)
    metrics = {k for r in records for k, v in r.items() if isinstance(v, (int, float)) and k not in ("step", "epoch")}
    assert metrics and metrics <= set(series)
    assert all(series[name] == len(records) for name in metrics)
    assert series["loss (smoothed)"] == len(records)
    for path in (run_dir / "samples").iterdir():  # embedded: the page alone shows them
        embedded = re.search(rf'src="data:image/png;base64,([A-Za-z0-9+/=]+)" title="samples/{path.name}"', page)
        assert embedded and base64.b64decode(embedded.group(1)) == path.read_bytes()
    assert all(source.startswith("data:") for source in re.findall(r'\b(?:src|href)="([^"]*)"', page))
    assert "total updates" in page and "name_or_path: tiny" in page  # the plan and the resolved config
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page  # no network


@pytest.mark.slow
def test_report_command_rebuilds_the_same_file(sampled, capsys):
    _, run_dir = sampled["with"]
    written = (run_dir / "report.html").read_bytes()
    (run_dir / "report.html").unlink()
    assert run.main(["--report", str(run_dir)]) == 0
    assert (run_dir / "report.html").read_bytes() == written


@pytest.mark.slow
def test_status_of_a_finished_run(sampled, capsys):
    _, run_dir = sampled["with"]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert run.main(["--status", str(run_dir)]) == 0
    assert "finished, step 6/6" in capsys.readouterr().out


@pytest.mark.slow
def test_status_of_a_running_and_of_a_crashed_run(tmp_path, capsys):
    control.Status(state="running", pid=os.getpid(), step=3, total=10).write(tmp_path)
    assert run.main(["--status", str(tmp_path)]) == 0
    assert "running, step 3/10" in capsys.readouterr().out
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    control.Status(state="running", pid=gone.pid, step=3, total=10).write(tmp_path)
    assert run.main(["--status", str(tmp_path)]) == 1
    said = capsys.readouterr().out
    assert "crashed, nothing saved yet" in said and "starts over" in said and "resume" not in said
    (tmp_path / "checkpoints" / "step_000000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000000002" / "train_state.json").write_text("{}")
    assert run.main(["--status", str(tmp_path)]) == 1
    said = capsys.readouterr().out
    assert "crashed, step 3/10" in said and "resumes from step_000000002" in said


def test_status_file_follows_the_step_at_most_a_second_behind(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(control.time, "time", lambda: clock[0])
    monitor = control.RunMonitor(tmp_path, enabled=True, total=10)
    monitor.started(0)
    seen = []
    for step in range(1, 8):
        clock[0] += 0.4  # 0.4 s per update: the file is rewritten at the update a second after the last write
        monitor.heartbeat(step)
        monitor.writer.drain()  # written by the status thread: wait for it before reading
        written = control.read_status(tmp_path)
        assert step - written.step <= 2 and clock[0] - written.updated_at < 1.0 and written.state == "running"
        seen.append(written.step)
    assert seen == [0, 0, 3, 3, 3, 6, 6]
    # the end is written at once, without waiting for a heartbeat still on its way, and never overwritten by it
    import threading
    import time

    held = threading.Event()
    monitor.writer.submit(lambda: held.wait(10))  # the status thread busy: the next heartbeat waits behind it
    clock[0] += 1.0
    monitor.heartbeat(8)
    began = time.monotonic()
    monitor.ended("finished", 10)  # does not wait for it
    assert time.monotonic() - began < 5
    assert control.read_status(tmp_path).state == "finished"
    held.set()
    monitor.writer.drain()
    assert control.read_status(tmp_path).state == "finished"  # the late heartbeat was dropped


def test_background_writes_run_in_order_raise_their_errors_and_the_thread_ends_when_idle(monkeypatch):
    import threading
    import time

    from toolkit.run import background

    monkeypatch.setattr(background, "IDLE_S", 0.05)
    writer = background.BackgroundWriter("test writer")
    done, callers = [], []

    def write(n):
        time.sleep(0.001 * (n % 3))
        done.append(n)
        callers.append(threading.current_thread().name)

    for n in range(30):
        writer.submit(lambda n=n: write(n))
    writer.drain()
    assert done == list(range(30)) and set(callers) == {"test writer"}
    deadline = time.monotonic() + 5
    while writer.thread is not None:  # idle: the thread ends
        assert time.monotonic() < deadline
        time.sleep(0.01)
    writer.submit(lambda: write(30))  # and a new one starts for the next write
    writer.drain()
    assert done[-1] == 30

    def fail():
        raise OSError("disk full")

    writer.submit(fail)
    writer.put(lambda: write(31))  # later writes still run (`submit` would raise the failure here, if it came first)
    with pytest.raises(OSError, match="disk full"):
        writer.drain()
    assert done[-1] == 31
    writer.drain()  # raised once


def test_metrics_lines_are_written_in_order_and_read_back_after_a_drain(tmp_path):
    from toolkit.run.metrics import MetricsWriter, read_metrics

    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    for step in range(1, 201):
        writer.write({"step": step, "loss": float("nan") if step == 7 else 1.0 / step})
    writer.drain()
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == list(range(1, 201)) and lines[6]["loss"] is None
    writer.write({"step": 201})
    writer.close()
    assert read_metrics(tmp_path / "metrics.jsonl")[-1] == {"step": 201}
    MetricsWriter(tmp_path / "off.jsonl", enabled=False).write({"step": 1})
    assert not (tmp_path / "off.jsonl").exists()


def test_lines_that_come_fast_are_written_together_within_the_hand_over_time_whatever_follows(tmp_path, monkeypatch):
    import time

    from toolkit.run import metrics
    from toolkit.run.metrics import MetricsWriter, read_metrics

    monkeypatch.setattr(metrics, "HAND_OVER_S", 1.0)
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    handed = []
    submit = writer.writer.submit
    monkeypatch.setattr(writer.writer, "submit", lambda write: handed.append(write) or submit(write))

    def steps() -> list[int]:
        return [r["step"] for r in read_metrics(path)] if path.exists() else []

    def soon(expected: list[int], within: float) -> bool:
        deadline = time.monotonic() + within
        while steps() != expected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    writer.write({"step": 1})  # the first line is written at once
    assert soon([1], within=2.0)
    for step in range(2, 6):  # four more right after it wait for the hand-over time, with one hand-over
        writer.write({"step": step})
    time.sleep(0.1)
    assert steps() == [1] and len(handed) == 2
    assert soon([1, 2, 3, 4, 5], within=3.0)  # then are written with nothing more from the loop: no drain, no line
    writer.write({"step": 6})
    began = time.monotonic()
    writer.drain()  # a drain writes what waits at once
    assert steps() == list(range(1, 7)) and time.monotonic() - began < 0.3
    writer.write({"step": 7})
    writer.close()  # and so does close
    assert steps() == list(range(1, 8))


@pytest.fixture(scope="module")
def steered_then_failed(tmp_path_factory):
    """One two-process launch (a launch costs two interpreters' imports): `steer`, whose main process asks for a
    save after update 2 and a sample after update 3 through the real `run.py --control` and then trains on to its
    end; then `fail`, whose process 1 raises in its second micro-batch."""
    tmp = tmp_path_factory.mktemp("steer")
    steer = trainer_process(tmp, train={"steps": 8, "batch_size": 1}, save={"save_every": 0, "max_step_saves_to_keep": 4},
                            sample={"prompts": ["a red circle"], "sample_steps": 1, "width": 64, "height": 64})
    fail = trainer_process(tmp, train={"steps": 20})
    files = [write_job(tmp / "steer.yaml", "steer", steer), write_job(tmp / "fail.yaml", "fail", fail)]
    result = launch(files[0], 2, tmp, script=INSTRUMENTED, extra_jobs=[str(files[1])], timeout=300,
                    env={"DIFFTUNE_TEST_CONTROL_AFTER": "2:save,3:sample", "DIFFTUNE_TEST_FAIL_RANK": "1",
                         "DIFFTUNE_TEST_FAIL_JOB": "fail"})
    return tmp / "output", result


@pytest.mark.slow
@pytest.mark.multiprocess
def test_control_save_and_sample_act_once_on_two_processes(steered_then_failed):
    """The main process reads the requests, both act on the agreed decision, each once; a one-process run acts on
    the dashboard's requests, stop included, in tests/test_ui.py (and a two-process stop is Ctrl-C's, in
    tests/test_resume.py)."""
    output, result = steered_then_failed
    run_dir = output / "steer"
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, 9)), result.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000000002", "step_000000008"]
    # the requested one, and the end's (sample_every 0: samples at the end only)
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == ["step_000000003_0.png", "step_000000008_0.png"]
    assert not list((run_dir / "control").iterdir())  # every request was acted on and removed
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_failing_process_ends_the_launch_and_the_run_says_failed(steered_then_failed):
    """One rank raising must not leave the others waiting at a barrier: the launch fails, naming the error."""
    output, result = steered_then_failed
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr
    # the main process said how the run ended (its own error: the lost peer; the failing rank's is in the log)
    assert json.loads((output / "fail" / "status.json").read_text())["state"] == "failed"
    assert run.main(["--status", str(output / "fail")]) == 1


def test_control_refuses_unknown_actions_and_folders(tmp_path):
    assert run.main(["--control", str(tmp_path), "pause"]) == 2
    assert run.main(["--control", str(tmp_path / "absent"), "stop"]) == 2
    assert not (tmp_path / "control").exists()


@pytest.mark.slow
def test_tensorboard_logs_the_metrics(tmp_path, registry, tiny_sd15):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = run_job(tmp_path, registry, "tb", trainer_process(tmp_path, train={"steps": 3},
                                                                   logging={"tensorboard": True}))
    events = list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert events
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("loss")] == [1, 2, 3]


@pytest.mark.slow
def test_tensorboard_shows_each_update_once_after_a_resume(tmp_path, registry, tiny_sd15):
    """Continuing from an older checkpoint cuts TensorBoard's event files back to it, as metrics.jsonl: updates 3
    and 4, logged again by the continued run, are in the files once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    process = trainer_process(tmp_path, train={"steps": 4}, save={"save_every": 2, "max_step_saves_to_keep": 3},
                              logging={"tensorboard": True})
    _, run_dir = run_job(tmp_path, registry, "tb", process)
    process["train"]["resume"] = str(run_dir / "checkpoints" / "step_000000002")
    run_job(tmp_path, registry, "tb", process)
    steps = [event.step for path in sorted((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
             for event in EventFileLoader(str(path)).Load()
             if any(value.tag == "loss" for value in event.summary.value)]
    assert sorted(steps) == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_requests_from_before_a_run_started_are_dropped(tmp_path, registry, tiny_sd15, caplog):
    """A stop left in control/ (e.g. sent to a run that had already finished) must not stop a later run."""
    stale = tmp_path / "output" / "later" / "control" / "1000-1-stop.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    with caplog.at_level(logging.WARNING, logger="difftune"):
        _, run_dir = run_job(tmp_path, registry, "later", trainer_process(tmp_path, train={"steps": 3}))
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert "ignoring 1 control request" in caplog.text and not stale.exists()


@pytest.mark.slow
def test_a_run_that_fails_in_setup_says_so_in_its_status(tmp_path, registry):
    process = trainer_process(tmp_path, model={"arch": "sd15", "name_or_path": str(tmp_path / "absent_model")})
    with pytest.raises(ConfigError, match="model.name_or_path: .* looks like a local path"):
        run_job(tmp_path, registry, "broken", process)
    status = json.loads((tmp_path / "output" / "broken" / "status.json").read_text())
    assert status["state"] == "failed" and "looks like a local path" in status["last_error"]


def test_control_needs_a_running_trainer(tmp_path):
    control.Status(state="finished", pid=os.getpid(), step=3, total=3).write(tmp_path)
    assert run.main(["--control", str(tmp_path), "stop"]) == 2
    assert not (tmp_path / "control").exists()


@pytest.mark.slow
def test_an_unreadable_status_file_is_replaced_not_fatal(tmp_path, registry, tiny_sd15):
    run_dir = tmp_path / "output" / "odd"
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text("{not json")
    assert run.main(["--status", str(run_dir)]) == 1
    run_job(tmp_path, registry, "odd", trainer_process(tmp_path, train={"steps": 1}))
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
