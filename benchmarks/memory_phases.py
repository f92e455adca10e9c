"""What the family device checks (benchmarks/gpu_check_*.py) share: the trainer's per-phase memory records
(`logging.debug_memory`), collected from the log and printed as a table, and a job file run through the real path."""

from __future__ import annotations

import logging
import time
from pathlib import Path

MIB = 2**20


class Collect(logging.Handler):
    """Keeps the memory record each `memory_debug` block logs (`record.memory`)."""

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "memory"):
            self.records.append(record.memory)


def collect_phases() -> Collect:
    """A handler on difftune's logger, at INFO, that keeps every phase's memory record."""
    collect = Collect()
    logger = logging.getLogger("difftune")
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    return collect


def phase_table(records: list[dict]) -> str:
    """One line per phase: seconds, accelerator memory allocated before and after, the peak so far, RSS after."""
    lines = [f"{'phase':38s} {'s':>7s} {'alloc before':>13s} {'alloc after':>12s} {'peak so far':>12s} "
             f"{'rss after':>10s}"]
    for r in records:
        lines.append(f"{r['label']:38s} {r['seconds']:7.2f} {r.get('allocated_before', 0) / MIB:10.0f} MiB"
                     f" {r.get('allocated_after', 0) / MIB:8.0f} MiB {r.get('peak_after', 0) / MIB:8.0f} MiB"
                     f" {r.get('rss_after', 0) / MIB:6.0f} MiB")
    return "\n".join(lines)


def cuda_missing(device: str) -> bool:
    """True (and said) when the check is asked for CUDA on a machine without it."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check needs one (--device cpu for a smoke run)")
        return True
    return False


def run_job_file(path: Path, repo: Path) -> float:
    """Run a job file as run.py does (the same loader, the same job); its wall seconds."""
    from jobs.job import get_job
    from jobs.registry import build_registry
    from toolkit.config.loader import load_config

    registry = build_registry(repo / "extensions")
    config, config_path = load_config(str(path), registry)
    started = time.perf_counter()
    get_job(config, config_path, registry).run()
    return time.perf_counter() - started
