"""metrics.jsonl: one JSON object per logged update."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def progress_bars_wanted() -> bool:
    """False under `run.py --quiet`, which sets tqdm's own TQDM_DISABLE (so library bars go quiet too)."""
    return os.environ.get("TQDM_DISABLE", "").lower() not in ("1", "true", "yes")


class MetricsWriter:
    """Appends one line per update and flushes it, so a crash loses at most the line being written."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = path
        self.enabled = enabled
        self._file = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def truncate_after(path: Path, step: int) -> None:
    """Keep only the lines of updates up to `step` (atomically); no file, nothing to do."""
    if not path.is_file():
        return
    kept = [record for record in read_metrics(path) if record.get("step", 0) <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")
    tmp.replace(path)


class TimestepStats:
    """Sampled u values and their per-sample losses since the last metrics line, as a 10-bin histogram
    and the mean loss per bin (`logging.debug_timesteps`)."""

    BINS = 10

    def __init__(self) -> None:
        self.u: list = []
        self.losses: list = []

    def add(self, u, losses) -> None:
        self.u.append(u.detach().float().cpu())
        self.losses.append(losses.detach().float().cpu())

    def flush(self) -> dict:
        import torch

        if not self.u:
            return {}
        u, losses = torch.cat(self.u), torch.cat(self.losses)
        self.u, self.losses = [], []
        bins = (u * self.BINS).long().clamp(0, self.BINS - 1)
        counts = torch.bincount(bins, minlength=self.BINS)
        sums = torch.bincount(bins, weights=losses, minlength=self.BINS)
        means = [round(float(s / c), 6) if c else None for s, c in zip(sums, counts)]
        return {"timestep_hist": counts.tolist(), "timestep_bin_loss": means}
