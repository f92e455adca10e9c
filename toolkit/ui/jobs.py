"""The dashboard's job queue: a folder of files, `<training folder>/.queue/`.

Each job is `<id>.job.yaml` (the job file as submitted; `.job.json` for a JSON one), `<id>.json` (its state: queued, running, finished, stopped,
failed, crashed, cancelled; the process running it) and `<id>.log` (that process's output). Ids are zero-padded
submission numbers, so the queue's order is the order of the file names and survives a restart of the dashboard.

A job runs as its own `run.py` process (through `accelerate launch` when its GPU set has several devices), in a
session of its own: stopping or restarting the dashboard never stops it, and a restarted dashboard finds it by its
pid and watches it instead of starting it again. How a job ended is read from its run folder's status.json, the
same file `run.py --status` reads. One dashboard at a time runs a folder's queue (a lock file); another one on the
same folder shows it without starting anything.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from toolkit.config.loader import ENV_PATTERN, ConfigError, check_paths, load_config, read_raw
from toolkit.config.preflight import written_folders
from toolkit.errors import UserError
from toolkit.files import write_json_atomic, write_text_atomic
from toolkit.run.control import process_alive, process_start_ticks, run_state, same_process

log = logging.getLogger("difftune")

QUEUE_DIR = ".queue"
#: "starting": saved just before its process is started, "running" once its pid is saved
JOB_STATES = ("queued", "starting", "running", "finished", "stopped", "failed", "crashed", "cancelled")
#: a job's id: its submission number, then its run name (for people reading the folder)
JOB_ID = re.compile(r"^(\d{6})-[A-Za-z0-9_-]{0,64}$")
#: a submitted job file larger than this is refused (a job file is a few kilobytes)
MAX_JOB_BYTES = 1 << 20
#: a problem line of a config error: "  <key>: <message>"
PROBLEM_LINE = re.compile(r"^\s{2}(\S[^:]*?): (.*)$")


@dataclass
class Job:
    id: str
    name: str
    state: str
    submitted_at: float
    #: the folder the job's relative paths are read from (the dashboard's working folder when it was submitted)
    cwd: str
    #: <training_folder>/<name>, resolved
    run_folder: str
    #: the job file as submitted, in the queue folder
    file: str = ""
    #: the run's name in the dashboard (its folder under the training folder), when it is inside it
    run: str | None = None
    pid: int | None = None
    #: when the job's process started, in the process table's clock ticks (`process_start_ticks`): a later process
    #: that gets its pid has another value; None where it could not be read (or the job was started before this was
    #: recorded: then the process's command line must name the job file)
    process_start: int | None = None
    gpus: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    returncode: int | None = None
    #: why a queued job waits, or how a finished one ended, in words
    note: str = ""

    @classmethod
    def read(cls, path: Path) -> Job | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        except (OSError, ValueError, TypeError):
            return None


def problems_of(error: UserError, shown_path: Path, given_name: str) -> list[dict[str, str]]:
    """A config error as {key, message} items (one per problem line), with the temporary file's path replaced by
    the name the job was given."""
    text = str(error).replace(str(shown_path), given_name)
    found = [{"key": m.group(1), "message": m.group(2)} for line in text.splitlines()
             if (m := PROBLEM_LINE.match(line))]
    return found or [{"key": "", "message": text}]


class JobQueue:
    """Submitting, listing and running the jobs of one training folder."""

    def __init__(self, root: Path, registry, config_root: Path, launcher: list[str], *, cwd: Path | None = None,
                 allow_outside: bool = False, gpu_sets: list[str | None] | None = None):
        self.root = root.resolve()
        self.folder = self.root / QUEUE_DIR
        self.registry = registry
        self.config_root = config_root
        self.launcher = launcher
        self.cwd = (cwd or Path.cwd()).resolve()
        self.allow_outside = allow_outside
        self.gpu_sets: list[str | None] = gpu_sets or [None]
        self.children: dict[str, subprocess.Popen] = {}
        self.lock = threading.RLock()

    # ---- submitting ------------------------------------------------------------------------------------

    def validate(self, text: str, given_name: str = "job.yaml"):
        """(config, problems): the job read by the same loader and checks as `run.py` (schema, then paths), and
        where it would write checked against the training folder. Nothing is started."""
        if len(text.encode("utf-8")) > MAX_JOB_BYTES:
            return None, [{"key": "", "message": f"{given_name}: larger than {MAX_JOB_BYTES} bytes"}]
        refused = alias_problems(text, given_name)
        if refused:
            return None, refused
        suffix = ".json" if given_name.lower().endswith(".json") else ".yaml"
        self.folder.mkdir(parents=True, exist_ok=True)
        probe = self.folder / f".incoming-{os.getpid()}-{threading.get_ident()}{suffix}"
        write_text_atomic(probe, text)
        try:
            refused = environment_problems(read_raw(probe), given_name)  # in the parsed strings: escapes undone
            if refused:
                return None, refused
            config, _ = load_config(str(probe), self.registry, config_root=self.config_root)
            check_paths(config, probe)
        except (ConfigError, UserError) as err:
            return None, problems_of(err, probe, given_name)
        finally:
            probe.unlink(missing_ok=True)
        return config, self.queue_problems(config)

    def queue_problems(self, config) -> list[dict[str, str]]:
        """What the queue adds to run.py's checks: one process per job, and (unless `allow_outside`) nothing
        written outside the training folder."""
        problems = []
        if len(config.config.process) > 1:
            problems.append({"key": "config.process", "message": "the dashboard's queue runs jobs of one process "
                             "(it follows one run folder); run this job with run.py, or split it"})
        if self.allow_outside:
            return problems
        for index, process in enumerate(config.config.process):
            for key, folder in written_folders(process):
                where = (self.cwd / folder).resolve()
                if not where.is_relative_to(self.root):
                    problems.append({"key": f"config.process[{index}].{key}",
                                     "message": f"writes to {where}, outside the dashboard's training folder "
                                                f"{self.root} (start the dashboard with --allow-outside to allow it)"})
        return problems

    def submit(self, text: str, given_name: str = "job.yaml") -> tuple[Job | None, list[dict[str, str]]]:
        """Validate and queue a job file: (the queued job, []) or (None, every problem by key)."""
        config, problems = self.validate(text, given_name)
        if problems:
            return None, problems
        name = config.config.name
        process = config.config.process[0]
        run_folder = (self.cwd / getattr(process, "training_folder", "output") / name).resolve()
        run = run_folder.relative_to(self.root).as_posix() if run_folder.is_relative_to(self.root) else None
        with self.lock:
            job_id, path = self.claim_id(name, ".job.json" if given_name.lower().endswith(".json") else ".job.yaml")
            path.write_text(text, encoding="utf-8")
            job = Job(id=job_id, name=name, state="queued", submitted_at=time.time(), cwd=str(self.cwd),
                      run_folder=str(run_folder), file=path.name, run=run)
            self.save(job)
        return job, []

    def claim_id(self, name: str, suffix: str) -> tuple[str, Path]:
        """The next submission number, claimed by creating its job file while holding the queue's submit lock (two
        dashboards on one folder never give out the same number)."""
        import fcntl

        slug = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64]
        with (self.folder / "submit.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            number = max((int(p.name[:6]) for p in self.folder.iterdir() if re.match(r"^\d{6}-", p.name)),
                         default=0) + 1
            job_id = f"{number:06d}-{slug}"
            path = self.folder / f"{job_id}{suffix}"
            path.touch(exist_ok=False)
            return job_id, path

    # ---- reading ---------------------------------------------------------------------------------------

    def jobs(self) -> list[Job]:
        """Every job, in queue order."""
        if not self.folder.is_dir():
            return []
        found = [Job.read(p) for p in sorted(self.folder.glob("*.json")) if JOB_ID.match(p.stem)]
        return [job for job in found if job is not None]

    def job(self, job_id: str) -> Job | None:
        if not JOB_ID.match(job_id):
            return None
        return Job.read(self.folder / f"{job_id}.json")

    def job_file(self, job: Job) -> Path:
        return self.folder / job.file

    def log_tail(self, job: Job, limit: int = 64 * 1024) -> str:
        path = self.folder / f"{job.id}.log"
        try:
            with path.open("rb") as handle:
                handle.seek(max(path.stat().st_size - limit, 0))
                return handle.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def save(self, job: Job) -> None:
        write_json_atomic(self.folder / f"{job.id}.json", asdict(job), sort_keys=False)

    def cancel(self, job_id: str) -> Job:
        """A queued job leaves the queue (its files stay, as `cancelled`); a running one is stopped through its
        run's control channel, not here."""
        with self.lock:
            job = self.job(job_id)
            if job is None:
                raise KeyError(job_id)
            if job.state != "queued":
                raise ValueError(f"job {job_id} is {job.state}; only a queued job can be cancelled (stop a running "
                                 "one from its run page)")
            job.state, job.ended_at, job.note = "cancelled", time.time(), "cancelled before it started"
            self.save(job)
            return job

    # ---- running ---------------------------------------------------------------------------------------

    def tick(self) -> None:
        """One pass: note the jobs that ended, then start queued ones, in order, while a GPU set is free. A job
        whose run folder is in use (by a job of this queue, or a run started elsewhere) waits, and nothing overtakes
        it."""
        with self.lock:
            jobs = self.jobs()
            for job in jobs:
                if job.state == "starting":
                    self.check_starting(job)
                if job.state == "running":
                    self.check_running(job)
            running = [job for job in jobs if job.state == "running"]
            busy = {job.gpus for job in running}
            free = [gpus for gpus in self.gpu_sets if gpus not in busy]
            folders = {job.run_folder: job.id for job in running}
            for job in (j for j in jobs if j.state == "queued"):
                if not free:
                    break
                in_use = run_state(Path(job.run_folder))
                if job.run_folder in folders:
                    self.wait(job, f"waiting: job {folders[job.run_folder]} trains in its run folder")
                    break
                if in_use.state == "running":  # started outside the queue (another terminal)
                    self.wait(job, f"waiting: its run folder is in use by process {in_use.status.pid}")
                    break
                if self.start(job, free[0]):
                    folders[job.run_folder] = job.id
                    free.pop(0)

    def wait(self, job: Job, note: str) -> None:
        if job.note != note:
            job.note = note
            self.save(job)

    def command(self, job: Job, gpus: str | None) -> tuple[list[str], dict[str, str]]:
        """The command line and environment of a job on GPU set `gpus` (None: the devices this dashboard sees): one
        `run.py` process, or `accelerate launch` with one process per device of a set of several."""
        env = dict(os.environ)
        command = [*self.launcher, "--quiet", str(self.job_file(job))]
        devices = [d for d in (gpus or "").split(",") if d.strip()]
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        if len(devices) > 1:
            command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                       str(len(devices)), *self.launcher[1:], "--quiet", str(self.job_file(job))]
        return command, env

    def start(self, job: Job, gpus: str | None) -> bool:
        """Start the job's process. Its state says `starting` before the process exists and `running` with its pid
        after: a dashboard that ends in between leaves `starting`, which the next one resolves by looking for the
        process (`check_starting`), never by starting it again. A job whose process cannot be started fails."""
        command, env = self.command(job, gpus)
        job.state, job.gpus, job.started_at, job.note = "starting", gpus, time.time(), ""
        self.save(job)
        try:
            with (self.folder / f"{job.id}.log").open("ab") as log_file:
                child = subprocess.Popen(command, cwd=job.cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as err:
            job.state, job.ended_at, job.note = "failed", time.time(), f"could not start: {err}"
            self.save(job)
            log.error("job %s could not start: %s", job.id, err)
            return False
        self.children[job.id] = child
        job.state, job.pid, job.process_start = "running", child.pid, process_start_ticks(child.pid)
        self.save(job)
        log.info("job %s started (pid %d%s)", job.id, child.pid, f", CUDA_VISIBLE_DEVICES={gpus}" if gpus else "")
        return True

    def check_starting(self, job: Job) -> None:
        """A job left `starting` by a dashboard that ended while starting it: its process, if it began, is watched
        by its pid; otherwise the job failed (it is not started again: it may have begun and ended meanwhile)."""
        found = processes_running(self.job_file(job))
        if found:
            job.state, job.pid, job.process_start = "running", found[0], process_start_ticks(found[0])
            self.save(job)
        else:  # it never began, or began and ended since: its run folder says which
            self.ended(job, None, never_began="the dashboard ended while starting it; queue it again to run it")

    def check_running(self, job: Job) -> None:
        """A running job whose process is gone ends with its run's state (finished, stopped, failed, crashed)."""
        child = self.children.get(job.id)
        if child is not None:
            returncode = child.poll()
            if returncode is None:
                return
            del self.children[job.id]
        else:  # started by an earlier dashboard: watched by its pid
            if job.pid is not None and self.still_runs(job):
                return
            returncode = None
        self.ended(job, returncode)

    def still_runs(self, job: Job) -> bool:
        """Whether the job's process, watched by its pid, still runs: alive (not a zombie) and the same process, by
        its start time where the job recorded it (`same_process`), else by its command line naming the job file. A
        killed process exits for a moment (longer on a busy machine) with its command line read empty and its run's
        status naming it alive: by its start time the job ends once the process is gone, `crashed`, not before."""
        if job.process_start is not None:
            return same_process(job.pid, job.process_start)
        return process_alive(job.pid) and runs_job(job.pid, self.job_file(job))

    def ended(self, job: Job, returncode: int | None, never_began: str = "") -> None:
        """A job whose process is gone: its run's state (finished, stopped, failed, crashed) when its run began,
        else failed; an error exit code fails a run that said it ended well."""
        found = run_state(Path(job.run_folder))
        started = found.status is not None and found.status.started_at >= (job.started_at or 0) - 1
        if started and found.state in ("finished", "stopped", "failed", "crashed"):
            job.state = found.state
        else:  # it ended before its run began (an error in the job file, a path gone since it was queued)
            job.state, job.note = "failed", never_began
        if returncode and job.state in ("finished", "stopped"):  # the run ended well, its process did not
            job.state, job.note = "failed", f"its process exited with code {returncode}"
        job.returncode, job.ended_at = returncode, time.time()
        if job.state == "failed" and not job.note:
            if found.status is not None and started and found.status.last_error:
                job.note = found.status.last_error
            else:
                job.note = last_error_line(self.log_tail(job, 8192))
        self.save(job)
        log.info("job %s %s", job.id, job.state)


def runs_job(pid: int, job_file: Path) -> bool:
    """Whether process `pid` is one running `job_file` (not a later process that got its pid); where the process
    table cannot be read, a live pid is taken for it."""
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    return os.fsencode(str(job_file)) in arguments


def processes_running(job_file: Path) -> list[int]:
    """The processes whose command line names `job_file` (the launcher first: the lowest pid)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if process_alive(pid) and runs_job(pid, job_file):
            found.append(pid)
    return sorted(found)


def alias_problems(text: str, given_name: str) -> list[dict[str, str]]:
    """YAML aliases are refused in the queue (a small file can expand to an enormous one), before anything builds
    the data."""
    try:
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
            return [{"key": "", "message": f"{given_name}: YAML aliases (*name) are not accepted in the dashboard; "
                     "write the repeated part out"}]
    except yaml.YAMLError:
        pass  # the loader says what is wrong with it
    return []


def environment_problems(data, given_name: str) -> list[dict[str, str]]:
    """`${VARIABLES}` in any string of the parsed job are refused in the queue: the job would read the dashboard's
    environment, secrets included, into its outputs. (Read after parsing, so an escaped `$\\x7B` is caught too.)"""
    names: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, str):
            names.update(m.group(1) for m in ENV_PATTERN.finditer(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(data)
    if not names:
        return []
    return [{"key": "", "message": f"{given_name}: ${{{sorted(names)[0]}}}: a job queued in the dashboard cannot read "
             "the dashboard's environment variables; write the values themselves"}]


def last_error_line(log_text: str) -> str:
    lines = [line for line in log_text.splitlines() if line.strip()]
    errors = [line for line in lines if " ERROR " in line or "Error" in line]
    return (errors or lines or [""])[-1][-500:]


class QueueRunner:
    """Runs a queue: a thread that ticks every `interval` seconds while this dashboard holds the queue's lock. A
    dashboard that finds the lock held shows the queue and tries again now and then: when the other one ends, it
    takes the queue over (a job it then finds running is watched by its pid)."""

    #: how often (in ticks) a dashboard without the lock tries to take it
    RETRY_TICKS = 5

    def __init__(self, queue: JobQueue, interval: float = 1.0):
        self.queue = queue
        self.interval = interval
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.lock_file = None

    @property
    def holding(self) -> bool:
        """Whether this dashboard runs the queue now."""
        return self.lock_file is not None

    def acquire(self) -> bool:
        import fcntl

        self.queue.folder.mkdir(parents=True, exist_ok=True)
        handle = (self.queue.folder / "runner.lock").open("a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return False
        self.lock_file = handle
        return True

    def start(self) -> bool:
        """Start the queue's thread; True when this dashboard runs the queue from now (else it waits for the lock)."""
        if not self.acquire():
            log.warning("another dashboard runs the job queue in %s: this one shows it, starts nothing, and takes "
                        "over when that one ends", self.queue.folder)
        self.thread = threading.Thread(target=self.loop, name="difftune-queue", daemon=True)
        self.thread.start()
        return self.holding

    def loop(self) -> None:
        waited = 0
        while not self.stopping.is_set():
            if not self.holding:
                waited += 1
                if waited % self.RETRY_TICKS == 0 and self.acquire():
                    log.info("this dashboard now runs the job queue in %s", self.queue.folder)
            if self.holding:
                try:
                    self.queue.tick()
                except Exception:  # a failure to start one job must not end the queue
                    log.exception("job queue")
            self.stopping.wait(self.interval)

    def stop(self) -> None:
        """Stop scheduling (running jobs go on: they are processes of their own). A tick in progress finishes first,
        so the lock is never handed on in the middle of starting a job."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()
        if self.lock_file is not None:
            self.lock_file.close()
            self.lock_file = None
