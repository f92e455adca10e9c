"""metrics.jsonl: one JSON object per logged update."""

from __future__ import annotations

import json
import math
from pathlib import Path


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
