"""The dashboard's pieces without a server: reading metrics as they grow, run names, config errors by key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from toolkit.config.loader import ConfigError
from toolkit.ui.jobs import problems_of
from toolkit.ui.runs import MetricsTail, UnknownRun, find_runs, run_folder


def test_metrics_are_read_incrementally_and_again_after_a_rewrite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail()
    assert tail.read(path) == []
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')  # a line being written is not read yet
    assert [r["step"] for r in tail.read(path)] == [1, 2]
    with path.open("a") as handle:
        handle.write('ep": 3}\n')
    assert [r["step"] for r in tail.read(path)] == [1, 2, 3]
    replacement = tmp_path / "new.jsonl"
    replacement.write_text('{"step": 1}\n')
    os.replace(replacement, path)  # a resume cuts the file back atomically
    assert [r["step"] for r in tail.read(path)] == [1]


def test_run_names_never_leave_the_training_folder(tmp_path):
    (tmp_path / "out" / "a").mkdir(parents=True)
    (tmp_path / "out" / "a" / "status.json").write_text("{}")
    (tmp_path / "out" / "nested" / "b").mkdir(parents=True)
    (tmp_path / "out" / "nested" / "b" / "config.yaml").write_text("")
    (tmp_path / "out" / ".queue").mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "config.yaml").write_text("")
    root = tmp_path / "out"
    assert find_runs(root) == ["a", "nested/b"]
    assert run_folder(root, "nested/b") == (root / "nested" / "b").resolve()
    for name in ("../secret", "/etc", "a/..", ".queue", "nested", "a\x00"):
        with pytest.raises(UnknownRun):
            run_folder(root, name)


def test_config_errors_become_problems_by_key(tmp_path):
    shown = tmp_path / ".incoming-1.yaml"
    error = ConfigError(f"{shown}: invalid config\n  config.process[0].train.lrr: unknown key (did you mean 'lr'?)\n"
                        "  config.process[0].datasets: required key is missing")
    assert problems_of(error, shown, "job.yaml") == [
        {"key": "config.process[0].train.lrr", "message": "unknown key (did you mean 'lr'?)"},
        {"key": "config.process[0].datasets", "message": "required key is missing"}]
    assert problems_of(ConfigError(f"{shown}: cannot parse: bad"), shown, "job.yaml") == [
        {"key": "", "message": "job.yaml: cannot parse: bad"}]


FAKE_RUN = """
import json, os, sys, time
from pathlib import Path
job = Path(sys.argv[-1])
# written whole, then renamed: the test polls for the file and must never read it half-written
Path(str(job) + ".seen.tmp").write_text(json.dumps({"argv": sys.argv, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}))
os.replace(str(job) + ".seen.tmp", str(job) + ".seen")
while not Path(str(job) + ".release").exists():
    time.sleep(0.02)
"""


def test_queued_jobs_run_in_order_one_per_gpu_set(tmp_path, registry):
    """The scheduling alone, with a stand-in for run.py: two GPU sets run two jobs at once, each with its
    CUDA_VISIBLE_DEVICES; the third starts when a set is free; a set of several devices goes through accelerate."""
    import sys
    import time

    import yaml
    from helpers import REPO, trainer_process

    from toolkit.ui.jobs import JobQueue

    fake = tmp_path / "fake_run.py"
    fake.write_text(FAKE_RUN)
    queue = JobQueue(tmp_path / "out", registry, REPO / "config", [sys.executable, str(fake)], cwd=tmp_path,
                     gpu_sets=["0", "1"])
    jobs = []
    for name in ("a", "b", "c"):
        text = yaml.safe_dump({"config": {"name": name, "process": [trainer_process(tmp_path / "out")]}})
        job, problems = queue.submit(text)
        assert problems == []
        jobs.append(job)

    def seen(job):
        path = Path(str(queue.job_file(job)) + ".seen")
        return json.loads(path.read_text()) if path.is_file() else None

    def wait(check):
        deadline = time.monotonic() + 30
        while not check():
            assert time.monotonic() < deadline
            queue.tick()
            time.sleep(0.05)

    queue.tick()
    wait(lambda: seen(jobs[0]) and seen(jobs[1]))
    assert [seen(j)["gpus"] for j in jobs[:2]] == ["0", "1"] and seen(jobs[1])["argv"][1] == "--quiet"
    assert [j.state for j in queue.jobs()] == ["running", "running", "queued"]
    Path(str(queue.job_file(jobs[1])) + ".release").write_text("")
    wait(lambda: seen(jobs[2]))
    assert seen(jobs[2])["gpus"] == "1"  # the set job b left
    states = [j.state for j in queue.jobs()]
    assert states[0] == "running" and states[1] == "failed" and states[2] == "running"  # b never began its run
    assert queue.jobs()[1].returncode == 0  # its exit code, known to the dashboard that started it
    for job in (jobs[0], jobs[2]):
        Path(str(queue.job_file(job)) + ".release").write_text("")
    wait(lambda: all(j.state != "running" for j in queue.jobs()))
    command, env = queue.command(jobs[0], "2,3")
    assert command[1:7] == ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", str(fake)]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_an_exited_process_not_yet_reaped_is_not_alive():
    import subprocess
    import sys
    import time

    from toolkit.run.control import process_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().split(")")[-1].split()[0] != "Z":  # exited, not reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not process_alive(child.pid)
    child.wait()
    assert not process_alive(child.pid) and process_alive(os.getpid())


def fake_queue(tmp_path, registry, gpu_sets=None, cwd=None):
    import sys

    from helpers import REPO

    from toolkit.ui.jobs import JobQueue

    fake = tmp_path / "fake_run.py"
    fake.write_text(FAKE_RUN)
    return JobQueue(tmp_path / "out", registry, REPO / "config", [sys.executable, str(fake)], cwd=cwd or tmp_path,
                    gpu_sets=gpu_sets)


def job_yaml(tmp_path, name: str, processes: int = 1) -> str:
    import yaml
    from helpers import trainer_process

    return yaml.safe_dump({"config": {"name": name, "process": [trainer_process(tmp_path / "out")
                                                               for _ in range(processes)]}})


def release_all(queue) -> None:
    """Let every stand-in process end, and wait for those this queue started."""
    for job in queue.jobs():
        Path(str(queue.job_file(job)) + ".release").write_text("")
    for child in queue.children.values():
        child.wait(timeout=30)


def test_two_jobs_of_one_run_folder_never_run_at_once(tmp_path, registry):

    queue = fake_queue(tmp_path, registry, gpu_sets=["0", "1"])
    first, _ = queue.submit(job_yaml(tmp_path, "same"))
    second, _ = queue.submit(job_yaml(tmp_path, "same"))
    try:
        queue.tick()
        queue.tick()
        jobs = queue.jobs()
        assert [j.state for j in jobs] == ["running", "queued"]  # a GPU set is free, the folder is not
        assert jobs[1].note == f"waiting: job {first.id} trains in its run folder"
    finally:
        release_all(queue)


def test_a_job_left_starting_is_adopted_or_failed_never_started_again(tmp_path, registry):
    import subprocess
    import sys
    import time

    queue = fake_queue(tmp_path, registry, gpu_sets=["0", "1"])  # a free set: starting `lost` again is possible
    lost, _ = queue.submit(job_yaml(tmp_path, "lost"))
    begun, _ = queue.submit(job_yaml(tmp_path, "begun"))
    for job in (lost, begun):  # as a dashboard that ended between saving `starting` and saving the pid leaves them
        job.state, job.started_at = "starting", time.time()
        queue.save(job)
    process = subprocess.Popen([sys.executable, str(tmp_path / "fake_run.py"), "--quiet", str(queue.job_file(begun))])
    try:
        queue.tick()
        states = {job.name: job for job in queue.jobs()}
        assert states["lost"].state == "failed" and "ended while starting" in states["lost"].note
        assert states["begun"].state == "running" and states["begun"].pid == process.pid
        assert not Path(str(queue.job_file(lost)) + ".seen").exists()  # not started again
    finally:
        release_all(queue)
        process.wait(timeout=30)


def test_a_job_killed_while_its_process_exits_ends_crashed_once_the_process_is_gone(tmp_path, registry, monkeypatch):
    """A job watched by its pid (started by an earlier dashboard), killed: for a moment its process is alive but
    its command line reads empty (its memory is released) and its run's status still says `running`. The queue
    knows the process by its start time and keeps watching it then, rather than ending it as a job whose run never
    began (`failed`); once the process is gone the job ends `crashed`. Another process that got the pid is not
    the job's."""
    import subprocess
    import sys
    import time

    from toolkit.run import control
    from toolkit.ui import jobs

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().split(")")[-1].split()[0] != "Z":  # exited, not reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert Path(f"/proc/{child.pid}/cmdline").read_bytes() == b""  # as an exiting process's reads
    queue = fake_queue(tmp_path, registry)
    job, _ = queue.submit(job_yaml(tmp_path, "killed"))
    ticks = control.process_start_ticks(child.pid)
    job.state, job.pid, job.process_start, job.started_at = "running", child.pid, ticks, time.time() - 5
    queue.save(job)
    control.Status(state="running", pid=child.pid, process_start=ticks).write(Path(job.run_folder))
    try:
        with monkeypatch.context() as exiting:  # not a zombie yet: alive, to the queue and to the run's status
            exiting.setattr(jobs, "process_alive", lambda pid: True)
            exiting.setattr(control, "process_alive", lambda pid: True)
            other = queue.job(job.id)
            other.process_start = ticks - 1  # the pid's process started at another moment: not the job's
            assert not queue.still_runs(other)
            queue.check_running(queue.job(job.id))
            assert queue.job(job.id).state == "running"
        queue.check_running(queue.job(job.id))
        assert queue.job(job.id).state == "crashed"
    finally:
        child.wait()


def test_a_job_whose_process_cannot_start_fails_and_the_queue_goes_on(tmp_path, registry):
    import time

    queue = fake_queue(tmp_path, registry, cwd=tmp_path / "gone")
    (tmp_path / "gone").mkdir()
    broken, _ = queue.submit(job_yaml(tmp_path, "broken"))
    (tmp_path / "gone").rmdir()  # its working folder is gone by the time it starts
    queue.tick()
    job = queue.job(broken.id)
    assert job.state == "failed" and job.note.startswith("could not start")
    time.sleep(0.05)
    queue.tick()  # and nothing is retried
    assert queue.job(broken.id).state == "failed"


def test_the_queue_refuses_what_run_py_would_take_from_its_own_user(tmp_path, registry):
    queue = fake_queue(tmp_path, registry)
    with_env = job_yaml(tmp_path, "env").replace("name: env", "name: ${HOME}")
    _, problems = queue.submit(with_env)
    assert "${HOME}" in problems[0]["message"] and "environment" in problems[0]["message"]
    escaped = job_yaml(tmp_path, "env").replace("name: env", 'name: "$\\x7BHOME}"')  # YAML undoes the escape
    _, problems = queue.submit(escaped)
    assert "${HOME}" in problems[0]["message"]
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b]\n"
    _, problems = queue.submit(bomb)
    assert "aliases" in problems[0]["message"]
    _, problems = queue.submit(job_yaml(tmp_path, "two", processes=2))
    assert problems[0]["key"] == "config.process" and "one process" in problems[0]["message"]
    assert queue.jobs() == []


def test_a_pid_taken_by_a_later_process_or_another_machine_is_told_apart(tmp_path):
    import subprocess
    import sys
    import time

    from toolkit.run import control

    # the run's process started at another moment: this process only got its old pid
    mine = control.process_start_ticks(os.getpid())
    control.Status(state="running", pid=os.getpid(), process_start=mine - 1).write(tmp_path)
    assert control.run_state(tmp_path).state == "crashed"
    control.Status(state="running", pid=os.getpid()).write(tmp_path)
    assert control.run_state(tmp_path).state == "running"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    # a run on another machine sharing the folder: its pid means nothing here, it is not called crashed
    control.Status(state="running", pid=gone.pid, host="another-machine").write(tmp_path)
    assert control.run_state(tmp_path).state == "running"
    silent = json.loads((tmp_path / "status.json").read_text()) | {"updated_at": time.time() - 3600}
    (tmp_path / "status.json").write_text(json.dumps(silent))  # and has said nothing for an hour
    found = control.run_state(tmp_path)
    assert found.state == "unknown" and "another-machine" in found.note
    (tmp_path / "status.json").write_text('{"state": "running", "pid": null, "step": 1}')
    assert control.run_state(tmp_path).state == "unknown"  # a hand-edited file is not a status


def test_a_second_dashboard_takes_the_queue_over_when_the_first_ends(tmp_path, registry):
    import time

    from toolkit.ui.jobs import QueueRunner

    first, second = (QueueRunner(fake_queue(tmp_path, registry), interval=0.02) for _ in range(2))
    try:
        assert first.start() and not second.start()
        first.stop()
        deadline = time.monotonic() + 10
        while not second.holding:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        first.stop()
        second.stop()


def test_byte_ranges_as_video_players_ask_for_them():
    from toolkit.ui.server import byte_range

    assert byte_range("bytes=0-9", 50) == (0, 9)
    assert byte_range("bytes=40-", 50) == (40, 49) and byte_range("bytes=-5", 50) == (45, 49)
    assert byte_range("bytes=10-1000", 50) == (10, 49)  # clipped to the file
    assert byte_range("bytes=50-", 50) is None and byte_range("bytes=-0", 50) is None  # nothing there: 416
    for whole in ("items=0-1", "bytes=0-1,4-5", "bytes=3-2", "bytes=x-"):  # not taken: the whole file
        assert byte_range(whole, 50) == (0, 49)


def test_gpu_sets_must_not_share_a_device():
    from toolkit.ui.app import gpu_set_problem

    assert gpu_set_problem([]) is None and gpu_set_problem(["0,1", "2,3"]) is None
    assert "share device 1" in gpu_set_problem(["0,1", "1,2"])
    assert "device ids" in gpu_set_problem(["0,,1"])


def test_a_samples_references_come_with_it_in_slot_order(tmp_path):
    """The run page's samples carry their prompt's reference images (kept by the sampler in samples/ as
    reference_<prompt>_<slot>), served from the run's files; a prompt without references has none."""
    from PIL import Image

    from toolkit.ui.runs import RunReader

    samples = tmp_path / "out" / "edit" / "samples"
    samples.mkdir(parents=True)
    (samples.parent / "status.json").write_text("{}")
    for name in ("step_000000002_0.png", "step_000000002_1.png", "reference_0_1.jpg", "reference_0_0.png"):
        Image.new("RGB", (4, 4)).save(samples / name)
    found = RunReader(tmp_path / "out").samples(samples.parent, "edit")
    by_prompt = {s["index"]: s["references"] for s in found}
    assert by_prompt == {0: ["/runs/edit/files/samples/reference_0_0.png", "/runs/edit/files/samples/reference_0_1.jpg"],
                         1: []}
