"""File writes of a running job done on a thread of their own, in order: metrics.jsonl lines and status.json
heartbeats. Encoding and writing them costs the training loop 0.1-0.3 ms per update otherwise (syscalls amid the
model's kernels run several times slower than alone; docs/performance.md), and nothing in the loop needs to wait
for them. Not in the standard library as such: `concurrent.futures` would keep a thread per executor alive for the
process's life and swallow errors into futures nobody reads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

#: seconds a writer thread waits for more work before it ends (the next write starts a new one). Longer than the
#: status heartbeat's second and the usual time between metrics lines, so a running job keeps its threads: starting
#: one amid the model's busy kernels costs milliseconds (the heartbeat's thread, started once a second, cost 0.04 ms
#: per update on the 2-core benchmark; docs/performance.md)
IDLE_S = 60.0


class BackgroundWriter:
    """Runs the writes it is handed one after another on one thread, started when there is work and ended after
    `IDLE_S` without any. A write that fails is raised in the caller's thread at the next `submit`, `drain` or
    `close` (the later writes still run: a full disk stops the run at its next line, as a direct write would)."""

    def __init__(self, name: str):
        self.name = name
        self.work: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, write: Callable[[], object]) -> None:
        self.raise_error()
        self.put(write)

    def put(self, write: Callable[[], object]) -> None:
        with self.lock:  # the thread ends only while holding it, having found no work: a write is never left behind
            self.work.put(write)
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)
                self.thread.start()

    def drain(self) -> None:
        """Wait until every write handed over so far is done (a failed one included); then raise the first that
        failed."""
        with self.lock:
            idle = self.thread is None  # no thread: nothing waits (it ends only with no work left)
        if not idle:
            done = threading.Event()
            self.put(done.set)
            done.wait()
        self.raise_error()

    def raise_error(self) -> None:
        with self.lock:
            error, self.error = self.error, None
        if error is not None:
            raise error

    def run(self) -> None:
        while True:
            try:
                write = self.work.get(timeout=IDLE_S)
            except queue.Empty:
                with self.lock:
                    if self.work.empty():
                        self.thread = None
                        return
                continue
            try:
                write()
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                with self.lock:
                    if self.error is None:
                        self.error = error
