"""Several machines, simulated on this one: two `accelerate launch --num_machines 2 --machine_rank R
--main_process_ip 127.0.0.1 --main_process_port P` commands of one process each, talking over loopback (gloo).

With one shared run folder (`train.shared_filesystem: true`, the default) every file, caches included, has one writer;
with a run folder per machine (`shared_filesystem: false`) each machine keeps what a resume needs and the main machine
alone the status, metrics, report, samples and final files. A machine killed mid-run stops the other within seconds,
and the same commands again resume from the newest checkpoint complete on both; a machine that stops answering stops the
other after `train.collective_timeout_s`. (The tiny model is built before the launches: two machines that share no
filesystem each build their own, and on this one host they would share the folder.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from helpers import REPO, make_images, trainer_process, write_job
from toolkit.run.metrics import read_metrics

#: how soon the surviving machine stops once the other is killed: its next collective fails as the connections close
#: (measured here: about 2.5 s)
STOPS_WITHIN_S = 60


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_machine(job: Path, rank: int, port: int, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """Machine `rank` of two, one training process, through the test instruments (tests/instrumented_run.py)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
               str(REPO / "tests" / "instrumented_run.py"), str(job)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    path = cwd / f"machine{rank}_{time.monotonic_ns()}.log"
    with path.open("w") as log:
        machine = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    machine.log = path
    return machine


def run_machines(jobs: list[Path], cwd: Path, env: dict | None = None, timeout: int = 600) -> list[str]:
    """Both machines to the end; their logs."""
    port = free_port()
    machines = [start_machine(job, rank, port, cwd, env) for rank, job in enumerate(jobs)]
    for machine in machines:
        assert machine.wait(timeout=timeout) == 0, machine.log.read_text()[-4000:]
    return [machine.log.read_text() for machine in machines]


def kill_machine(machine: subprocess.Popen) -> None:
    """The whole machine: its launcher and every process it started."""
    launcher = psutil.Process(machine.pid)
    for process in [*launcher.children(recursive=True), launcher]:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    machine.wait()


def machines_process(tmp: Path, folder: str, data: Path, **train) -> dict:
    """Eight updates on 8 images with both caches on disk (in `folder`), samples at 4 and 8, checkpoints every 2."""
    return trainer_process(
        tmp, training_folder=str(tmp / folder), trigger_word=None,
        datasets=[{"folder_path": str(data), "resolution": [64], "cache_latents_to_disk": True,
                   "cache_dir": str(tmp / folder / "cache")}],
        train={"steps": 8, "batch_size": 1, "cache_text_embeddings": True, **train},
        save={"save_every": 2, "max_step_saves_to_keep": 10},
        sample={"prompts": ["image number 1"], "sample_every": 4, "sample_steps": 2, "width": 64, "height": 64},
    )


def writers(record: Path) -> dict[str, set[int]]:
    found: dict[str, set[int]] = defaultdict(set)
    for log in record.glob("rank*.txt"):
        for line in log.read_text().splitlines():
            found[line].add(int(log.stem[4:]))
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_machines_on_one_shared_folder_write_each_file_once_and_resume(tmp_path, tiny_sd15):
    """DDP over two machines sharing the run folder: stopped by Ctrl-C after 3 updates, then the same two commands
    again: the run ends at step 8, every file (checkpoints, caches, status, metrics, samples, final LoRA) written by
    one process only, the caches' entries shared out between the two."""
    data = make_images(tmp_path / "data", 8, size=(64, 64))
    job = write_job(tmp_path / "job.yaml", "shared", machines_process(tmp_path, "output", data))
    record = tmp_path / "writes"
    record.mkdir()
    env = {"DIFFTUNE_TEST_RECORD_WRITES": f"{record}:{tmp_path}"}
    stopped = run_machines([job, job], tmp_path, {**env, "DIFFTUNE_TEST_INTERRUPT_AFTER": "3"})
    assert "stopped at step 3" in stopped[0]
    resumed = run_machines([job, job], tmp_path, env)
    assert "resuming from" in resumed[0] and "at step 3" in resumed[0]
    run_dir = tmp_path / "output" / "shared"
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r] == list(range(1, 9))
    assert (run_dir / "shared.safetensors").is_file()
    written = writers(record)
    twice = {path: ranks for path, ranks in written.items() if len(ranks) > 1}
    assert not twice, twice
    by_rank = defaultdict(list)
    for path, ranks in written.items():
        by_rank[ranks.pop()].append(path)
    cache = str(tmp_path / "output" / "cache")
    # the second machine wrote only its RNG files and its share of the cache entries
    assert by_rank[1] and all(p.endswith("rng_rank1.pt") or p.startswith(cache) for p in by_rank[1]), by_rank[1]
    assert any(p.startswith(cache) for p in by_rank[1]) and any(p.startswith(cache) for p in by_rank[0])
    for name in ("status.json", "metrics.jsonl", "report.html", "shared.safetensors", "samples/step_000000004_0.png"):
        assert str(run_dir / name) in by_rank[0], name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_machines_with_their_own_folders_survive_a_killed_machine(tmp_path, tiny_sd15):
    """FSDP over two machines, each with its own run folder and caches (`shared_filesystem: false`). The second
    machine killed (launcher and training process) after its checkpoint of step 4: the first stops within
    `STOPS_WITHIN_S`. The newest checkpoint of the second machine set aside, the same two commands resume both from
    the newest complete on both, and finish. The second machine's folder holds only what a resume needs."""
    data = make_images(tmp_path / "data", 8, size=(64, 64))
    jobs = [write_job(tmp_path / f"machine{rank}.yaml", "own",
                      machines_process(tmp_path, f"machine{rank}", data, steps=400, sharding="fsdp",
                                       shared_filesystem=False)) for rank in (0, 1)]
    port = free_port()
    machines = [start_machine(job, rank, port, tmp_path) for rank, job in enumerate(jobs)]
    second = tmp_path / "machine1" / "own" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (second / "step_000000004").is_dir():
        assert time.monotonic() < deadline and machines[0].poll() is None and machines[1].poll() is None
        time.sleep(0.2)
    kill_machine(machines[1])
    killed = time.monotonic()
    returncode = machines[0].wait(timeout=STOPS_WITHIN_S + 30)
    stopped_after = time.monotonic() - killed
    assert returncode != 0 and stopped_after < STOPS_WITHIN_S, stopped_after
    first = tmp_path / "machine0" / "own" / "checkpoints"

    def complete(folder: Path) -> set[str]:
        return {p.name for p in folder.glob("step_*") if (p / "train_state.json").is_file()}

    # the second machine's newest checkpoint set aside: the first machine has newer ones than the common newest
    latest = max(complete(second))
    (second / latest).rename(second / f"aside_{latest}")
    newest = max(complete(first) & complete(second))
    assert max(complete(first)) > newest
    jobs = [write_job(tmp_path / f"machine{rank}.yaml", "own",
                      machines_process(tmp_path, f"machine{rank}", data, steps=int(newest[5:]) + 4, sharding="fsdp",
                                       shared_filesystem=False)) for rank in (0, 1)]
    logs = run_machines(jobs, tmp_path)
    assert f"resuming from {first / newest}" in logs[0]
    main, other = tmp_path / "machine0" / "own", tmp_path / "machine1" / "own"
    steps = [r["step"] for r in read_metrics(main / "metrics.jsonl") if "loss" in r]
    assert steps[-1] == int(newest[5:]) + 4
    for name in ("status.json", "metrics.jsonl", "report.html", "own.safetensors", "samples"):
        assert (main / name).exists() and not (other / name).exists(), name
    last = f"step_{int(newest[5:]) + 4:09d}"
    assert sorted(p.name for p in (other / "checkpoints" / last).iterdir()) == [
        "lora.safetensors", "optimizer.pt", "rng_rank1.pt", "scheduler.pt", "train_state.json"]
    ours, theirs = (load_file(str(folder / "checkpoints" / last / "lora.safetensors")) for folder in (main, other))
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)
    entries = [sorted(p.relative_to(tmp_path / f"machine{rank}") for p in (tmp_path / f"machine{rank}" / "cache").rglob("*")
                      if p.is_file()) for rank in (0, 1)]
    assert entries[0] and entries[0] == entries[1]  # each machine has every cache entry


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_machine_that_stops_answering_stops_the_other_after_the_collective_timeout(tmp_path, tiny_sd15):
    """The second machine frozen (SIGSTOP: its connections stay open, as when a machine loses power or its network
    without closing them): the first stops once a collective has waited `train.collective_timeout_s` (here 10 s),
    not later than that plus `STOPS_WITHIN_S`, naming the timeout."""
    data = make_images(tmp_path / "data", 8, size=(64, 64))
    jobs = [write_job(tmp_path / f"machine{rank}.yaml", "frozen",
                      machines_process(tmp_path, f"machine{rank}", data, steps=400, collective_timeout_s=10,
                                       shared_filesystem=False)) for rank in (0, 1)]
    port = free_port()
    machines = [start_machine(job, rank, port, tmp_path) for rank, job in enumerate(jobs)]
    second = tmp_path / "machine1" / "frozen" / "checkpoints"
    deadline = time.monotonic() + 300
    try:
        while not (second / "step_000000004").is_dir():
            assert time.monotonic() < deadline and machines[0].poll() is None and machines[1].poll() is None
            time.sleep(0.2)
        launcher = psutil.Process(machines[1].pid)
        for process in [*launcher.children(recursive=True), launcher]:
            process.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        returncode = machines[0].wait(timeout=10 + STOPS_WITHIN_S + 30)
        stopped_after = time.monotonic() - frozen
    finally:
        kill_machine(machines[1])
        if machines[0].poll() is None:
            kill_machine(machines[0])
    assert returncode != 0 and 10 <= stopped_after < 10 + STOPS_WITHIN_S, stopped_after
    assert "Timed out" in machines[0].log.read_text()
