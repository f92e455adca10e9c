"""metrics.jsonl: one JSON object per logged update."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from toolkit.files import write_atomic, write_text_atomic
from toolkit.run.background import BackgroundWriter

log = logging.getLogger("difftune")

#: lines are written at most this long after the loop hands them over, together: waking the writer thread for every
#: line cost the loop 0.04 ms per update at `log_every: 1` on the 2-core benchmark (docs/performance.md)
HAND_OVER_S = 0.5


def progress_bars_wanted() -> bool:
    """False under `run.py --quiet`, which sets tqdm's own TQDM_DISABLE (so library bars go quiet too)."""
    return os.environ.get("TQDM_DISABLE", "").lower() not in ("1", "true", "yes")


class MetricsWriter:
    """Appends one line per logged update and flushes it. The lines are encoded and written by a thread of their own,
    in order (`BackgroundWriter`): the training loop adds a record to the waiting lines and goes on; a line that finds
    none waiting has the thread write them all once `HAND_OVER_S` has passed since the last were written (at once if
    it has), whatever the loop does meanwhile. A crash loses at most the lines of its last half second (a resume
    writes every line after its checkpoint again anyway); `drain` writes every line written so far to the file at
    once and waits for it, before this process reads it (the report), and so does `close`."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = path
        self.enabled = enabled
        self._file = None
        self.writer = BackgroundWriter("metrics.jsonl writer")
        self.lock = threading.Lock()  # the waiting lines are taken by the writer thread
        self.waiting: list[dict] = []
        self.written_at = -math.inf  # time.monotonic() when the thread last took the waiting lines
        self.hurry = threading.Event()  # set by a drain: a write that waits for its time goes now
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        with self.lock:
            self.waiting.append(dict(record))
            first = len(self.waiting) == 1
        if first:  # the others wait with it, for the write already on its way
            self.writer.submit(partial(self._write_waiting, self.written_at + HAND_OVER_S))

    def _write_waiting(self, due: float) -> None:
        """(writer thread) At `due` (or once hurried), every waiting line into the file."""
        self.hurry.wait(max(0.0, due - time.monotonic()))
        with self.lock:
            records, self.waiting = self.waiting, []
            self.written_at = time.monotonic()
        for record in records:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
            self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def drain(self) -> None:
        """Every line written so far in the file; then a write that failed is raised (after waiting for the rest)."""
        if self._file is None:
            return
        self.hurry.set()
        try:
            self.writer.put(partial(self._write_waiting, -math.inf))
            self.writer.drain()
        finally:
            self.hurry.clear()

    def close(self) -> None:
        """Every line written, then the file closed. A failed write is logged here, not raised: close runs while a
        failed run's own error is on its way out too."""
        if self._file is None:
            return
        try:
            self.drain()
        except OSError as error:
            log.warning("could not write %s: %s", self.path, error)
        finally:
            self._file.close()
            self._file = None


def read_metrics(path: Path) -> list[dict]:
    """The lines of metrics.jsonl; a last line cut short (a write the disk refused, or a kill mid-write) is left
    out: a resumed run writes it again."""
    with path.open(encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    records = []
    for number, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines) - 1 or line.endswith("\n"):
                raise
            log.warning("%s: its last line is cut short (%d characters); left out", path, len(line))
    return records


def truncate_after(path: Path, step: int) -> None:
    """Keep only the lines of updates up to `step` (atomically); no file, nothing to do."""
    if not path.is_file():
        return
    kept = [record for record in read_metrics(path) if record.get("step", 0) <= step]
    write_text_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))


def truncate_event_files_after(folder: Path, step: int) -> int:
    """TensorBoard's event files under `folder` cut back like metrics.jsonl: every event of an update after `step`
    dropped (each file rewritten atomically), so a resumed run logs those updates once. Returns the events dropped;
    no folder (or no tensorboard installed), nothing to do."""
    if not folder.is_dir():
        return 0
    try:
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:
        return 0
    dropped = 0
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        records = list(RawEventFileLoader(str(path)).Load())
        kept = [r for r in records if not _scalar_after(event_pb2.Event.FromString(r), step)]
        if len(kept) == len(records):
            continue
        dropped += len(records) - len(kept)

        def write(tmp: Path, kept=kept) -> None:
            with tmp.open("wb") as handle:
                writer = RecordWriter(handle)
                for record in kept:
                    writer.write(record)
                writer.flush()

        write_atomic(path, write)
    return dropped


def _scalar_after(event, step: int) -> bool:
    """An event an update after `step` logged (file headers and other step-0 events stay)."""
    return event.HasField("summary") and event.step > step


class Throughput:
    """Seconds per update and samples per second over the updates since the last reading.

    Read when the logged values have just come to the host (which waits for the device), so the figure covers
    the device's work too without timing each update by itself; time spent saving or sampling is left out
    (`restart` after it)."""

    def __init__(self, processes: int = 1) -> None:
        self.processes = processes
        self.restart()

    def restart(self) -> None:
        self.started, self.updates, self.samples = time.perf_counter(), 0, 0

    def count(self, samples: int, completed: bool = True) -> None:
        """One update's `samples` on this process; `completed` is false for a step the optimizer skipped
        (fp16 overflow): its samples and time count, but not as an update."""
        self.updates += int(completed)
        self.samples += samples

    @contextmanager
    def paused(self):
        """Time inside the block (a validation pass) is not training time."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - began

    def read(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {"time": elapsed / max(self.updates, 1), "samples_per_s": self.samples * self.processes / elapsed}


class TimestepStats:
    """Sampled u values and their per-sample losses since the last metrics line, as a 10-bin histogram
    and the mean loss per bin (`logging.debug_timesteps`)."""

    BINS = 10

    def __init__(self) -> None:
        self.u: list = []
        self.losses: list = []

    def add(self, u, losses) -> None:
        # kept where they are until the flush (a logged update): reading them now would wait for the device
        self.u.append(u.detach())
        self.losses.append(losses.detach())

    def flush(self) -> dict:
        import torch

        if not self.u:
            return {}
        u = torch.cat([x.float().cpu() for x in self.u])
        losses = torch.cat([x.float().cpu() for x in self.losses])
        self.u, self.losses = [], []
        bins = (u * self.BINS).long().clamp(0, self.BINS - 1)
        counts = torch.bincount(bins, minlength=self.BINS)
        sums = torch.bincount(bins, weights=losses, minlength=self.BINS)
        means = [round(float(s / c), 6) if c else None for s, c in zip(sums, counts)]
        return {"timestep_hist": counts.tolist(), "timestep_bin_loss": means}
