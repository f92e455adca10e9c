"""The benchmark harness runs and reports every figure (no speed is asserted: benchmarks are not tests)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

import benchmarks.run
from benchmarks.run import DifftuneLoop, Round, Settings, main, measure, ratio, spread, table

#: the smallest run of every loop: one round of one epoch of 8 updates, the first left out
TINY = Settings(rounds=1, warmup=1, epochs_per_round=1, repeats=1, loading_seconds=0.2, workers=1)


@pytest.fixture(scope="module")
def figures(tiny_sd15):
    # eager: dynamo's tracing through the real compile path, without inductor's code generation (minutes here)
    # the two figures that start fresh interpreters are checked on their own below, without the trainer's imports
    return measure(TINY, device="cpu", compile_backend="eager", fresh_processes=False)


def test_a_round_times_its_updates_after_the_warm_up():
    done = Round(durations=[9.0, 2.0, 4.0], waits=[5.0, 1.0, 0.0], not_ready=[5.0, 0.5, 0.0])
    assert done.steady(1) == (3.0, 0.5) and done.not_ready_per_update(1) == 0.25
    with pytest.raises(ValueError, match="none after its 3 warm-up"):
        done.steady(3)


def test_ratios_are_the_median_of_the_rounds_with_their_spread():
    ours, plain = [(1.1, 0), (2.4, 0), (3.0, 0), (1.0, 0)], [(1.0, 0), (2.0, 0), (3.0, 0), (1.0, 0)]
    figure = ratio(ours, plain)
    assert figure["median"] == pytest.approx(1.05) and figure["rounds"] == 4
    assert (figure["min"], figure["max"]) == (1.0, pytest.approx(1.2))
    assert figure["range_pct"] == pytest.approx(100 * 0.2 / 1.05)
    assert spread([2.0])["iqr_pct"] == 0


@pytest.mark.slow
def test_benchmark_figures_come_out(figures):
    uncached, cached = figures["uncached"], figures["cached"]
    assert set(uncached["loops"]) == {"difftune", "plain_files", "plain_memory"}
    assert set(cached["loops"]) == {"difftune", "plain_encoded"}
    for loop in [*uncached["loops"].values(), *cached["loops"].values(), *uncached["loader"].values()]:
        assert loop["s_per_update"] > 0 and loop["wait_ms_per_update"] >= 0
    assert set(uncached["loader"]) == {"workers_0", "workers_1"}
    worker = uncached["loader"]["workers_1"]  # its batches stamped when ready: a wait tells data from hand-over
    assert 0 <= worker["not_ready_ms_per_update"] <= worker["wait_ms_per_update"]
    itself = uncached["loader"]["workers_0"]  # a loop that makes its batches waits for nothing but that
    assert itself["not_ready_ms_per_update"] == itself["wait_ms_per_update"]
    one_round = uncached["vs_plain_files"]  # one round: its ratio is the two loops' times
    assert one_round["median"] == pytest.approx(uncached["loops"]["difftune"]["s_per_update"]
                                                / uncached["loops"]["plain_files"]["s_per_update"])
    assert cached["vs_plain_encoded"]["rounds"] == 1 and uncached["workers_vs_none"]["rounds"] == 1
    assert uncached["own_metrics_time_s"]["metrics"] > 0 and uncached["own_metrics_time_s"]["harness"] > 0
    assert figures["cache_speedup"]["uncached_s_per_update"] == uncached["loops"]["difftune"]["s_per_update"]
    assert {"model_load_s", "caching_s"} <= set(figures["startup"])
    text = table(figures)
    assert re.search(r"start-up: imports / model load / caching +- / ", text)  # not measured here
    assert set(figures["data_loading_images_per_s"]) == {"workers_0", "workers_2"}
    assert figures["memory_after_training"]["rss_mib"] > 0
    assert f"uncached vs plain (a), files every step: {uncached['vs_plain_files']['median']:.3f}" in text
    assert "uncached alone, difftune workers 1: wait for batches not yet made" in text
    assert f"cached vs plain (c), latents and embeddings in memory: {cached['vs_plain_encoded']['median']:.3f}" in text
    assert re.search(r"plain loops' AdamW +torch's defaults", text)
    skip = figures["on_nan_skip"]  # both modes ran their rounds, turn about
    assert skip["skip_vs_stop"]["rounds"] == 2 and all(v["s_per_update"] > 0 for v in skip["loops"].values())
    assert f"train.on_nan skip vs stop, cached: {skip['skip_vs_stop']['median']:.3f}" in text


@pytest.mark.slow
def test_loops_sharing_a_trainer_time_only_their_own_rounds(tmp_path, tiny_sd15):
    """Two loops on one trainer (two loaders): a round stamps the trainer for its own loop alone, so the other
    loop's round and the plain updates it ran in between are not run again inside it, and each round counts each
    of its updates once."""
    with benchmarks.run.progress_bars_off():
        trainer = benchmarks.run.ready_trainer(tmp_path, True, "cpu", TINY)
        try:
            first, second = DifftuneLoop(trainer), DifftuneLoop(trainer)
            between = []
            done = first.round(3, lambda: between.append("first"))
            assert len(done.durations) == len(done.waits) == 3 and between == ["first"] * 3
            for loop in (second, first):
                done = loop.round(3)
                assert len(done.durations) == len(done.waits) == 3 and len(set(done.steps)) == 3
            assert between == ["first"] * 3
        finally:
            benchmarks.run.close(trainer)


@pytest.mark.slow
def test_plain_loops_run_torchs_adamw_or_the_trainers_implementation(tmp_path, tiny_sd15):
    """By default the plain loops' AdamW is torch's per-parameter one on the CPU, as the diffusers script builds it;
    with `plain_optimizer: trainer` it is the fused AdamW the trainer runs."""
    with benchmarks.run.progress_bars_off():
        trainer = benchmarks.run.ready_trainer(tmp_path, True, "cpu", TINY)
        try:
            assert trainer.optimizer.param_groups[0]["fused"]
            for setting, fused in (("torch", False), ("trainer", True)):
                options = benchmarks.run.plain_optimizer_options(trainer, replace(TINY, plain_optimizer=setting))
                loop = benchmarks.run.PlainLoop(trainer, iter(()), encoded=True, optimizer_options=options)
                assert bool(loop.optimizer.param_groups[0]["fused"]) is fused, setting
        finally:
            benchmarks.run.close(trainer)


@pytest.mark.slow
def test_compile_figures_come_out(figures):
    compiled = figures["compile"]
    assert compiled["backend"] == "eager" and compiled["first_epoch_updates"] > 0
    assert compiled["compiled_s_per_update"] > 0 and compiled["first_epoch_s"] > 0
    assert compiled["speedup"] == compiled["eager_s_per_update"] / compiled["compiled_s_per_update"]
    assert "compiled (eager) s/update" in table(figures)


@pytest.mark.slow
def test_benchmark_command_prints_the_table_and_writes_json(tmp_path, figures, monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(benchmarks.run, "measure", lambda *args: asked.append(args) or figures)
    assert main(["--quick", "--compile", "--json", str(tmp_path / "bench.json")]) == 0
    assert main(["--rounds", "3", "--workers", "2", "--plain-optimizer", "trainer"]) == 0
    assert asked == [(benchmarks.run.QUICK, "cpu", "inductor"),
                     (replace(benchmarks.run.FULL, rounds=3, workers=2, plain_optimizer="trainer"), "cpu", None)]
    assert "uncached vs plain (b), pixels and ids in memory" in capsys.readouterr().out
    assert json.loads((tmp_path / "bench.json").read_text())["compile"]["backend"] == "eager"


@pytest.mark.slow
def test_full_size_script_runs_the_real_job_path_on_tiny_presets(tmp_path, tiny_cache):
    from benchmarks.full_size import main as full_size

    out = tmp_path / "full.json"
    assert full_size(["--size", "tiny", "--device", "cpu", "--updates", "3", "--warmup", "1", "--images", "2",
                      "--rank", "4", "--json", str(out)]) == 0
    models = json.loads(out.read_text())["models"]
    assert set(models) == {"sd15", "sdxl", "zimage", "flux", "flux_kontext", "qwen_image", "qwen_image_edit", "qwen_image_qint4", "qwen_image_qint8",
                           "qwen_image_fsdp", "wan21", "wan22_5b"}
    assert models["wan21"]["frames"] == 5
    assert models["qwen_image_fsdp"]["processes"] == 2  # on the CPU: two gloo processes, launched as on GPUs
    for result in models.values():
        assert result["s_per_update"] > 0 and result["loop_s"] > 0 and result["build_s"] > 0
        assert result["setup_s"] > 0 and result["finish_s"] > 0
        assert result["trainable_params_m"] > 0 and len(result["loss_first_last"]) == 2


def test_one_gpu_gets_computed_sharding_figures_that_fall_with_the_gpu_count(tiny_cache):
    """With one GPU there is nothing to shard over: the per-GPU weights for 2, 4 and 8 GPUs are computed from the
    weight files, each the model over N plus two of its largest blocks."""
    from benchmarks.full_size import computed_sharding, presets
    from toolkit.models.qwen_image.tiny import ensure_tiny_qwen_image

    figures = computed_sharding(ensure_tiny_qwen_image(), presets("tiny")["qwen_image_fsdp"])
    assert list(figures) == [2, 4, 8] and figures[2] > figures[4] > figures[8] > 0
    assert figures[2] - figures[4] == pytest.approx(2 * (figures[4] - figures[8]))


@pytest.mark.slow
def test_start_up_figures_time_a_fresh_interpreter_and_the_first_metrics_line(tmp_path, registry):
    """The harness's two fresh-process figures, on stand-ins: an import of a small module, and a run.py that keeps
    the job it is given and writes its first metrics line after a pause. The job is a real one: it loads and passes
    run.py's checks, and the module the real figure imports exists."""
    import importlib.util
    import inspect

    from benchmarks.run import import_seconds, launch_to_first_update
    from toolkit.config.loader import check_paths, load_config

    assert 0 < import_seconds("json") < 5
    module = inspect.signature(import_seconds).parameters["module"].default
    assert importlib.util.find_spec(module) is not None
    repo = tmp_path / "repo"
    (repo / "config" / "examples").mkdir(parents=True)
    (repo / "config" / "examples" / "quickstart_data").symlink_to(benchmarks.run.QUICKSTART_DATA)
    (repo / "config" / "examples" / "quickstart.yaml").write_text(
        (benchmarks.run.REPO / "config" / "examples" / "quickstart.yaml").read_text())
    (repo / "run.py").write_text(
        "import shutil, sys, time, yaml\nfrom pathlib import Path\n"
        "shutil.copy(sys.argv[1], Path(__file__).parent / 'given.yaml')\n"
        "job = yaml.safe_load(Path(sys.argv[1]).read_text())\n"
        "process = job['config']['process'][0]\n"
        "assert sys.argv[2] == '--quiet'\n"
        "time.sleep(0.5)\n"
        "run = Path(process['training_folder']) / job['config']['name']\n"
        "run.mkdir(parents=True)\n"
        "(run / 'metrics.jsonl').write_text('{\"step\": 1}\\n')\n")
    assert 0.5 <= launch_to_first_update(repo, timeout=60) < 30
    config, path = load_config(str(repo / "given.yaml"), registry)
    check_paths(config, path)
    process = config.config.process[0]
    assert process.train.steps == 1 and process.sample.sample_every == 0 and process.save.save_every == 0


def test_smoke_jobs_are_the_examples_shortened_in_one_precision(tmp_path, registry):
    """Each family's tiny example, rewritten for the smoke run: both dtype keys, the device, a few updates with
    checkpoints, samples, validation and an EMA, its dataset by absolute path and its run folder and caches in the
    job's folder; the job file still loads."""
    from benchmarks.gpu_smoke import examples, shortened
    from toolkit.config.loader import check_paths, load_config

    found = examples()
    assert {"sd15", "sdxl", "flux", "zimage", "qwen_image", "wan", "wuerstchen"} <= set(found)
    assert found["sd15"].name == "quickstart.yaml"
    path = shortened(found["wan"], "fp16", "cuda", 3, tmp_path)
    config, config_path = load_config(str(path), registry)
    check_paths(config, config_path)
    process = config.config.process[0]
    assert (process.model.dtype, process.train.dtype, process.device) == ("fp16", "fp16", "cuda")
    assert process.model.quantize and process.model.low_vram and process.train.cache_text_embeddings  # kept
    assert process.train.steps == 3 and process.train.ema.decay == 0.9 and process.save.save_every == 2
    sample = process.sample
    assert (sample.sample_every, sample.sample_at_start, sample.sample_steps) == (2, True, 2)
    assert process.validation.split == 0.25 and process.validation.every == 2
    dataset = process.datasets[0]
    assert dataset.folder_path == str(benchmarks.run.REPO / "config" / "examples" / "quickstart_clips")
    assert Path(dataset.cache_dir).parent.parent == tmp_path
    assert process.training_folder == str(tmp_path / "output")


def test_smoke_rows_tell_a_config_refusal_from_a_failure():
    from benchmarks.gpu_smoke import error_line

    refused = ("13:13:47 ERROR job.yaml: invalid config\n"
               "  config.process[0].model.dtype: bf16 cannot go with train.dtype: fp16\n"
               "13:13:47 ERROR failed: job.yaml\n")
    assert error_line(refused, first=True) == (
        "job.yaml: invalid config: config.process[0].model.dtype: bf16 cannot go with train.dtype: fp16")
    crashed = ("13:13:47 ERROR job job.yaml failed\nTraceback (most recent call last):\n"
               "  File \"x.py\", line 1\n"
               "RuntimeError: expected scalar type Half but found BFloat16\n"
               "13:13:48 ERROR failed: job.yaml\n")
    assert error_line(crashed, first=False) == "RuntimeError: expected scalar type Half but found BFloat16"


@pytest.mark.slow
def test_gpu_smoke_runs_the_quickstart_on_the_cpu(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_smoke", "--device", "cpu",
                           "--families", "sd15", "--precisions", "bf16", "--keep", str(tmp_path / "runs")],
                          cwd=benchmarks.run.REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("sd15 "))
    family, precision, status, seconds, loss, finite, samples = row.split()[:7]
    assert (precision, status, finite) == ("bf16", "ok", "yes"), row
    assert float(seconds) > 0 and math.isfinite(float(loss)) and int(samples) > 0
    written = tmp_path / "runs" / "sd15_bf16" / "output" / "quickstart" / "samples"
    assert len(list(written.glob("*.png"))) == int(samples)
