"""Steering a run from outside, and saying how it is: `RUN_FOLDER/control/` requests and `status.json`.

`python run.py --control RUN_FOLDER stop|save|sample` leaves one small file per request; the trainer's main
process reads them at every update, all processes act on the broadcast decision, and the files are removed
once acted on. `status.json` says whether the run is running, stopped, finished or failed, and which
process runs it, so `python run.py --status RUN_FOLDER` can tell a crashed run from a running one.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from toolkit.files import write_json_atomic
from toolkit.run.background import BackgroundWriter
from toolkit.run.checkpoint_folders import scan_checkpoints

log = logging.getLogger("difftune")

CONTROL_DIR = "control"
STATUS_FILE = "status.json"
ACTIONS = ("stop", "save", "sample")
STATES = ("running", "stopped", "finished", "failed")
#: a run on another machine that has not rewritten its status.json for this long is no longer taken as running
STALE_S = 600.0
#: control/ unchanged since a reading that found it empty is read again after this long all the same (a clock or a
#: network file system that stamps a new request with the folder's old time delays it by this much at most)
RELIST_S = 1.0
#: a folder changed this recently may change again within the same tick of the file system's clock
SETTLED_S = 1.0
#: control/ is looked at (one `stat`) at most this often: a request waits this long at most, plus the update in
#: progress; a stat per update cost 0.05 ms of a 20 ms update on the 2-core benchmark (docs/performance.md)
POLL_S = 0.25


def request(run_dir: Path, action: str) -> Path:
    """Leave a request for the trainer of `run_dir`; returns the request file."""
    if action not in ACTIONS:
        raise ValueError(f"unknown control action '{action}' (one of: {', '.join(ACTIONS)})")
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run folder {run_dir}")
    state, line = describe_status(run_dir)
    if state != "running":
        raise ValueError(f"no trainer is running there to {action}: {line}")
    path = run_dir / CONTROL_DIR / f"{time.time_ns()}-{os.getpid()}-{action}.json"
    write_json_atomic(path, {"action": action, "requested_at": time.time()})
    return path


def pending(run_dir: Path) -> dict[str, list[Path]]:
    """The request files waiting, by action, oldest first (files that are not requests are left alone). The
    trainer asks at every update: one directory read, and Paths made only for the requests found."""
    folder = run_dir / CONTROL_DIR
    found: dict[str, list[Path]] = {action: [] for action in ACTIONS}
    try:
        with os.scandir(folder) as entries:
            names = sorted(entry.name for entry in entries if entry.name.endswith(".json"))
    except (FileNotFoundError, NotADirectoryError):
        return found
    for name in names:
        action = name[: -len(".json")].rsplit("-", 1)[-1]
        if action in found:
            found[action].append(folder / name)
    return found


def done(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


@dataclass
class Status:
    """What `status.json` holds."""

    state: str
    pid: int = field(default_factory=os.getpid)
    step: int = 0
    total: int = 0
    updated_at: float = field(default_factory=time.time)
    started_at: float = field(default_factory=time.time)
    last_error: str | None = None
    #: the machine the run's process runs on: its pid means nothing elsewhere (a run folder on shared storage)
    host: str = field(default_factory=socket.gethostname)
    #: when the process started, in the process table's own clock ticks: a later process that gets the same pid
    #: has another value (compared exactly: no wall clock involved)
    process_start: int | None = field(default_factory=lambda: process_start_ticks(os.getpid()))

    def write(self, run_dir: Path) -> None:
        write_json_atomic(run_dir / STATUS_FILE, self.stamped())

    def stamped(self) -> dict:
        """The fields to write, `updated_at` now."""
        self.updated_at = time.time()
        return asdict(self)


def read_status(run_dir: Path) -> Status | None:
    """The folder's status, or None where there is none or it is not one (a hand-edited or foreign file is
    replaced by the next run rather than stopping it)."""
    path = run_dir / STATUS_FILE
    if not path.is_file():
        return None
    try:
        status = Status(**json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError):
        return None
    numbers = (status.pid, status.step, status.total, status.updated_at, status.started_at)
    if not isinstance(status.state, str) or not all(isinstance(n, (int, float)) for n in numbers):
        return None
    return status


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat), where there is one."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs; one that has exited but was not yet reaped by its parent (a zombie) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:  # Linux: the state letter follows the command name in parentheses
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:][:1] != "Z"


@dataclass(frozen=True)
class RunState:
    """How a run folder's run stands, as `--status` and the dashboard tell it."""

    state: str  # running / stopped / finished / failed / crashed / unknown
    status: Status | None
    #: the newest complete checkpoint (what running the same command again continues from), if any
    checkpoint: Path | None
    #: why the state is not the file's own (a silent run on another machine)
    why: str = ""

    @property
    def note(self) -> str:
        """What the state means for the user: for a crashed run, whether a rerun resumes or starts over."""
        if self.state != "crashed":
            return self.why
        if self.checkpoint is None:
            return "nothing saved yet: its process is gone before its first checkpoint; the same command starts over"
        return f"its process is gone without saying why; the same command resumes from {self.checkpoint.name}"


def same_process(pid: int, start: int | None) -> bool:
    """Whether process `pid` is alive and is the one that started at `start` (`process_start_ticks`: a later process
    that got the pid has another value; None: judged by the pid alone). The start time holds while a killed process
    exits, when its command line already reads empty."""
    if not process_alive(pid):
        return False
    if start is None:
        return True
    ticks = process_start_ticks(pid)
    return ticks is None or ticks == start


def runs_here(status: Status) -> bool:
    """Whether the process status.json names is alive and is the run's (a file without its start time, written by an
    older difftune, is judged by the pid alone)."""
    return same_process(status.pid, status.process_start)


def run_state(run_dir: Path) -> RunState:
    """The folder's state from its files alone: a `running` run whose process is gone is `crashed` (a run on
    another machine, which this one cannot see, stays `running`)."""
    status = read_status(run_dir)
    if status is None:
        return RunState("unknown", None, None)
    state, why = status.state, ""
    if state == "running" and status.host == socket.gethostname() and not runs_here(status):
        state = "crashed"
    elif state == "running" and status.host != socket.gethostname() and time.time() - status.updated_at > STALE_S:
        # a run on another machine (or a container since replaced) that has said nothing for long: not known to run
        state = "unknown"
        why = f"said it runs on {status.host}, which has not updated it for {(time.time() - status.updated_at) / 60:.0f} min"
    complete, _ = scan_checkpoints(run_dir / "checkpoints")
    return RunState(state, status, complete[-1] if complete else None, why)


def describe_status(run_dir: Path) -> tuple[str, str]:
    """(state, one-line description)."""
    found = run_state(run_dir)
    status = found.status
    if status is None:
        return "unknown", f"{run_dir}: no {STATUS_FILE} (not a run folder, or the run never started)"
    age = time.time() - status.updated_at
    state = "crashed, nothing saved yet" if found.state == "crashed" and found.checkpoint is None else found.state
    line = f"{run_dir}: {state}, step {status.step}/{status.total}, pid {status.pid}, updated {age:.0f} s ago"
    if found.note:
        line += f" ({found.note})"
    if status.last_error:
        line += f"\n  last error: {status.last_error}"
    return found.state, line


class RunMonitor:
    """The main process's side of steering and status for one run: reads requests, keeps status.json at the real
    step (rewritten at an update once `heartbeat_s` has passed since the last write: at most that far behind, and
    not a file write per update) and records how the run ended. Other processes get a
    disabled monitor and learn decisions from the trainer's broadcast."""

    def __init__(self, run_dir: Path, enabled: bool, total: int, heartbeat_s: float = 1.0):
        self.run_dir = run_dir
        self.enabled = enabled
        previous = read_status(run_dir) if enabled else None
        # until this run knows better (a resume, a plan), the folder's last known step and total stand
        self.status = Status(state="running", step=previous.step if previous else 0,
                             total=previous.total if previous and not total else total)
        self.heartbeat_s = heartbeat_s
        self.writer = BackgroundWriter("status.json writer")
        #: status.json's writes in the order they were made: a heartbeat still on its way when a later state was
        #: written is dropped, not written over it (`_write_in_order`)
        self.write_lock = threading.Lock()
        self.writes_made = 0
        self.writes_done = 0
        self.taken: list[Path] = []
        #: control/'s (inode, modification time) when last read empty, and when that was (`may_hold_requests`)
        self.quiet: tuple[tuple[int, int], float] | None = None
        self.control_dir = str(run_dir / CONTROL_DIR)  # stat'ed at every update: no Path made each time
        #: whether this run's plan (and resumed step) is known: until then its step is the folder's last known
        self.planned = False
        #: when control/ was last looked at (time.monotonic), for `POLL_S`
        self.looked_at: float | None = None

    def started(self, step: int | None = None) -> None:
        self._write("running", self.status.step if step is None else step)

    def heartbeat(self, step: int) -> None:
        """status.json at this step, once `heartbeat_s` has passed since the last write: written by a thread of its
        own (the fields as they are now), so the loop does not wait for the file system."""
        if self.enabled and time.time() - self.status.updated_at >= self.heartbeat_s:
            self.status.state, self.status.step = "running", step
            self.writes_made += 1
            self.writer.submit(partial(self._write_in_order, self.writes_made, self.status.stamped()))

    def _write_in_order(self, number: int, fields: dict) -> None:
        """status.json as the `number`th write made it, unless a later one is written already."""
        with self.write_lock:
            if number > self.writes_done:
                write_json_atomic(self.run_dir / STATUS_FILE, fields)
                self.writes_done = number

    def take_requests(self) -> dict[str, bool]:
        """Which actions are requested now; the files are removed by `acknowledge` once acted on. Asked at every
        update: control/ is looked at once `POLL_S` has passed since the last look, and read only where it may have
        changed since it was last found empty (`may_hold_requests`)."""
        if not self.enabled or not self.look_due() or not self.may_hold_requests():
            return {action: False for action in ACTIONS}
        found = pending(self.run_dir)
        self.taken = [path for paths in found.values() for path in paths]
        if not self.taken:
            self.remember_empty()
        return {action: bool(paths) for action, paths in found.items()}

    def look_due(self) -> bool:
        """Whether `POLL_S` has passed since control/ was last looked at (then this is the look)."""
        now = time.monotonic()
        if self.looked_at is not None and now - self.looked_at < POLL_S:
            return False
        self.looked_at = now
        return True

    def may_hold_requests(self) -> bool:
        """False where control/ is missing, or is as it was (inode and modification time) when it was last read and
        found empty, that reading was settled (`remember_empty`) and less than `RELIST_S` ago: one stat instead of a
        directory read per update. A request file created since would have changed the folder's time."""
        try:
            folder = os.stat(self.control_dir)
        except (FileNotFoundError, NotADirectoryError):
            return False
        quiet = self.quiet
        return (quiet is None or quiet[0] != (folder.st_ino, folder.st_mtime_ns)
                or time.monotonic() - quiet[1] >= RELIST_S)

    def remember_empty(self) -> None:
        """control/ was just read and held no request: remember its inode and time, where they can be trusted to
        change with the next request. A file system stamps times with a coarse clock (a tick of milliseconds), so a
        file created in the same tick as the folder's last change would leave its time as it was: a folder changed
        less than `SETTLED_S` ago is read again at the next update."""
        try:
            folder = os.stat(self.control_dir)
        except (FileNotFoundError, NotADirectoryError):
            self.quiet = None
            return
        settled = time.time_ns() - folder.st_mtime_ns >= SETTLED_S * 1e9
        self.quiet = ((folder.st_ino, folder.st_mtime_ns), time.monotonic()) if settled else None

    def drop_stale_requests(self) -> int:
        """Remove requests made before this run started (e.g. sent to a run that had already finished)."""
        if not self.enabled:
            return 0
        started_ns = self.status.started_at * 1e9
        stale = [path for paths in pending(self.run_dir).values() for path in paths
                 if int(path.name.split("-", 1)[0]) < started_ns]
        done(stale)
        return len(stale)

    def acknowledge(self) -> None:
        done(self.taken)
        self.taken = []

    def ended(self, state: str, step: int | None, error: str | None = None) -> None:
        self.status.last_error = error
        self._write(state, self.status.step if step is None else step)

    def _write(self, state: str, step: int) -> None:
        """status.json now, without waiting for a heartbeat still on its way (it is dropped if it comes later): a run
        that fails is often ended by its launcher moments later, and its state must be written first."""
        if not self.enabled:
            return
        self.status.state, self.status.step = state, step
        self.writes_made += 1
        self._write_in_order(self.writes_made, self.status.stamped())
