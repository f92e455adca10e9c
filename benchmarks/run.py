"""difftune's speed and memory, measured side by side in one process so that a shared machine's noise cancels.

    python -m benchmarks.run            # a few minutes on a laptop CPU
    python -m benchmarks.run --quick    # about a minute
    python -m benchmarks.run --json out.json

Figures (tiny SD model on the shipped quickstart images unless --device cuda says otherwise):
- overhead ratio: difftune's seconds per update (the real loop: data loader, seeded draws, metrics, control
  checks) over a bare PyTorch loop doing the same forward, backward and optimizer step on the same modules and
  batches; the two alternate in rounds and the medians are compared;
- cache speed-up: seconds per update with the encoders live vs with latent and text-embedding caches;
- start-up: seconds for the imports, the model load and the caches before the first update, and from
  `python run.py` on the quickstart job to its first update (a fresh process, outside clock);
- data loading: images per second through decode, bucket and crop with 0 and 2 workers;
- peak memory: process RSS (and accelerator memory where there is one) after each phase.
Nothing here asserts a speed; tests only check that the figures come out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
QUICKSTART_DATA = REPO / "config" / "examples" / "quickstart_data"


def trainer_config(folder: Path, cached: bool, device: str, resolution: int, compile_backend: str | None = None) -> dict:
    return {
        "type": "sd_trainer", "training_folder": str(folder), "device": device, "trigger_word": "shp",
        "network": {"linear": 4, "linear_alpha": 4},
        "save": {"save_every": 0, "formats": ["diffusers"]},
        "datasets": [{"folder_path": str(QUICKSTART_DATA), "resolution": [resolution], "num_repeats": 4,
                      "cache_latents": cached, "cache_dir": str(folder / "cache")}],
        "train": {"batch_size": 2, "steps": 100000, "lr": 1e-4, "dtype": "fp32", "cache_text_embeddings": cached,
                  "compile": compile_backend is not None, "compile_backend": compile_backend or "inductor"},
        "model": {"arch": "sd15", "name_or_path": "tiny"},
        "logging": {"log_every": 10},
    }


def ready_trainer(folder: Path, cached: bool, device: str, resolution: int, timings: dict | None = None,
                  compile_backend: str | None = None):
    """A trainer set up exactly as `run()` does before its loop; `timings` gets the setup phases' seconds."""
    import yaml

    from jobs.job import get_job
    from jobs.registry import build_registry
    from toolkit.config.loader import load_config

    registry = build_registry(REPO / "extensions")
    folder.mkdir(parents=True, exist_ok=True)
    name = f"bench_{int(cached)}" + (f"_{compile_backend}" if compile_backend else "")
    path = folder / f"{name}.yaml"
    body = {"name": name, "process": [trainer_config(folder, cached, device, resolution, compile_backend)]}
    path.write_text(yaml.safe_dump({"job": "extension", "config": body}))
    config, path = load_config(str(path), registry)
    trainer = get_job(config, path, registry).processes[0]
    from toolkit.data.training_data import TrainingData

    with timed(type(trainer), "load_model", timings), timed(TrainingData, "build_caches", timings):
        trainer.start()
        trainer.monitor.started()
        trainer.setup()
    trainer.open_run_folder(resumed=False)
    trainer.monitor.planned(trainer.plan, 0, False, trainer.sampler)
    return trainer


@contextmanager
def timed(cls: type, name: str, timings: dict | None):
    """Record how long `cls.name` takes while the block runs."""
    if timings is None:
        yield
        return
    method = getattr(cls, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            timings[name] = time.perf_counter() - started

    setattr(cls, name, wrapper)
    try:
        yield
    finally:
        setattr(cls, name, method)


def difftune_updates(trainer, updates: int) -> float:
    """Seconds per update of the real training loop for `updates` more updates."""
    trainer.plan = trainer.monitor.plan = replace(trainer.plan, total_updates=trainer.position.global_step + updates)
    started = time.perf_counter()
    trainer.train()
    finish_queued_work()
    return (time.perf_counter() - started) / updates


def finish_queued_work() -> None:
    """On a GPU the host runs ahead of the device: a figure is taken once the queued work is done."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bare_batches(trainer, count: int) -> list[tuple]:
    """(latents, text embeddings) of the trainer's own first batches, as the bare loop consumes them."""
    batches = []
    for index, batch in enumerate(trainer.data.dataloader):
        if index == count:
            break
        latents = trainer.objective.batch_latents(batch, None).detach()
        embeds = trainer.data.embeds_for(batch, 0).embeds.detach()
        batches.append((latents, embeds))
    return batches


def bare_updates(trainer, batches: list[tuple], optimizer, updates: int) -> float:
    """Seconds per update of a plain PyTorch loop: noise, timesteps, the UNet forward, MSE, backward, clip,
    optimizer step, on the same module and batches."""
    import torch

    unet = trainer.adapter.trainable_module()
    scheduler = trainer.adapter.scheduler
    started = time.perf_counter()
    for step in range(updates):
        latents, embeds = batches[step % len(batches)]
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
        prediction = unet(scheduler.add_noise(latents, noise, timesteps), timesteps, encoder_hidden_states=embeds).sample
        loss = torch.nn.functional.mse_loss(prediction.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainer.lora_params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finish_queued_work()
    return (time.perf_counter() - started) / updates


def overhead_ratio(trainer, rounds: int, updates: int) -> dict:
    """difftune vs bare, alternating rounds after one warm-up round of each."""
    import torch

    optimizer = torch.optim.AdamW(trainer.lora_params, lr=1e-4)
    batches = bare_batches(trainer, 8)
    difftune_updates(trainer, updates)
    bare_updates(trainer, batches, optimizer, updates)
    ours, bare = [], []
    for _ in range(rounds):
        ours.append(difftune_updates(trainer, updates))
        bare.append(bare_updates(trainer, batches, optimizer, updates))
    return {"difftune_s_per_update": statistics.median(ours), "bare_s_per_update": statistics.median(bare),
            "overhead_ratio": statistics.median(ours) / statistics.median(bare)}


def compiled_figures(rounds: int, updates: int, resolution: int, device: str, backend: str, eager: float) -> dict:
    """`train.compile` on the cached job: the first epoch (every bucket shape compiles once) and the steady
    seconds per update after it, against the eager figure measured earlier in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = ready_trainer(Path(tmp), True, device, resolution, compile_backend=backend)
        first_epoch = trainer.plan.updates_per_epoch
        compiling = difftune_updates(trainer, first_epoch) * first_epoch
        steady = statistics.median(difftune_updates(trainer, updates) for _ in range(rounds))
        close(trainer)
    return {"backend": backend, "first_epoch_s": compiling, "first_epoch_updates": first_epoch,
            "compiled_s_per_update": steady, "eager_s_per_update": eager, "speedup": eager / steady}


def data_loading(workers: int, seconds: float, resolution: int) -> float:
    """Images per second through the dataset (decode, bucket, crop) and the bucket sampler."""
    import torch

    from toolkit.config.schema import DatasetConfig
    from toolkit.data.buckets import BucketBatchSampler
    from toolkit.data.dataset import build_dataset, collate

    dataset = build_dataset([DatasetConfig(folder_path=str(QUICKSTART_DATA), resolution=[resolution],
                                           num_repeats=50)], "shp", 8)
    sampler = BucketBatchSampler(dataset.bucket_keys(), 4, 0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers)
    images, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for batch in loader:
            images += len(batch["indices"])
            if time.perf_counter() - started >= seconds:
                break
    return images / (time.perf_counter() - started)


def import_seconds(module: str = "jobs.process.base_sd_train_process") -> float:
    """A fresh interpreter importing the trainer (torch, diffusers, transformers, peft, accelerate)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def memory() -> dict:
    from toolkit.device import accelerator_memory, process_rss_bytes

    out = {"rss_mib": round((process_rss_bytes() or 0) / 2**20, 1)}
    if accelerator_memory():
        out["accelerator_peak_mib"] = round(accelerator_memory()["peak"] / 2**20, 1)
    return out


#: (rounds, updates per round, image side, seconds per data-loading figure)
QUICK, FULL = (3, 5, 64, 2.0), (7, 20, 96, 6.0)


def measure(rounds: int, updates: int, resolution: int, loading_seconds: float, device: str,
            compile_backend: str | None = None, fresh_processes: bool = True) -> dict:
    """Every figure; `fresh_processes` False leaves out the two that start new interpreters (imports, run.py's
    launch to its first update: about 25 s here), which the harness's tests check on their own."""
    results: dict = {"machine": machine(), "settings": {"rounds": rounds, "updates_per_round": updates,
                                                        "resolution": resolution, "device": device}}
    results["startup"] = ({"imports_s": import_seconds(), "launch_to_first_update_s": launch_to_first_update()}
                          if fresh_processes else {})
    with tempfile.TemporaryDirectory() as tmp:
        timings: dict = {}
        cached = ready_trainer(Path(tmp), True, device, resolution, timings)
        results["startup"] |= {"model_load_s": timings["load_model"], "caching_s": timings["build_caches"]}
        results["memory_after_setup"] = memory()
        results["overhead"] = overhead_ratio(cached, rounds, updates)
        results["memory_after_training"] = memory()
        close(cached)
        live = ready_trainer(Path(tmp) / "live", False, device, resolution)
        difftune_updates(live, updates)  # warm-up
        uncached = statistics.median(difftune_updates(live, updates) for _ in range(rounds))
        close(live)
        results["cache_speedup"] = {"uncached_s_per_update": uncached,
                                    "cached_s_per_update": results["overhead"]["difftune_s_per_update"],
                                    "speedup": uncached / results["overhead"]["difftune_s_per_update"]}
    if compile_backend:
        results["compile"] = compiled_figures(rounds, updates, resolution, device, compile_backend,
                                              results["overhead"]["difftune_s_per_update"])
    results["data_loading_images_per_s"] = {f"workers_{w}": data_loading(w, loading_seconds, resolution)
                                            for w in (0, 2)}
    return results


def close(trainer) -> None:
    trainer.close()


def launch_to_first_update(repo: Path = REPO, timeout: float = 600.0) -> float:
    """Seconds from starting `python run.py` on the quickstart job (one update, nothing saved or sampled on the
    way) until its first metrics line exists: imports, config, model, caches and the first update, as a user
    waits for them. Uses only the command line and the run folder, so it measures any checkout the same way."""
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        job = yaml.safe_load((repo / "config" / "examples" / "quickstart.yaml").read_text())
        process = job["config"]["process"][0]
        process["training_folder"] = str(Path(tmp) / "output")
        for dataset in process["datasets"]:
            dataset["folder_path"] = str(repo / dataset["folder_path"])
        process["train"] = {**process.get("train", {}), "steps": 1, "epochs": None}
        process["sample"] = {**process.get("sample", {}), "prompts": [], "sample_every": 0}
        process["save"] = {**process.get("save", {}), "save_every": 0}
        path = Path(tmp) / "first.yaml"
        path.write_text(yaml.safe_dump(job))
        metrics = Path(tmp) / "output" / job["config"]["name"] / "metrics.jsonl"
        started = time.perf_counter()
        child = subprocess.Popen([sys.executable, str(repo / "run.py"), str(path), "--quiet"], cwd=tmp,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            while not (metrics.is_file() and metrics.read_text().strip()):
                if child.poll() is not None and not metrics.is_file():
                    raise RuntimeError(f"the quickstart job ended without an update: {child.stderr.read()[-2000:]}")
                if time.perf_counter() - started > timeout:
                    raise TimeoutError("no first update within the time limit")
                time.sleep(0.02)
            return time.perf_counter() - started
        finally:
            child.wait(timeout=timeout)


def machine() -> dict:
    import os
    import platform

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d")}


def seconds(value: float | None, decimals: int) -> str:
    return "-" if value is None else f"{value:.{decimals}f}"


def table(results: dict) -> str:
    o, c, s = results["overhead"], results["cache_speedup"], results["startup"]
    rows = [
        ("difftune s/update (cached)", f"{o['difftune_s_per_update']:.4f}"),
        ("bare PyTorch s/update", f"{o['bare_s_per_update']:.4f}"),
        ("uncached s/update", f"{c['uncached_s_per_update']:.4f}"),
        ("cache speed-up", f"{c['speedup']:.2f}x"),
        ("start-up: imports / model load / caching", f"{seconds(s.get('imports_s'), 1)} / "
                                                     f"{seconds(s['model_load_s'], 2)} / {seconds(s['caching_s'], 2)} s"),
        ("run.py quickstart: launch to first update", f"{seconds(s.get('launch_to_first_update_s'), 1)} s"),
        *[(f"data loading, {k.replace('_', ' ')}", f"{v:.0f} images/s")
          for k, v in results["data_loading_images_per_s"].items()],
        ("RSS after setup / after training", f"{results['memory_after_setup']['rss_mib']:.0f} / "
                                             f"{results['memory_after_training']['rss_mib']:.0f} MiB"),
    ]
    if "compile" in results:
        k = results["compile"]
        rows += [(f"compiled ({k['backend']}) s/update", f"{k['compiled_s_per_update']:.4f} "
                                                         f"({k['speedup']:.2f}x eager)"),
                 ("compiled first epoch (compiling)", f"{k['first_epoch_s']:.1f} s for {k['first_epoch_updates']} updates")]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append(f"overhead ratio: {o['overhead_ratio']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer and shorter rounds (about a minute)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                        help="also measure train.compile (default backend inductor; its first compile on a CPU "
                             "takes minutes)")
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    results = measure(*(QUICK if args.quick else FULL), args.device, args.compile)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
