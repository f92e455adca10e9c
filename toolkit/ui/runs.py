"""What the dashboard shows of the runs under a training folder, read from the run folders' own files only
(status.json, metrics.jsonl, plan.json, config.yaml, samples/): the files are the truth, so the page cannot
disagree with the runs. Nothing here writes to a run folder except control requests (`toolkit.run.control`)."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from toolkit.run.control import STATUS_FILE, run_state
from toolkit.run.report import PLAN_FILE, SAMPLE_NAME, sample_prompt, sample_references

#: run folders are found this deep under the training folder (a job's training_folder may be a subfolder of it)
MAX_DEPTH = 3
#: run names in URLs: the folder's path under the training folder, `/`-separated
RUN_NAME = re.compile(rf"^[^/\\\x00]+(/[^/\\\x00]+){{0,{MAX_DEPTH - 1}}}$")


class UnknownRun(LookupError):
    """A name that is not a run folder under the training folder (or points outside it)."""


def find_runs(root: Path) -> list[str]:
    """Every run folder under `root` (a folder with status.json or config.yaml and metrics.jsonl), by name;
    hidden folders (the job queue) and checkpoints are not searched."""
    found = []

    def walk(folder: Path, depth: int) -> None:
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
        except OSError:
            return
        for child in children:
            if (child / STATUS_FILE).is_file() or (child / "config.yaml").is_file():
                found.append(child.relative_to(root).as_posix())
            elif depth < MAX_DEPTH:
                walk(child, depth + 1)

    walk(root, 1)
    return found


def run_folder(root: Path, name: str) -> Path:
    """The folder of run `name`, refused when the name leaves `root` (`..`, absolute, a link out) or is no run."""
    if not RUN_NAME.match(name) or any(part in ("..", ".") for part in name.split("/")):
        raise UnknownRun(name)
    folder = (root / name).resolve()
    if not folder.is_relative_to(root.resolve()) or not folder.is_dir():
        raise UnknownRun(name)
    if not (folder / STATUS_FILE).is_file() and not (folder / "config.yaml").is_file():
        raise UnknownRun(name)
    return folder


def inside(folder: Path, relative: str) -> Path | None:
    """`folder/relative` when it is a file inside `folder` (links resolved), else None."""
    if "\x00" in relative:
        return None
    path = (folder / relative).resolve()
    return path if path.is_relative_to(folder.resolve()) and path.is_file() else None


@dataclass
class MetricsTail:
    """metrics.jsonl read incrementally: new lines are parsed once; a rewritten file (a resume cuts it back,
    atomically: another inode) or a shorter one is read again from its start."""

    records: list[dict] = field(default_factory=list)
    identity: tuple[int, int] | None = None
    offset: int = 0

    def read(self, path: Path) -> list[dict]:
        try:
            stat = path.stat()
        except OSError:
            self.records, self.identity, self.offset = [], None, 0
            return self.records
        if (stat.st_dev, stat.st_ino) != self.identity or stat.st_size < self.offset:
            self.records, self.identity, self.offset = [], (stat.st_dev, stat.st_ino), 0
        if stat.st_size > self.offset:
            with path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read(stat.st_size - self.offset)
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for its newline
            for line in complete.splitlines():
                try:
                    record = json.loads(line) if line.strip() else None
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):  # a metrics line, not a stray one
                    self.records.append(record)
            self.offset += len(complete)
        return self.records


class RunReader:
    """Reads run folders for the dashboard; remembers what it parsed (metrics lines, sample prompts), so a poll
    costs the new lines only. Safe to share between the server's threads."""

    def __init__(self, root: Path):
        self.root = root
        self._lock = threading.Lock()
        self._tails: dict[Path, MetricsTail] = {}
        self._prompts: dict[tuple[Path, int], str] = {}

    def names(self) -> list[str]:
        return find_runs(self.root)

    def metrics(self, folder: Path) -> tuple[list[dict], str]:
        """The run's metrics lines (the reader's own list: read it, do not change it), and the identity of the file
        they came from (it changes when a resume rewrites the file: a page that follows the run starts its curves
        again)."""
        with self._lock:
            tail = self._tails.setdefault(folder, MetricsTail())
            records = tail.read(folder / "metrics.jsonl")
            return records, "" if tail.identity is None else f"{tail.identity[0]}:{tail.identity[1]}"

    def summary(self, name: str) -> dict:
        """One row of the runs page: state, step of total, last loss, speed, ETA, last sample."""
        folder = run_folder(self.root, name)
        records, _ = self.metrics(folder)
        return self.summarize(name, folder, records, last_sample_url(folder, name))

    def summarize(self, name: str, folder: Path, records: list[dict], thumbnail: str | None) -> dict:
        found = run_state(folder)
        status = found.status
        last = records[-1] if records else {}
        step = max(status.step if status else 0, last.get("step", 0))
        total = status.total if status and status.total else plan_total(folder)
        seconds = last.get("time")
        running = found.state == "running"
        return {
            "name": name,
            "state": found.state,
            "note": found.note,
            "step": step,
            "total": total,
            "loss": last_value(records, "loss"),
            "seconds_per_update": seconds,
            "samples_per_s": last.get("samples_per_s"),
            "eta_s": (total - step) * seconds if running and seconds and total and total > step else None,
            "updated_at": status.updated_at if status else None,
            "started_at": status.started_at if status else None,
            "pid": status.pid if status else None,
            "last_error": status.last_error if status else None,
            "checkpoint": found.checkpoint.name if found.checkpoint else None,
            "thumbnail": thumbnail,
        }

    def detail(self, name: str, since: int | None) -> dict:
        """The run page's data: its summary, plan, resolved config, metrics lines after step `since` (all of them
        when `since` is None), and its samples."""
        folder = run_folder(self.root, name)
        records, identity = self.metrics(folder)
        last_step = records[-1]["step"] if records else 0
        samples = self.samples(folder, name)
        return {
            "metrics_id": identity,
            "summary": self.summarize(name, folder, records, samples[-1]["url"] if samples else None),
            "plan": read_json(folder / PLAN_FILE),
            "config": read_text(folder / "config.yaml"),
            "metrics": [r for r in records if since is None or r.get("step", 0) > since],
            "last_step": last_step,
            "samples": samples,
        }

    def samples(self, folder: Path, name: str) -> list[dict]:
        """The sample files (images or videos) by step and prompt index, oldest step first, each with its prompt
        (from the file's own metadata) and the URL the dashboard serves it from."""
        found = []
        sample_dir = folder / "samples"
        if not sample_dir.is_dir():
            return found
        for path in sorted(sample_dir.iterdir()):
            match = SAMPLE_NAME.match(path.name)
            if match:
                found.append({"step": int(match.group(1)), "index": int(match.group(2)),
                              "kind": "video" if match.group(3) == "mp4" else "image",
                              "prompt": self.prompt(path),
                              "url": sample_url(name, path.name)})
        found.sort(key=lambda s: (s["step"], s["index"]))
        references = {index: [f"/runs/{quote(name, safe='')}/files/{relative}" for relative in files]
                      for index, files in sample_references(folder).items()}
        for sample in found:
            sample["references"] = references.get(sample["index"], [])
        return found

    def prompt(self, path: Path) -> str:
        try:
            key = (path, path.stat().st_mtime_ns)
        except OSError:
            return ""
        with self._lock:
            if key not in self._prompts:
                self._prompts[key] = sample_prompt(path)
            return self._prompts[key]


def last_sample_url(folder: Path, name: str) -> str | None:
    """The URL of the run's newest sample (highest step, then prompt), from the file names alone."""
    found = [(int(m.group(1)), int(m.group(2)), path.name) for path in (folder / "samples").glob("step_*")
             if (m := SAMPLE_NAME.match(path.name))]
    return sample_url(name, max(found)[2]) if found else None


def sample_url(name: str, file_name: str) -> str:
    """Where the dashboard serves a run's sample (the run's name as one URL segment)."""
    return f"/runs/{quote(name, safe='')}/files/samples/{file_name}"


def last_value(records: list[dict], key: str) -> float | None:
    for record in reversed(records):
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def plan_total(folder: Path) -> int:
    plan = read_json(folder / PLAN_FILE) or {}
    return int(plan.get("total updates", 0) or 0)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""

