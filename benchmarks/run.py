"""difftune's speed and memory, measured side by side in one process so that a shared machine's noise cancels.

    python -m benchmarks.run            # about 6 minutes on a 2-core CPU
    python -m benchmarks.run --quick    # about 1.5 minutes: the same rounds, fewer of them
    python -m benchmarks.run --json out.json
    python -m benchmarks.run --plain-optimizer trainer   # the plain loops run the trainer's AdamW implementation

Figures (tiny SD model on the shipped quickstart images, 64 px, batch 1, rank-4 LoRA, fp32, a metrics line every
update, unless --device cuda says otherwise):
- overhead ratios: difftune's seconds per update over plain PyTorch loops doing the same work on the same modules
  and samples. Without caches (VAE and text encoder every step) against (a) a loop that reads, decodes, resizes,
  crops and tokenizes its samples every step, as the diffusers example script does, and (b) one that holds the
  decoded pixels and token ids in memory; with latent and text caches against (c) a loop over latents and
  embeddings held in memory. Every loop runs in its steady state: a round runs two epochs of difftune's loop, and
  after each of its updates every plain loop runs one (their order turns), so that the machine's drifts fall on
  all of them alike; each loop's first `warmup` updates of a round (its iterator, workers and progress bar
  starting) are left out. Each round gives one ratio per pair; the median over the rounds is the figure, with its
  spread (min/max and interquartile range, as % of the median). `--quick` runs the same rounds, fewer of them, so
  it estimates the same ratios. The plain loops build AdamW with torch's defaults, as the diffusers example script
  does; the trainer runs torch's fused AdamW where it can, so `--plain-optimizer trainer` gives the plain loops the
  same implementation, and the ratios then measure difftune's loop alone;
- loader wait: milliseconds per update the training loop spends blocked on the next batch, with 0 DataLoader
  workers and with `--workers` of them, and of the latter, the part before a worker had the batch ready (its
  stamp) rather than the hand-over after it;
- cache speed-up: seconds per update with the encoders live vs with latent and text-embedding caches;
- `train.on_nan: skip`'s cost: the cached loop's seconds per update with `skip` (one read of the device per update)
  over `stop` (no read beyond the logged updates'), their rounds alternated on one trainer; on a CPU, where nothing
  runs ahead of the host, it is near 1 by construction: the figure that matters is `--device cuda`'s;
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
QUICKSTART_DATA = REPO / "config" / "examples" / "quickstart_data"


@dataclass(frozen=True)
class Settings:
    """How long the harness measures. Quick and full differ in the number of rounds only: a round is the same
    unit in both, so a quick run estimates the same ratios with a wider spread."""

    rounds: int
    #: updates at the start of each round of each loop that are not timed (iterator, workers, progress bar)
    warmup: int = 4
    #: epochs of each loop per round: an epoch boundary falls inside the timed updates
    epochs_per_round: int = 2
    resolution: int = 64
    batch_size: int = 1
    #: the quickstart's 8 images twice: 16 updates an epoch at batch 1
    repeats: int = 2
    #: seconds per data-loading figure
    loading_seconds: float = 6.0
    #: DataLoader workers of the second uncached difftune loop (its loader wait against 0 workers)
    workers: int = 1
    #: the plain loops' AdamW: "torch" (torch's defaults, as the diffusers example script builds it) or "trainer"
    #: (the implementation the trainer's AdamW runs, fused or not: the ratio is then difftune's loop alone)
    plain_optimizer: str = "torch"


QUICK = Settings(rounds=7, loading_seconds=2.0)
#: 63 rounds: the median of the rounds' ratios then has a standard error near 0.3 % on the 2-core machine (21 rounds:
#: about 0.5 %, a quarter of the 2 % the cached loop is held to; docs/performance.md)
FULL = Settings(rounds=63)


def trainer_config(folder: Path, cached: bool, device: str, settings: Settings,
                   compile_backend: str | None = None) -> dict:
    return {
        "type": "sd_trainer", "training_folder": str(folder), "device": device, "trigger_word": "shp",
        "network": {"linear": 4, "linear_alpha": 4},
        "save": {"save_every": 0, "formats": ["diffusers"]},
        "datasets": [{"folder_path": str(QUICKSTART_DATA), "resolution": [settings.resolution],
                      "num_repeats": settings.repeats, "cache_latents": cached, "cache_dir": str(folder / "cache")}],
        "train": {"batch_size": settings.batch_size, "steps": 100000, "lr": 1e-4, "dtype": "fp32",
                  "cache_text_embeddings": cached, "num_workers": 0,
                  "compile": compile_backend is not None, "compile_backend": compile_backend or "inductor"},
        "model": {"arch": "sd15", "name_or_path": "tiny"},
        "logging": {"log_every": 1},
    }


def ready_trainer(folder: Path, cached: bool, device: str, settings: Settings, timings: dict | None = None,
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
    body = {"name": name, "process": [trainer_config(folder, cached, device, settings, compile_backend)]}
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


def finish_queued_work() -> None:
    """On a GPU the host runs ahead of the device: a time is taken once the queued work is done."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- one round of a loop -----------------------------------------------------------------------------


@dataclass
class Round:
    """One round of one loop: how long each update took (its own code only, not the other loops' updates run
    in between) and how long it waited for its batch."""

    durations: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    #: of each wait, the part before a loader worker had the batch ready (its stamp: `ready_stamped`); the whole
    #: wait where the loop makes its batches itself. The rest of a wait is the batch's hand-over.
    not_ready: list[float] = field(default_factory=list)
    #: difftune's update numbers (for its own metrics lines)
    steps: list[int] = field(default_factory=list)

    def steady(self, warmup: int) -> tuple[float, float]:
        """(seconds per update, seconds waited for data per update) over the updates after the first `warmup`."""
        timed = len(self.durations) - warmup
        if timed < 1:
            raise ValueError(f"a round of {len(self.durations)} updates has none after its {warmup} warm-up updates")
        return sum(self.durations[warmup:]) / timed, sum(self.waits[warmup:]) / timed

    def not_ready_per_update(self, warmup: int) -> float:
        """Seconds per update waited for batches not yet made (after the first `warmup` updates)."""
        return sum(self.not_ready[warmup:]) / (len(self.durations) - warmup)  # per update, as `steady` counts


class DifftuneLoop:
    """difftune's own training loop (`trainer.train()`), run for a number of updates at a time with `loader` (the
    trainer's DataLoader by default; each round is a pass of it, from the round's first epoch). Each update's end is
    stamped from the monitor; `between` (other loops' updates) runs there, and the clock restarts after it. The time
    the loop spends blocked on its next batch is recorded per micro-batch. Several loops may share a trainer (other
    loaders): each round stamps the trainer's own methods for its loop alone."""

    #: the trainer attribute that keeps its methods as they were before any loop stamped them
    UNSTAMPED = "benchmark_unstamped"

    def __init__(self, trainer, loader=None):
        self.trainer = trainer
        self.loader = loader if loader is not None else trainer.data.dataloader
        self.current = Round()
        self.between: Callable[[], None] = lambda: None
        self.resumed = 0.0
        if not hasattr(trainer, self.UNSTAMPED):
            setattr(trainer, self.UNSTAMPED, (trainer.monitor.after_update, trainer.data.epoch_batches))

    def install_stamps(self) -> None:
        """This loop's stamps on the trainer's own methods (replacing another loop's)."""
        trainer = self.trainer
        after_update, epoch_batches = getattr(trainer, self.UNSTAMPED)

        def stamped_update(update, *args, **kwargs):
            read = after_update(update, *args, **kwargs)
            finish_queued_work()
            self.current.durations.append(time.perf_counter() - self.resumed)
            self.current.steps.append(update.step)
            self.between()
            self.resumed = time.perf_counter()
            return read

        def waited_batches(*args, **kwargs):
            return timed_batches(epoch_batches(*args, **kwargs), self.current)

        trainer.monitor.after_update = stamped_update
        trainer.data.epoch_batches = waited_batches

    def round(self, updates: int, between: Callable[[], None] | None = None) -> Round:
        trainer = self.trainer
        # from where the last round stopped (after an epoch's last micro-batch: the trainer goes on to the next)
        trainer.data.dataloader = self.loader
        self.current, self.between = Round(), between or (lambda: None)
        self.install_stamps()
        trainer.plan = trainer.monitor.plan = trainer.plan.ending_at(trainer.position.global_step + updates)
        self.resumed = time.perf_counter()
        trainer.train()
        return self.current


def timed_batches(batches: Iterator, into: Round) -> Iterator:
    """The batches of an iterator, with the time each took to come recorded in `into.waits` (one per micro-batch;
    at batch 1 without accumulation, one per update)."""
    while True:
        began, asked = time.perf_counter(), time.monotonic()
        try:
            batch = next(batches)
        except StopIteration:
            return
        waited = time.perf_counter() - began
        into.waits.append(waited)
        ready_at = batch[1].get(READY_AT)
        into.not_ready.append(waited if ready_at is None else min(waited, max(0.0, ready_at - asked)))
        yield batch


#: the batch key of `ready_stamped`'s stamp
READY_AT = "benchmark_ready_at"


def ready_stamped(samples: list[dict]) -> dict:
    """The trainer's collate in a loader worker, its batch stamped with when it was ready (`time.monotonic`: one
    clock for every process of the machine), so that a wait can be told apart from the hand-over after it."""
    from toolkit.data.handover import collate_in_worker

    batch = collate_in_worker(samples)
    batch[READY_AT] = time.monotonic()
    return batch


def difftune_updates(trainer, updates: int) -> float:
    """Seconds per update of the real training loop for `updates` more updates, start-up included."""
    trainer.plan = trainer.monitor.plan = trainer.plan.ending_at(trainer.position.global_step + updates)
    started = time.perf_counter()
    trainer.train()
    finish_queued_work()
    return (time.perf_counter() - started) / updates


# ---- the plain loops ------------------------------------------------------------------------------------


class PlainFiles:
    """The trainer's samples (the same files, the same captions) as a plain PyTorch dataset that reads, decodes,
    resizes to cover, centre-crops and tokenizes a sample each time it is asked for one, as the diffusers example
    script does: (pixels [3, H, W] in [-1, 1], token ids [77])."""

    def __init__(self, trainer):
        self.items = [(item.record.path, item.record.caption, item.bucket) for item in trainer.data.dataset.items]
        self.tokenizer = trainer.adapter.tokenizer

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        import numpy as np
        import torch
        from PIL import Image

        path, caption, (width, height) = self.items[index]
        with Image.open(path) as opened:
            image = opened.convert("RGB")
        scale = max(width / image.width, height / image.height)
        resized = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
        left, top = (resized[0] - width) // 2, (resized[1] - height) // 2
        image = image.resize(resized, Image.Resampling.BICUBIC).crop((left, top, left + width, top + height))
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1.0
        ids = self.tokenizer(caption, max_length=self.tokenizer.model_max_length, padding="max_length",
                             truncation=True, return_tensors="pt").input_ids[0]
        return pixels, ids


class PlainLoop:
    """A plain PyTorch training loop over the trainer's modules: encode (unless given latents and embeddings),
    noise, timesteps, the UNet forward, MSE, backward, clip, AdamW and LR-schedule step, and the loss read back
    each update (as the diffusers example script shows it on its progress bar). `batches` yields the
    (pixels, token ids) or (latents, embeddings) of each update, forever; `encoded` says which."""

    def __init__(self, trainer, batches: Iterator[tuple], encoded: bool, optimizer_options: dict | None = None):
        import torch

        self.trainer, self.batches, self.encoded = trainer, batches, encoded
        adapter = trainer.adapter
        self.unet, self.vae, self.text_encoder = adapter.unet, adapter.vae, adapter.text_encoder
        self.scheduler = adapter.scheduler
        self.device = trainer.accelerator.device
        self.params = trainer.lora_params
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, **(optimizer_options or {}))
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        self.current = Round()

    def update(self) -> None:
        """One update, its time and wait added to the current round."""
        began = time.perf_counter()
        batch = next(self.batches)
        self.current.waits.append(time.perf_counter() - began)
        self.step(*batch)
        finish_queued_work()
        self.current.durations.append(time.perf_counter() - began)

    def start_round(self) -> Round:
        self.current = Round()
        return self.current

    def step(self, first, second) -> float:
        import torch

        device = self.device
        with torch.no_grad():
            if self.encoded:
                latents, embeds = first.to(device), second.to(device)
            else:
                posterior = self.vae.encode(first.to(device)).latent_dist
                latents = posterior.sample() * self.vae.config.scaling_factor
                embeds = self.text_encoder(second.to(device))[0]
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, self.scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        prediction = self.unet(noisy, timesteps, encoder_hidden_states=embeds).sample
        loss = torch.nn.functional.mse_loss(prediction.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def plain_optimizer_options(trainer, settings: Settings) -> dict:
    """The plain loops' AdamW keyword arguments: none (torch's defaults: on a CPU its per-parameter step, on a GPU
    foreach), or with `plain_optimizer: trainer` the implementation flags of the trainer's own AdamW."""
    if settings.plain_optimizer == "torch":
        return {}
    group = trainer.optimizer.param_groups[0]
    return {key: group[key] for key in ("fused", "foreach") if key in group}


def files_every_step(trainer, batch_size: int, workers: int = 0) -> Iterator[tuple]:
    """Plain loop (a)'s batches: a shuffling DataLoader over `PlainFiles`, epoch after epoch."""
    import torch

    loader = torch.utils.data.DataLoader(PlainFiles(trainer), batch_size=batch_size, shuffle=True,
                                         num_workers=workers, persistent_workers=workers > 0)
    while True:
        yield from loader


def held_in_memory(samples: list[tuple], batch_size: int) -> Iterator[tuple]:
    """Plain loops (b) and (c): samples held in memory, shuffled each epoch and stacked into batches."""
    import torch

    while True:
        order = torch.randperm(len(samples)).tolist()
        for first in range(0, len(order), batch_size):
            chosen = [samples[i] for i in order[first:first + batch_size]]
            yield tuple(torch.stack(part) for part in zip(*chosen))


def decoded_samples(trainer) -> list[tuple]:
    """Every sample decoded and tokenized once: plain loop (b)'s memory."""
    files = PlainFiles(trainer)
    return [files[i] for i in range(len(files))]


def encoded_samples(trainer) -> list[tuple]:
    """Every sample as a latent (one posterior draw) and its caption's embeddings: plain loop (c)'s memory."""
    import torch

    vae, text_encoder = trainer.adapter.vae, trainer.adapter.text_encoder
    on = {module: next(module.parameters()).device for module in (vae, text_encoder)}  # wherever caching left them
    samples = []
    with torch.no_grad():
        for pixels, ids in decoded_samples(trainer):
            latents = vae.encode(pixels[None].to(on[vae])).latent_dist.sample()[0] * vae.config.scaling_factor
            samples.append((latents, text_encoder(ids[None].to(on[text_encoder]))[0][0]))
    return samples


# ---- rounds and ratios ------------------------------------------------------------------------------------


def interleaved(ours: DifftuneLoop, plain: dict[str, PlainLoop], rounds: int, updates: int,
                warmup: int) -> dict[str, list[tuple]]:
    """Each loop's (s/update, wait/update) per round. In a round difftune's loop runs `updates` updates and after
    each of them every plain loop runs one (their order turned each update), so that the machine's drifts (a
    shared host's neighbours, clock changes) fall on all of them alike; each update's time is its own code's."""
    names = list(plain)
    results: dict[str, list[tuple]] = {name: [] for name in ["difftune", *names]}
    for _ in range(rounds):
        turn = iter(range(10**9))

        def between() -> None:
            first = next(turn) % len(names)
            for name in names[first:] + names[:first]:
                plain[name].update()

        current = {name: plain[name].start_round() for name in names}
        results["difftune"].append(ours.round(updates, between).steady(warmup))
        for name in names:
            results[name].append(current[name].steady(warmup))
    return results


def alternated(loops: dict[str, DifftuneLoop], rounds: int, updates: int, warmup: int) -> dict[str, list[tuple]]:
    """Each difftune loop's (s/update, wait/update) per round, the loops running their rounds one after the other
    (their order turned each round): for loops that must not share the machine update by update (a loader's
    workers would work while the other loop runs)."""
    names = list(loops)
    results: dict[str, list[tuple]] = {name: [] for name in names}
    for number in range(rounds):
        first = number % len(names)
        for name in names[first:] + names[:first]:
            done = loops[name].round(updates)
            results[name].append((*done.steady(warmup), done.not_ready_per_update(warmup)))
    return results


def spread(values: list[float]) -> dict:
    """The median of `values` and how far they spread: min, max, and the interquartile range as % of the median."""
    median = statistics.median(values)
    low, high = (statistics.quantiles(values, n=4, method="inclusive")[i] for i in (0, 2)) \
        if len(values) > 1 else (values[0], values[0])
    return {"median": median, "min": min(values), "max": max(values), "iqr_pct": 100 * (high - low) / median,
            "range_pct": 100 * (max(values) - min(values)) / median, "rounds": len(values)}


def ratio(ours: list[tuple], plain: list[tuple]) -> dict:
    """difftune over another loop: the ratio of each round (measured side by side), its median and spread."""
    return spread([a[0] / b[0] for a, b in zip(ours, plain, strict=True)])


def loop_figures(rounds: list[tuple]) -> dict:
    """A loop's median seconds per update and its loader wait per update (ms) over the rounds."""
    figures = {"s_per_update": statistics.median(r[0] for r in rounds),
               "wait_ms_per_update": 1000 * statistics.median(r[1] for r in rounds)}
    if all(len(r) > 2 for r in rounds):  # (alternated) of it, waited for batches not yet made
        figures["not_ready_ms_per_update"] = 1000 * statistics.median(r[2] for r in rounds)
    return figures


def updates_per_round(trainer, settings: Settings) -> int:
    return trainer.plan.updates_per_epoch * settings.epochs_per_round


def uncached_figures(trainer, settings: Settings) -> dict:
    """difftune without caches against plain loops (a) and (b), update by update; then its loader wait with 0 and
    `settings.workers` workers, round by round."""
    ours, options = DifftuneLoop(trainer), plain_optimizer_options(trainer, settings)
    plain = {"plain_files": PlainLoop(trainer, files_every_step(trainer, settings.batch_size), encoded=False,
                                      optimizer_options=options),
             "plain_memory": PlainLoop(trainer, held_in_memory(decoded_samples(trainer), settings.batch_size),
                                       encoded=False, optimizer_options=options)}
    updates = updates_per_round(trainer, settings)
    rounds = interleaved(ours, plain, settings.rounds, updates, settings.warmup)
    acc = trainer.accelerator
    with_workers = trainer.data.make_dataloader(pin_memory=acc.device.type == "cuda", workers=settings.workers,
                                                num_processes=acc.num_processes, rank=acc.process_index)
    if settings.workers > 0:
        with_workers.collate_fn = ready_stamped
    loaders = {"workers_0": ours, f"workers_{settings.workers}": DifftuneLoop(trainer, with_workers)}
    waits = alternated(loaders, max(1, settings.rounds // 3), updates, settings.warmup)
    return {
        "updates_per_round": updates, "warmup": settings.warmup,
        "loops": {name: loop_figures(r) for name, r in rounds.items()},
        "vs_plain_files": ratio(rounds["difftune"], rounds["plain_files"]),
        "vs_plain_memory": ratio(rounds["difftune"], rounds["plain_memory"]),
        "loader": {name: loop_figures(r) for name, r in waits.items()},
        "workers": settings.workers,
        "workers_vs_none": ratio(waits[f"workers_{settings.workers}"], waits["workers_0"]),
        # its last round ran alone: difftune's own `time` should match the harness's clock there
        "own_metrics_time_s": own_time(trainer, ours, settings.warmup),
    }


def cached_figures(trainer, settings: Settings) -> dict:
    """difftune with latent and text caches against plain loop (c), update by update."""
    ours = DifftuneLoop(trainer)
    plain = {"plain_encoded": PlainLoop(trainer, held_in_memory(encoded_samples(trainer), settings.batch_size),
                                        encoded=True, optimizer_options=plain_optimizer_options(trainer, settings))}
    updates = updates_per_round(trainer, settings)
    rounds = interleaved(ours, plain, settings.rounds, updates, settings.warmup)
    return {"updates_per_round": updates, "warmup": settings.warmup,
            "loops": {name: loop_figures(r) for name, r in rounds.items()},
            "vs_plain_encoded": ratio(rounds["difftune"], rounds["plain_encoded"])}


def nan_skip_figures(trainer, settings: Settings) -> dict:
    """`train.on_nan: skip` over `stop` on the cached loop: rounds of each in turn on the same trainer (the watch is
    built from the config at the start of each round), with metrics lines only at a round's end: a logged update
    reads the device in either mode, so a line every update would hide what skip adds."""
    loop, updates = DifftuneLoop(trainer), updates_per_round(trainer, settings)
    results: dict[str, list[tuple]] = {"stop": [], "skip": []}
    logging_cfg, every = trainer.monitor.cfg, trainer.monitor.cfg.log_every
    object.__setattr__(logging_cfg, "log_every", 10**9)
    try:
        for number in range(max(2, settings.rounds // 3)):
            for mode in (("stop", "skip") if number % 2 == 0 else ("skip", "stop")):
                object.__setattr__(trainer.config.train, "on_nan", mode)
                results[mode].append(loop.round(updates).steady(settings.warmup))
    finally:
        object.__setattr__(trainer.config.train, "on_nan", "stop")
        object.__setattr__(logging_cfg, "log_every", every)
    return {"loops": {mode: loop_figures(r) for mode, r in results.items()},
            "skip_vs_stop": ratio(results["skip"], results["stop"])}


def own_time(trainer, loop: DifftuneLoop, warmup: int) -> dict | None:
    """difftune's own metrics.jsonl `time` (mean) over the timed updates of the loop's last round, beside the
    harness's clock for them: they agree when the harness measures what a run reports (a round that ran alone)."""
    from toolkit.run.metrics import read_metrics

    steps = set(loop.current.steps[warmup:])
    trainer.monitor.metrics.drain()  # lines are written by a thread of their own: all of them in the file first
    path = trainer.folder.metrics
    if not path.is_file() or not steps:
        return None
    times = [r["time"] for r in read_metrics(path) if r.get("step") in steps and "time" in r]
    harness = loop.current.durations[warmup:]
    return {"metrics": statistics.mean(times), "harness": statistics.mean(harness)} if times else None


def compiled_figures(settings: Settings, device: str, backend: str, eager: float) -> dict:
    """`train.compile` on the cached job: the first epoch (every bucket shape compiles once) and the steady
    seconds per update after it, against the eager figure measured earlier in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = ready_trainer(Path(tmp), True, device, settings, compile_backend=backend)
        first_epoch = trainer.plan.updates_per_epoch
        compiling = difftune_updates(trainer, first_epoch) * first_epoch
        loop = DifftuneLoop(trainer)
        updates = updates_per_round(trainer, settings)
        steady = statistics.median(loop.round(updates).steady(settings.warmup)[0]
                                   for _ in range(max(1, settings.rounds // 3)))
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


def measure(settings: Settings, device: str, compile_backend: str | None = None,
            fresh_processes: bool = True) -> dict:
    """Every figure; `fresh_processes` False leaves out the two that start new interpreters (imports, run.py's
    launch to its first update: about 25 s here), which the harness's tests check on their own."""
    results: dict = {"machine": machine(), "settings": {**settings.__dict__, "device": device}}
    results["startup"] = ({"imports_s": import_seconds(), "launch_to_first_update_s": launch_to_first_update()}
                          if fresh_processes else {})
    with progress_bars_off(), tempfile.TemporaryDirectory() as tmp:
        timings: dict = {}
        cached = ready_trainer(Path(tmp), True, device, settings, timings)
        results["startup"] |= {"model_load_s": timings["load_model"], "caching_s": timings["build_caches"]}
        results["memory_after_setup"] = memory()
        results["cached"] = cached_figures(cached, settings)
        results["on_nan_skip"] = nan_skip_figures(cached, settings)
        results["memory_after_training"] = memory()
        close(cached)
        live = ready_trainer(Path(tmp) / "live", False, device, settings)
        results["uncached"] = uncached_figures(live, settings)
        close(live)
    ours = {kind: results[kind]["loops"]["difftune"]["s_per_update"] for kind in ("cached", "uncached")}
    results["cache_speedup"] = {"uncached_s_per_update": ours["uncached"], "cached_s_per_update": ours["cached"],
                                "speedup": ours["uncached"] / ours["cached"]}
    if compile_backend:
        with progress_bars_off():
            results["compile"] = compiled_figures(settings, device, compile_backend, ours["cached"])
    results["data_loading_images_per_s"] = {f"workers_{w}": data_loading(w, settings.loading_seconds,
                                                                         settings.resolution) for w in (0, 2)}
    return results


@contextmanager
def progress_bars_off():
    """Dozens of rounds would each draw a progress bar: the figures leave the bar out (a counter per update, redrawn
    at most 10 times a second, and the losses it shows read at most once a second)."""
    import os

    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = before


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
            "torch_threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d")}


def seconds(value: float | None, decimals: int) -> str:
    return "-" if value is None else f"{value:.{decimals}f}"


def ratio_text(figure: dict) -> str:
    return (f"{figure['median']:.3f} (min {figure['min']:.3f}, max {figure['max']:.3f}, IQR {figure['iqr_pct']:.1f} %, "
            f"{figure['rounds']} rounds)")


def table(results: dict) -> str:
    u, c, s = results["uncached"], results["cached"], results["startup"]
    loops = {**{f"uncached, {k}": v for k, v in u["loops"].items()}, **{f"cached, {k}": v for k, v in c["loops"].items()},
             **{f"uncached alone, difftune {k}": v for k, v in u["loader"].items()}}
    rows = [(f"{name.replace('_', ' ')}: s/update (wait ms)", f"{v['s_per_update']:.4f} ({v['wait_ms_per_update']:.2f})")
            for name, v in loops.items()]
    rows += [(f"uncached alone, difftune {name.replace('_', ' ')}: wait for batches not yet made",
              f"{v['not_ready_ms_per_update']:.2f} of {v['wait_ms_per_update']:.2f} ms/update")
             for name, v in u["loader"].items() if name != "workers_0" and "not_ready_ms_per_update" in v]
    own = u["own_metrics_time_s"]
    rows += [
        ("difftune's own metrics `time` vs harness clock", "-" if own is None else
         f"{own['metrics']:.4f} vs {own['harness']:.4f} s/update"),
        ("plain loops' AdamW", "the trainer's implementation"
         if results["settings"].get("plain_optimizer") == "trainer" else "torch's defaults"),
        ("cache speed-up", f"{results['cache_speedup']['speedup']:.2f}x"),
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
    lines += [
        f"{u['workers']} worker(s) vs none, difftune uncached: {ratio_text(u['workers_vs_none'])}",
        f"uncached vs plain (a), files every step: {ratio_text(u['vs_plain_files'])}",
        f"uncached vs plain (b), pixels and ids in memory: {ratio_text(u['vs_plain_memory'])}",
        f"cached vs plain (c), latents and embeddings in memory: {ratio_text(c['vs_plain_encoded'])}",
        f"train.on_nan skip vs stop, cached: {ratio_text(results['on_nan_skip']['skip_vs_stop'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.rounds} rounds instead of {FULL.rounds}")
    parser.add_argument("--rounds", type=int, help="the number of rounds (overrides --quick)")
    parser.add_argument("--workers", type=int, help=f"DataLoader workers of the loader-wait figure (default "
                                                    f"{FULL.workers})")
    parser.add_argument("--plain-optimizer", choices=["torch", "trainer"],
                        help="the plain loops' AdamW: torch's defaults, as the diffusers example script builds it "
                             "(default), or the implementation the trainer's AdamW runs (fused where it can): the "
                             "ratios are then difftune's loop alone")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                        help="also measure train.compile (default backend inductor; its first compile on a CPU "
                             "takes minutes)")
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    settings = QUICK if args.quick else FULL
    if args.rounds:
        settings = replace(settings, rounds=args.rounds)
    if args.workers is not None:
        settings = replace(settings, workers=args.workers)
    if args.plain_optimizer:
        settings = replace(settings, plain_optimizer=args.plain_optimizer)
    results = measure(settings, args.device, args.compile)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
