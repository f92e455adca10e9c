"""Ctrl-C and SIGTERM during training: finish the update, save, exit cleanly; a second Ctrl-C exits now."""

from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger("difftune")


class GracefulStop:
    """Context manager that turns the first SIGINT/SIGTERM into a stop request.

    A second SIGINT raises KeyboardInterrupt at once (saved checkpoints are complete folders, so an
    abandoned save leaves only a temporary folder that is never resumed from). Signals that only repeat
    the request do not count as that second Ctrl-C: SIGTERMs, and a SIGINT within `repeat_window`
    seconds of the first (under `accelerate launch` a terminal's Ctrl-C reaches each worker twice, from
    the terminal and forwarded by the launcher).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, repeat_window: float = 2.0) -> None:
        self.requested = False
        self.repeat_window = repeat_window
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.requested and signum == signal.SIGINT and now - self._first_at > self.repeat_window:
            log.warning("second Ctrl-C: exiting now; saved checkpoints are untouched")
            raise KeyboardInterrupt
        if not self.requested:
            log.warning("%s: finishing this update, then saving a checkpoint (Ctrl-C again to exit now)",
                        signal.Signals(signum).name)
            self.requested, self._first_at = True, now
