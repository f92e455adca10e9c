"""report.html from a made-up run folder (no model, no training): embedded samples, ticks and units on every chart,
a constant series inside its frame, a page that fits a phone's width."""

from __future__ import annotations

import base64
import itertools
import json
import math
import re

import pytest
from PIL import Image, PngImagePlugin

from toolkit.run.report import build_report, metric_unit, nice_ticks, padded_range, tick_label, write_report

RECORDS = [{"step": step, "epoch": 0, "loss": 0.3 / step, "loss_main": 0.3 / step, "lr": 1e-4,
            "grad_norm": 1.5 + step % 2, "time": 0.25 + 0.01 * step, "samples_per_s": 16.0 - step,
            "peak_memory_mib": 2048.0 + step, "timestep_hist": [1, 2], "smoothed_loss": None}
           for step in range(1, 7)]


@pytest.fixture
def run_dir(tmp_path):
    folder = tmp_path / "my_run"
    (folder / "samples").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    for step in (0, 3, 6):
        for index, prompt in enumerate(["a red circle", "a blue square"]):
            info = PngImagePlugin.PngInfo()
            info.add_text("prompt", prompt)
            Image.new("RGB", (8, 8), (40 * step, 100, 50 * index)).save(
                folder / "samples" / f"step_{step:09d}_{index}.png", pnginfo=info)
    (folder / "samples" / "step_000000009_0.png").write_bytes(b"beyond the last logged step")
    (folder / "config.yaml").write_text("model:\n  name_or_path: tiny\n  note: " + "x" * 300 + "\n")
    (folder / "plan.json").write_text(json.dumps({"total updates": 6, "batch size": 1}))
    return folder


def charts(page: str) -> dict[str, str]:
    """Metric -> its <figure> markup."""
    return {m.group(1): m.group(0) for m in re.finditer(r'<figure class="chart" id="chart-([^"]+)".*?</figure>', page)}


def frame_box(figure: str) -> tuple[float, float, float, float]:
    x, y, w, h = map(float, re.search(r'<rect class="frame" x="([^"]+)" y="([^"]+)" width="([^"]+)" '
                                      r'height="([^"]+)"', figure).groups())
    return x, y, x + w, y + h


def line_points(figure: str, name: str) -> list[tuple[float, float]]:
    points = re.search(rf'data-series="{re.escape(name)}" points="([^"]*)"', figure).group(1)
    return [tuple(map(float, p.split(","))) for p in points.split()]


def test_every_chart_has_value_and_step_ticks_and_its_unit(run_dir):
    page = build_report(run_dir)
    figures = charts(page)
    assert set(figures) == {"loss", "loss_main", "lr", "grad_norm", "time", "samples_per_s", "peak_memory_mib"}
    units = {"time": "s/update", "samples_per_s": "samples/s", "peak_memory_mib": "MiB"}
    for name, figure in figures.items():
        caption = re.search(r"<figcaption>(.*?)</figcaption>", figure, re.DOTALL).group(1)
        if name in units:
            assert f"({units[name]})" in caption and f'data-unit="{units[name]}"' in figure
        else:
            assert '<span class="unit">' not in caption and 'data-unit=""' in figure
        y_ticks = re.findall(r'<text class="ytick"[^>]*>([^<]+)</text>', figure)
        x_ticks = re.findall(r'<text class="xtick"[^>]*>([^<]+)</text>', figure)
        assert 4 <= len(y_ticks) <= 6, (name, y_ticks)
        assert x_ticks and all(re.fullmatch(r"\d+", t) for t in x_ticks)
        assert figure.count('<line class="grid"') == len(y_ticks) + len(x_ticks)
        left, top, right, bottom = frame_box(figure)
        for x, y in line_points(figure, name):
            assert left <= x <= right and top < y < bottom
    assert re.findall(r'class="ytick"[^>]*>([^<]+)<', figures["lr"]) == ["9.6e-5", "9.8e-5", "1e-4", "1.02e-4",
                                                                        "1.04e-4"]


def test_a_constant_series_runs_inside_the_frame(run_dir):
    figure = charts(build_report(run_dir))["lr"]
    _, top, _, bottom = frame_box(figure)
    ys = {y for _, y in line_points(figure, "lr")}
    assert len(ys) == 1 and top + 0.25 * (bottom - top) < ys.pop() < bottom - 0.25 * (bottom - top)


def test_a_single_logged_update_is_a_dot_in_the_frame(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 0.2, "time": 0.0}) + "\n")
    figures = charts(build_report(tmp_path))
    for name in ("loss", "time"):
        left, top, right, bottom = frame_box(figures[name])
        ((x, y),) = line_points(figures[name], name)
        assert left < x < right and top < y < bottom
        assert f'<circle class="raw" data-series="{name}"' in figures[name]


@pytest.mark.parametrize("low, high", [(0.05, 0.3), (1e-4, 1e-4), (0, 1e-4), (0.0, 0.0), (2048, 2054), (-3, 7e5),
                                       (0.1234, 0.1236), (17.0, 17.0)])
def test_ticks_are_round_numbers_around_the_data(low, high):
    ticks, (axis_low, axis_high) = nice_ticks(*padded_range(low, high))
    assert 4 <= len(ticks) <= 6 and axis_low < low <= high < axis_high
    assert axis_low <= ticks[0] and ticks[-1] <= axis_high
    spacing = ticks[1] - ticks[0]
    assert round(spacing / 10 ** math.floor(math.log10(spacing) + 1e-9), 6) in (1, 2, 5)
    assert all(abs((b - a) - spacing) <= 1e-9 * max(abs(a), abs(b), 1e-300) for a, b in itertools.pairwise(ticks))
    labels = [tick_label(t, ticks) for t in ticks]
    assert len(set(labels)) == len(labels) and all(len(label) <= 8 for label in labels)


def test_tick_labels_are_compact():
    assert [tick_label(t, [0, 2e-5, 4e-5, 6e-5, 8e-5, 1e-4]) for t in (0, 2e-5, 1e-4)] == ["0", "2e-5", "1e-4"]
    assert [tick_label(t, [0.05, 0.1, 0.15]) for t in (0.05, 0.1)] == ["0.05", "0.10"]
    assert tick_label(2000.0, [1000.0, 2000.0, 3000.0]) == "2000"
    assert metric_unit("rss_mib") == "MiB" and metric_unit("lr") == "" and metric_unit("loss_bpp") == ""
    assert metric_unit("something_new") == ""


def test_samples_are_embedded_and_nothing_is_referenced(run_dir):
    page = build_report(run_dir)
    sources = re.findall(r'\b(?:src|href)="([^"]*)"', page)
    assert sources and all(source.startswith("data:") for source in sources)
    for path in sorted((run_dir / "samples").glob("step_00000000[036]_*.png")):
        match = re.search(rf'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" title="samples/{path.name}"', page)
        assert match and base64.b64decode(match.group(1)) == path.read_bytes()
    assert "step_000000009_0.png" not in page  # after the last logged step
    assert "a blue square" in page and "name_or_path: tiny" in page and "total updates" in page
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page


def test_the_page_fits_a_phone(run_dir):
    page = build_report(run_dir)
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page
    assert re.findall(r"<svg [^>]*>", page) and all(
        'viewBox="0 0 ' in svg and 'width="100%"' in svg and "height=" not in svg
        for svg in re.findall(r"<svg [^>]*>", page))
    style = re.search(r"<style>(.*)</style>", page, re.DOTALL).group(1)
    assert ".chart svg { display: block; width: 100%; max-width: 100%; height: auto; }" in style
    assert ".scroll { max-width: 100%; overflow-x: auto; }" in style
    assert re.search(r"pre \{[^}]*overflow-x: auto", style) and "pre.wrap { white-space: pre-wrap" in style
    assert '<div class="scroll"><table class="samples">' in page
    assert '<pre class="wrap">' in page


def test_the_page_is_a_function_of_the_folder(run_dir):
    first = write_report(run_dir).read_bytes()
    assert build_report(run_dir).encode() == first
    assert write_report(run_dir).read_bytes() == first


def test_a_prompts_reference_images_are_shown_beside_its_samples(run_dir):
    """Reference images the sampler kept in samples/ (`reference_<prompt>_<slot>`) are embedded in a reference column
    on their prompt's row, in slot order; a prompt without them has an empty cell."""
    samples = run_dir / "samples"
    Image.new("RGB", (8, 8), (200, 10, 10)).save(samples / "reference_1_1.png")
    Image.new("RGB", (8, 8), (10, 200, 10)).save(samples / "reference_1_0.jpg")
    page = build_report(run_dir)
    assert "<th>reference</th>" in page
    row = page[page.index("prompt 1<br>"):]
    row = row[:row.index("</tr>")]
    first, second = row.index('title="samples/reference_1_0.jpg"'), row.index('title="samples/reference_1_1.png"')
    assert first < second < row.index("step_000000000_1.png")
    jpeg = re.search(r'<img src="data:image/jpeg;base64,([A-Za-z0-9+/=]+)" title="samples/reference_1_0.jpg"', page)
    assert base64.b64decode(jpeg.group(1)) == (samples / "reference_1_0.jpg").read_bytes()
    row0 = page[page.index("prompt 0<br>"):]
    assert row0[:row0.index("</tr>")].count("reference_") == 0
