"""report.html: one self-contained page per run (inline SVG and a few lines of plain JS, no network).

Built from the run folder's files alone (metrics.jsonl, samples/, config.yaml, plan.json), so
`python run.py --report RUN_FOLDER` rebuilds exactly what the trainer wrote, byte for byte. The samples are embedded
(base64 data: URIs of the files' own bytes), so the one file can be mailed or moved and still shows everything;
the price is its size, which grows with the samples. Each chart has value and step ticks, the metric's unit in
its title, and a value range padded so that no line lies on the frame (a constant series runs through the middle).
The page fits a phone's width: charts scale down, the sample grid and the text blocks scroll in their own boxes.
"""

from __future__ import annotations

import base64
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
#: the chart's coordinate system (its viewBox; the page scales it to the width available)
WIDTH, HEIGHT = 480, 220
PAD_TOP, PAD_RIGHT, PAD_BOTTOM = 10, 24, 34
#: space for the value labels: at least this, more for long labels (about CHAR pixels a character)
PAD_LEFT, CHAR = 40, 8
#: the share of the value range left free above and below the lines
MARGIN = 0.06
SAMPLE_NAME = re.compile(r"^step_(\d{9})_(\d+)\.(png|mp4|webp)$")
#: a sample prompt's reference image, copied into samples/ when its samples are rendered: prompt index, slot
REFERENCE_NAME = re.compile(r"^reference_(\d+)_(\d+)\.(png|jpg|jpeg|webp)$")
MEDIA_TYPES = {".png": "image/png", ".webp": "image/webp", ".mp4": "video/mp4", ".jpg": "image/jpeg",
               ".jpeg": "image/jpeg"}
#: units of the metrics a run logs (toolkit/run/monitor.py, metrics.py Throughput, device.py memory_fields);
#: losses, the LR, gradient norm and update RMS have none, as has a metric not named here
UNITS = {"time": "s/update", "samples_per_s": "samples/s"}


def metric_unit(name: str) -> str:
    """The unit shown in a metric's chart title, '' for none."""
    if name.endswith("_mib"):
        return "MiB"
    return UNITS.get(name, "")


def numeric_series(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per plotted key: the losses first, then in first-seen key order (a validation loss, logged
    before the first update, comes next); non-numbers (histograms, None) are skipped."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key in NOT_SERIES or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                series.setdefault(key, []).append((record["step"], float(value)))
    return dict(sorted(series.items(), key=lambda item: not item[0].startswith("loss")))


def smoothed(points: list[tuple[int, float]], weight: float = SMOOTHING) -> list[tuple[int, float]]:
    out, level = [], None
    for step, value in points:
        level = value if level is None else level + weight * (value - level)
        out.append((step, level))
    return out


# ---- axes ----------------------------------------------------------------------------------------------


def padded_range(low: float, high: float) -> tuple[float, float]:
    """The value range a chart shows: the data's with a margin on both sides; a constant (or nearly constant)
    series gets +-5% of its value (+-1 around zero), so its line runs inside the plot, not on the frame."""
    span = high - low
    if span <= 1e-9 * max(abs(low), abs(high)):
        centre = (low + high) / 2
        half = abs(centre) * 0.05 or 1.0
        return centre - half, centre + half
    return low - span * MARGIN, high + span * MARGIN


def nice_steps(span: float, integer: bool = False):
    """Candidate tick spacings, 1, 2 and 5 times a power of ten, from about span/20 up (integers >= 1 only for
    `integer`)."""
    power = math.floor(math.log10(span / 20)) if span > 0 else 0
    if integer:
        power = max(power, 0)
    for exponent in range(power, power + 4):
        for mantissa in (1, 2, 5):
            yield mantissa, exponent


def tick_at(k: int, mantissa: int, exponent: int) -> float:
    """k times the spacing, computed so that ticks are the decimal numbers they stand for (0.3, not
    0.30000000000000004)."""
    value = k * mantissa * 10.0**exponent if exponent >= 0 else k * mantissa / 10.0**-exponent
    return float(f"{value:.12g}")


def nice_ticks(low: float, high: float, integer: bool = False) -> tuple[list[float], tuple[float, float]]:
    """4 to 6 evenly spaced round values (1, 2 or 5 times a power of ten apart) and the axis range that shows
    them: [low, high] itself when 4 to 6 such values fall inside it, else widened to the ticks around it.
    `integer`: whole-number spacing (steps), so a short range may get fewer ticks."""
    fallback = None
    for mantissa, exponent in nice_steps(high - low, integer):
        spacing = mantissa * 10.0**exponent
        first, last = math.ceil(low / spacing - 1e-9), math.floor(high / spacing + 1e-9)
        count = last - first + 1
        if 4 <= count <= 6:
            return [tick_at(k, mantissa, exponent) for k in range(first, last + 1)], (low, high)
        if count < 4:  # the spacing before gave more than 6: widen the range to this one's ticks around it
            fallback = (mantissa, exponent, spacing)
            break
    if fallback is None:  # only reachable for degenerate input; keep the axis as it is
        return [low, high], (low, high)
    mantissa, exponent, spacing = fallback
    first, last = math.floor(low / spacing + 1e-9), math.ceil(high / spacing - 1e-9)
    while last - first + 1 < 4 and not integer:  # widen by whole spacings, alternately at the top and the bottom
        if (last - first) % 2:
            first -= 1
        else:
            last += 1
    ticks = [tick_at(k, mantissa, exponent) for k in range(first, last + 1)]
    return ticks, (min(low, ticks[0]), max(high, ticks[-1]))


def tick_label(value: float, ticks: list[float]) -> str:
    """A compact label: as few decimals as the spacing needs; 1e-4 style for small values that would need more
    than 4 decimals (learning rates) and for values of a million and more."""
    if value == 0:
        return "0"
    spacing = (ticks[-1] - ticks[0]) / (len(ticks) - 1) if len(ticks) > 1 else abs(value)
    largest = max(abs(t) for t in ticks)
    decimals = max(0, -math.floor(math.log10(spacing) + 1e-9))
    if largest >= 1e6 or (decimals > 4 and largest < 0.01):
        digits = max(0, math.floor(math.log10(abs(value))) - math.floor(math.log10(spacing) + 1e-9))
        mantissa, exponent = f"{value:.{digits}e}".split("e")
        if "." in mantissa:
            mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:.{decimals}f}"


def value_label(value: float) -> str:
    """A value in a chart's caption (the last, lowest and highest): 4 significant digits, whole numbers from
    10000 on, 1e-5 style below 0.0001."""
    if 1e4 <= abs(value) < 1e9:
        return f"{value:.0f}"
    text = f"{value:.4g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text


# ---- charts --------------------------------------------------------------------------------------------


class Frame:
    """The plot area of a chart and the mapping of (step, value) into it."""

    def __init__(self, steps: tuple[float, float], values: tuple[float, float], left: int):
        self.steps, self.values = steps, values
        self.left, self.top = left, PAD_TOP
        self.width, self.height = WIDTH - left - PAD_RIGHT, HEIGHT - PAD_TOP - PAD_BOTTOM

    def x(self, step: float) -> float:
        s0, s1 = self.steps
        return self.left + (step - s0) / (s1 - s0) * self.width

    def y(self, value: float) -> float:
        v0, v1 = self.values
        return self.top + self.height - (value - v0) / (v1 - v0) * self.height


def step_range(points: list[tuple[int, float]]) -> tuple[float, float]:
    """The steps shown: the logged ones, with half a step either side of a single one."""
    first, last = min(s for s, _ in points), max(s for s, _ in points)
    return (first - 0.5, last + 0.5) if first == last else (first, last)


def polyline(name: str, points: list[tuple[int, float]], frame: Frame, css: str) -> str:
    coords = " ".join(f"{frame.x(s):.1f},{frame.y(v):.1f}" for s, v in points)
    line = f'<polyline class="{css}" data-series="{html.escape(name)}" points="{coords}"/>'
    if len(points) == 1:  # one point draws no line: a dot shows it
        line += (f'<circle class="{css}" data-series="{html.escape(name)}" cx="{frame.x(points[0][0]):.1f}" '
                 f'cy="{frame.y(points[0][1]):.1f}" r="2.5"/>')
    return line


def axes(frame: Frame, value_ticks: list[float], step_ticks: list[float]) -> str:
    """Grid lines and labels: values on the left, steps below (with the axis name), the frame around."""
    left, right = frame.left, frame.left + frame.width
    top, bottom = frame.top, frame.top + frame.height
    parts = []
    for value in value_ticks:
        y = frame.y(value)
        parts.append(f'<line class="grid" x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="ytick" x="{left - 5}" y="{y + 4:.1f}" text-anchor="end">'
                     f"{tick_label(value, value_ticks)}</text>")
    for step in step_ticks:
        x = frame.x(step)
        parts.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}"/>'
                     f'<text class="xtick" x="{x:.1f}" y="{bottom + 15}" text-anchor="middle">{int(step)}</text>')
    parts.append(f'<text class="axis" x="{right}" y="{HEIGHT - 3}" text-anchor="end">step</text>')
    parts.append(f'<rect class="frame" x="{left}" y="{top}" width="{frame.width}" height="{frame.height}"/>')
    return "".join(parts)


def chart(name: str, points: list[tuple[int, float]]) -> str:
    """One metric's chart: its series (and a smoothed copy for losses) on value and step ticks with grid lines,
    titled with the metric, its unit and its last, lowest and highest values."""
    values = [v for _, v in points]
    value_ticks, value_range = nice_ticks(*padded_range(min(values), max(values)))
    steps = step_range(points)
    step_ticks = [t for t in nice_ticks(*steps, integer=True)[0] if steps[0] <= t <= steps[1]]
    left = max(PAD_LEFT, CHAR * max(len(tick_label(v, value_ticks)) for v in value_ticks) + 10)
    frame = Frame(steps, value_range, left)
    lines = [polyline(name, points, frame, "raw")]
    if name.startswith("loss"):
        lines.append(polyline(f"{name} (smoothed)", smoothed(points), frame, "smooth"))
    unit = metric_unit(name)
    title = html.escape(name) + (f' <span class="unit">({html.escape(unit)})</span>' if unit else "")
    caption = (f"<figcaption><b>{title}</b> <small>last {value_label(values[-1])} · "
               f"min {value_label(min(values))} · max {value_label(max(values))}</small></figcaption>")
    return (f'<figure class="chart" id="chart-{html.escape(name)}" data-unit="{html.escape(unit)}">{caption}'
            f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="100%" role="img" '
            f'aria-label="{html.escape(name)}">{axes(frame, value_ticks, step_ticks)}{"".join(lines)}</svg></figure>')


def series_names(series: dict[str, list]) -> list[str]:
    """Every plotted line: each metric, and the smoothed copy of each loss."""
    return [n for name in series for n in ([name, f"{name} (smoothed)"] if name.startswith("loss") else [name])]


def toggles(names: list[str]) -> str:
    boxes = [f'<label><input type="checkbox" checked data-toggle="{html.escape(n)}"> {html.escape(n)}</label>'
             for n in names]
    return f'<div class="toggles">{" ".join(boxes)}</div>'


# ---- samples -------------------------------------------------------------------------------------------


def sample_grid(run_dir: Path, last_step: int | None) -> str:
    """Rows: prompt index; columns: steps up to the last logged one (samples of a run continued from an older
    checkpoint belong to abandoned steps); each cell the sample embedded (prompt in its PNG text)."""
    folder = run_dir / "samples"
    found: dict[int, dict[int, str]] = {}
    for path in sorted(folder.glob("step_*")) if folder.is_dir() else []:
        match = SAMPLE_NAME.match(path.name)
        if match and (last_step is None or int(match.group(1)) <= last_step):
            found.setdefault(int(match.group(2)), {})[int(match.group(1))] = f"samples/{path.name}"
    if not found:
        return "<p>No samples yet.</p>"
    steps = sorted({step for row in found.values() for step in row})
    references = sample_references(run_dir)
    head = ("<th>reference</th>" if references else "") + "".join(f"<th>step {step}</th>" for step in steps)
    rows = []
    for index in sorted(found):
        cells = "".join(f"<td>{sample_cell(run_dir, found[index][step])}</td>" if step in found[index]
                        else "<td></td>" for step in steps)
        if references:
            cells = f'<td>{"".join(sample_cell(run_dir, r) for r in references.get(index, []))}</td>' + cells
        prompt = html.escape(sample_prompt(run_dir / found[index][max(found[index])]))
        rows.append(f'<tr><th title="{prompt}">prompt {index}<br><small>{prompt}</small></th>{cells}</tr>')
    return f'<div class="scroll"><table class="samples"><tr><th></th>{head}</tr>{"".join(rows)}</table></div>'


def sample_references(run_dir: Path) -> dict[int, list[str]]:
    """Each prompt's reference images as the sampler copied them into samples/ (`reference_<prompt>_<slot>.<ext>`),
    their paths in the run folder in slot order; none for prompts without references."""
    folder = run_dir / "samples"
    found: dict[int, dict[int, str]] = {}
    for path in folder.glob("reference_*") if folder.is_dir() else []:
        match = REFERENCE_NAME.match(path.name)
        if match:
            found.setdefault(int(match.group(1)), {})[int(match.group(2))] = f"samples/{path.name}"
    return {index: [slots[slot] for slot in sorted(slots)] for index, slots in found.items()}


def data_uri(path: Path) -> str:
    """The file's bytes as a data: URI (base64)."""
    media = MEDIA_TYPES.get(path.suffix.lower(), "application/octet-stream")
    return f"data:{media};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def sample_cell(run_dir: Path, relative: str) -> str:
    """A sample image, or a sample video playing in a loop (muted, so browsers autoplay it), embedded; its path
    in the run folder is its tooltip. A click shows it full size."""
    source, name = data_uri(run_dir / relative), html.escape(relative)
    if relative.endswith(".mp4"):
        return f'<video src="{source}" title="{name}" autoplay loop muted playsinline></video>'
    return f'<img src="{source}" title="{name}" alt="{name}">'


def sample_prompt(path: Path) -> str:
    """The prompt a sample was rendered with (PNG text, a video's metadata), or '' for a file without it."""
    if path.suffix.lower() in VIDEO_EXTENSIONS:
        return video_metadata(path).get("prompt", "")
    try:
        with Image.open(path) as image:
            return image.text.get("prompt", "")
    except OSError:
        return ""


# ---- page ----------------------------------------------------------------------------------------------


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
    for (const line of document.querySelectorAll('[data-series]')) {
      if (line.dataset.series === box.dataset.toggle) line.style.display = box.checked ? '' : 'none';
    }
  });
}
for (const sample of document.querySelectorAll('.samples img, .samples video')) {
  sample.addEventListener('click', () => sample.classList.toggle('full'));
}
document.addEventListener('keydown', (event) => {
  if (event.key === 'Escape') for (const open of document.querySelectorAll('.full')) open.classList.remove('full');
});
"""
STYLE = """
* { box-sizing: border-box; }
body { font-family: sans-serif; margin: 1.5em; color: #222; overflow-wrap: break-word; }
@media (max-width: 600px) { body { margin: 0.6em; } }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(min(100%, 420px), 1fr)); gap: 0.8em; }
.chart { margin: 0; min-width: 0; max-width: 640px; }
.chart figcaption { font-size: 14px; margin-bottom: 0.2em; } .chart figcaption small { color: #666; }
.chart svg { display: block; width: 100%; max-width: 100%; height: auto; }
.frame { fill: none; stroke: #bbb; } .grid { stroke: #eee; stroke-width: 1; }
polyline { fill: none; stroke-width: 1.4; vector-effect: non-scaling-stroke; }
.raw { stroke: #7a9bb0; } .smooth { stroke: #c33; stroke-width: 2; }
circle.raw { fill: #7a9bb0; } circle.smooth { fill: #c33; }
text { font-size: 13px; fill: #555; }
.toggles { margin-bottom: 0.8em; } .toggles label { display: inline-block; margin-right: 0.8em; font-size: 14px; }
.scroll { max-width: 100%; overflow-x: auto; }
.samples img, .samples video { width: 160px; display: block; cursor: zoom-in; }
@media (max-width: 600px) { .samples img, .samples video { width: 110px; } }
.samples th { font-weight: normal; font-size: 12px; min-width: 7em; max-width: 12em; }
.samples .full { position: fixed; top: 0; left: 0; width: 100vw; height: 100vh; object-fit: contain;
  background: rgba(0, 0, 0, 0.85); z-index: 10; cursor: zoom-out; }
pre { background: #f6f6f6; padding: 0.8em; max-width: 100%; overflow-x: auto; font-size: 12px; }
pre.wrap { white-space: pre-wrap; overflow-wrap: anywhere; }
"""


def build_report(run_dir: Path) -> str:
    """The page for `run_dir`, a pure function of its files."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    series = numeric_series(records)
    name = html.escape(run_dir.name)
    last = records[-1] if records else {}
    updates = [r for r in records if "loss" in r]  # a validation line of its own (step 0) is not an update
    summary = f"{len(updates)} logged updates" + (f", last step {last['step']}" if last else "")
    body = [
        f"<h1>{name}</h1><p>{summary}</p>",
        "<h2>Metrics</h2>", toggles(series_names(series)),
        f'<div class="charts">{"".join(chart(k, v) for k, v in series.items())}</div>',
        "<h2>Samples</h2>", sample_grid(run_dir, last.get("step")),
        "<h2>Training plan</h2>", f"<pre>{html.escape(plan_text(run_dir))}</pre>",
        "<h2>Config</h2>", f'<pre class="wrap">{html.escape(read_text(run_dir / "config.yaml"))}</pre>',
    ]
    return ('<!DOCTYPE html><html><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{name}: difftune report</title>"
            f"<style>{STYLE}</style></head><body>{''.join(body)}<script>{SCRIPT}</script></body></html>\n")


def write_report(run_dir: Path) -> Path:
    """(Re)write report.html atomically."""
    return write_text_atomic(run_dir / REPORT_FILE, build_report(run_dir))
