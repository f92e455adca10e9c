"""report.html: one self-contained page per run (inline SVG and a few lines of plain JS, no network).

Built from the run folder's files alone (metrics.jsonl, samples/, config.yaml, plan.json), so
`python run.py --report RUN_FOLDER` rebuilds exactly what the trainer wrote. Sample images are referenced by
relative path, not embedded, so the page stays small and the images stay where they are.
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

from PIL import Image

from toolkit.files import write_text_atomic
from toolkit.run.metrics import read_metrics
from toolkit.run.video import VIDEO_EXTENSIONS, video_metadata

REPORT_FILE = "report.html"
PLAN_FILE = "plan.json"
#: record keys that are not plotted
NOT_SERIES = {"step", "epoch"}
#: exponential smoothing of the loss curve (the weight of the newest point)
SMOOTHING = 0.1
WIDTH, HEIGHT, PAD = 640, 180, 36
SAMPLE_NAME = re.compile(r"^step_(\d{9})_(\d+)\.(png|mp4|webp)$")


def numeric_series(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per plotted key, in first-seen key order; non-numbers (histograms, None) are skipped."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key in NOT_SERIES or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                series.setdefault(key, []).append((record["step"], float(value)))
    return series


def smoothed(points: list[tuple[int, float]], weight: float = SMOOTHING) -> list[tuple[int, float]]:
    out, level = [], None
    for step, value in points:
        level = value if level is None else level + weight * (value - level)
        out.append((step, level))
    return out


def polyline(name: str, points: list[tuple[int, float]], steps: tuple[int, int], values: tuple[float, float],
             css: str) -> str:
    (s0, s1), (v0, v1) = steps, values

    def xy(step: int, value: float) -> str:
        x = PAD + (step - s0) / max(s1 - s0, 1) * (WIDTH - 2 * PAD)
        y = HEIGHT - PAD - (value - v0) / (v1 - v0 or 1.0) * (HEIGHT - 2 * PAD)
        return f"{x:.1f},{y:.1f}"

    coords = " ".join(xy(s, v) for s, v in points)
    return f'<polyline class="{css}" data-series="{html.escape(name)}" points="{coords}"/>'


def chart(name: str, points: list[tuple[int, float]]) -> str:
    """One metric's chart: its series (and a smoothed copy for losses), axes labelled with the ranges."""
    steps = (min(s for s, _ in points), max(s for s, _ in points))
    values = (min(v for _, v in points), max(v for _, v in points))
    lines = [polyline(name, points, steps, values, "raw")]
    if name.startswith("loss"):
        lines.append(polyline(f"{name} (smoothed)", smoothed(points), steps, values, "smooth"))
    labels = (f'<text x="{PAD}" y="14">{html.escape(name)}: {values[1]:.4g} max, {values[0]:.4g} min</text>'
              f'<text x="{PAD}" y="{HEIGHT - 8}">step {steps[0]}</text>'
              f'<text x="{WIDTH - PAD}" y="{HEIGHT - 8}" text-anchor="end">step {steps[1]}</text>')
    frame = f'<rect x="{PAD}" y="{PAD}" width="{WIDTH - 2 * PAD}" height="{HEIGHT - 2 * PAD}" class="frame"/>'
    return (f'<figure class="chart" id="chart-{html.escape(name)}"><svg viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'width="{WIDTH}" height="{HEIGHT}">{frame}{"".join(lines)}{labels}</svg></figure>')


def series_names(series: dict[str, list]) -> list[str]:
    """Every plotted line: each metric, and the smoothed copy of each loss."""
    return [n for name in series for n in ([name, f"{name} (smoothed)"] if name.startswith("loss") else [name])]


def toggles(names: list[str]) -> str:
    boxes = [f'<label><input type="checkbox" checked data-toggle="{html.escape(n)}"> {html.escape(n)}</label>'
             for n in names]
    return f'<div class="toggles">{" ".join(boxes)}</div>'


def sample_grid(run_dir: Path, last_step: int | None) -> str:
    """Rows: prompt index; columns: steps up to the last logged one (samples of a run continued from an older
    checkpoint belong to abandoned steps); each cell the relative image path (prompt in its PNG text)."""
    folder = run_dir / "samples"
    found: dict[int, dict[int, str]] = {}
    for path in sorted(folder.glob("step_*")) if folder.is_dir() else []:
        match = SAMPLE_NAME.match(path.name)
        if match and (last_step is None or int(match.group(1)) <= last_step):
            found.setdefault(int(match.group(2)), {})[int(match.group(1))] = f"samples/{path.name}"
    if not found:
        return "<p>No samples yet.</p>"
    steps = sorted({step for row in found.values() for step in row})
    head = "".join(f"<th>step {step}</th>" for step in steps)
    rows = []
    for index in sorted(found):
        cells = "".join(f"<td>{sample_cell(found[index][step])}</td>" if step in found[index] else "<td></td>"
                        for step in steps)
        prompt = html.escape(sample_prompt(run_dir / found[index][max(found[index])]))
        rows.append(f'<tr><th title="{prompt}">prompt {index}<br><small>{prompt}</small></th>{cells}</tr>')
    return f'<table class="samples"><tr><th></th>{head}</tr>{"".join(rows)}</table>'


def sample_cell(relative: str) -> str:
    """A sample image, or a sample video playing in a loop (muted, so browsers autoplay it)."""
    source = html.escape(relative)
    if relative.endswith(".mp4"):
        return f'<video src="{source}" autoplay loop muted playsinline preload="metadata"></video>'
    return f'<img src="{source}" loading="lazy">'


def sample_prompt(path: Path) -> str:
    """The prompt a sample was rendered with (PNG text, a video's metadata), or '' for a file without it."""
    if path.suffix.lower() in VIDEO_EXTENSIONS:
        return video_metadata(path).get("prompt", "")
    try:
        with Image.open(path) as image:
            return image.text.get("prompt", "")
    except OSError:
        return ""


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def plan_text(run_dir: Path) -> str:
    path = run_dir / PLAN_FILE
    if not path.is_file():
        return ""
    plan = json.loads(path.read_text(encoding="utf-8"))
    return "\n".join(f"{key:36s} {value}" for key, value in plan.items())


SCRIPT = """
for (const box of document.querySelectorAll('[data-toggle]')) {
  box.addEventListener('change', () => {
    for (const line of document.querySelectorAll('polyline')) {
      if (line.dataset.series === box.dataset.toggle) line.style.display = box.checked ? '' : 'none';
    }
  });
}
"""
STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
.chart { display: inline-block; margin: 0.3em; }
.frame { fill: none; stroke: #ccc; }
polyline { fill: none; stroke-width: 1.2; }
polyline.raw { stroke: #9ab; } polyline.smooth { stroke: #c33; stroke-width: 2; }
text { font-size: 11px; fill: #555; }
.samples img, .samples video { width: 160px; } .samples th { font-weight: normal; font-size: 12px; max-width: 12em; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 12px; }
"""


def build_report(run_dir: Path) -> str:
    """The page for `run_dir`, a pure function of its files."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    series = numeric_series(records)
    name = html.escape(run_dir.name)
    last = records[-1] if records else {}
    summary = f"{len(records)} logged updates" + (f", last step {last['step']}" if last else "")
    body = [
        f"<h1>{name}</h1><p>{summary}</p>",
        "<h2>Metrics</h2>", toggles(series_names(series)), *(chart(k, v) for k, v in series.items()),
        "<h2>Samples</h2>", sample_grid(run_dir, last.get("step")),
        "<h2>Training plan</h2>", f"<pre>{html.escape(plan_text(run_dir))}</pre>",
        "<h2>Config</h2>", f"<pre>{html.escape(read_text(run_dir / 'config.yaml'))}</pre>",
    ]
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{name}: difftune report</title>'
            f"<style>{STYLE}</style></head><body>{''.join(body)}<script>{SCRIPT}</script></body></html>\n")


def write_report(run_dir: Path) -> Path:
    """(Re)write report.html atomically."""
    return write_text_atomic(run_dir / REPORT_FILE, build_report(run_dir))
