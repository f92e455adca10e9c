"""The benchmark harness runs and reports every figure (no speed is asserted: benchmarks are not tests)."""

from __future__ import annotations

import json

from benchmarks.run import main, measure, table


def test_benchmark_figures_come_out(tmp_path, tiny_sd15, monkeypatch):
    results = measure(rounds=1, updates=2, resolution=64, loading_seconds=0.2, device="cpu")
    overhead = results["overhead"]
    assert overhead["difftune_s_per_update"] > 0 and overhead["bare_s_per_update"] > 0
    assert overhead["overhead_ratio"] == overhead["difftune_s_per_update"] / overhead["bare_s_per_update"]
    assert results["cache_speedup"]["uncached_s_per_update"] > 0
    assert {"imports_s", "model_load_s", "caching_s"} <= set(results["startup"])
    assert set(results["data_loading_images_per_s"]) == {"workers_0", "workers_2"}
    assert results["memory_after_training"]["rss_mib"] > 0
    assert f"overhead ratio: {overhead['overhead_ratio']:.3f}" in table(results)


def test_benchmark_command_writes_json(tmp_path, tiny_sd15, monkeypatch, capsys):
    monkeypatch.setattr("benchmarks.run.QUICK", (1, 1, 64, 0.1))
    assert main(["--quick", "--json", str(tmp_path / "bench.json")]) == 0
    assert "overhead ratio: " in capsys.readouterr().out
    assert "overhead" in json.loads((tmp_path / "bench.json").read_text())
