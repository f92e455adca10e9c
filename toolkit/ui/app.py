"""`python run.py --ui`: the dashboard and its job queue, until Ctrl-C (running jobs go on)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from toolkit.ui.jobs import JobQueue, QueueRunner
from toolkit.ui.server import Dashboard, is_loopback, new_token

log = logging.getLogger("difftune")


def build_dashboard(root: Path, registry, config_root: Path, run_py: Path, host: str = "127.0.0.1", port: int = 8675,
                    token: str | None = None, allow_outside: bool = False,
                    gpu_sets: list[str] | None = None) -> tuple[Dashboard, QueueRunner]:
    """The server and its queue runner (not started)."""
    root.mkdir(parents=True, exist_ok=True)
    queue = JobQueue(root, registry, config_root, [sys.executable, str(run_py)], allow_outside=allow_outside,
                     gpu_sets=list(gpu_sets) if gpu_sets else None)
    dashboard = Dashboard(root, queue, host, port, token)
    dashboard.runner = QueueRunner(queue)
    return dashboard, dashboard.runner


def gpu_set_problem(gpu_sets: list[str]) -> str | None:
    """Why `--gpus` sets cannot be used (empty, or sharing a device), or None."""
    seen: dict[str, str] = {}
    for gpus in gpu_sets:
        devices = [d.strip() for d in gpus.split(",")]
        if not all(devices):
            return f"--gpus {gpus!r}: give device ids separated by commas, e.g. 0,1"
        for device in devices:
            if device in seen:
                return f"--gpus {seen[device]!r} and {gpus!r} share device {device}: each set is a job's own"
            seen[device] = gpus
    return None


def serve(root: Path, registry, config_root: Path, run_py: Path, host: str, port: int, token: str | None,
          allow_outside: bool, gpu_sets: list[str] | None) -> int:
    if not is_loopback(host) and not token:
        token = new_token()
    problem = gpu_set_problem(gpu_sets or [])
    if problem:
        log.error("%s", problem)
        return 2
    try:
        dashboard, runner = build_dashboard(root, registry, config_root, run_py, host, port, token, allow_outside,
                                            gpu_sets)
    except (OSError, ValueError) as err:
        log.error("cannot serve the dashboard on %s:%d: %s", host, port, err)
        return 2
    runner.start()
    address = dashboard.url + (f"?token={token}" if token else "")
    log.info("dashboard for %s at %s (Ctrl-C ends the dashboard; running jobs go on)", root.resolve(), address)
    print(address, flush=True)
    try:
        dashboard.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        runner.stop()
        dashboard.server_close()
    return 0
