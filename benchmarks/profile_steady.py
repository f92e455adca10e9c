"""Where an update's time goes: difftune's steady state against a plain loop, part by part, in one process.

    python -m benchmarks.profile_steady             # without caches, against plain loop (b) of benchmarks.run
    python -m benchmarks.profile_steady --cached    # with latent and text caches, against plain loop (c)
    python -m benchmarks.profile_steady --cprofile  # also cProfile's top functions of difftune's loop

Each part of the training loop (the batch wait, text and image encoding, the objective, backward, the optimizer
update, the monitor, the control check) and of the plain loop is timed where it is called, in milliseconds per
update; the two loops alternate update by update (benchmarks.run.interleaved), so both parts of a row are measured
under the same conditions. A part of difftune without a plain counterpart is host-side work the plain loop does
not do. Timing a part adds about a microsecond to it; the totals are the harness's own clock.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import logging
import pstats
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import run as harness  # noqa: E402


class PartTimes:
    """Seconds per named part, added up into whichever loop's table is current."""

    def __init__(self):
        self.tables: dict[str, dict[str, float]] = {"difftune": {}, "plain": {}}
        self.current = self.tables["difftune"]

    def wrap(self, owner, name: str, label: str) -> None:
        """Time `owner.name` (an instance's method, or a module's function) as `label`; skipped where it is missing
        (another version of the code)."""
        original = getattr(owner, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                table = self.current
                table[label] = table.get(label, 0.0) + time.perf_counter() - began

        setattr(owner, name, timed)

    def plain_update(self, plain) -> None:
        """One update of the plain loop, its parts timed into its own table."""
        self.current = self.tables["plain"]
        try:
            plain.update()
        finally:
            self.current = self.tables["difftune"]


def instrument(trainer, plain, times: PartTimes) -> None:
    """The parts worth telling apart, on both loops (shared modules are timed in whichever loop calls them)."""
    import torch

    adapter, data, monitor = trainer.adapter, trainer.data, trainer.monitor
    shared = [(adapter.unet, "forward", "UNet forward"), (torch.Tensor, "backward", "backward (autograd)"),
              (adapter.vae, "encode", "VAE encode"), (adapter.text_encoder, "forward", "text encoder forward"),
              (type(adapter.tokenizer), "__call__", "tokenizer")]
    ours = [
        (data, "embeds_for", "captions + text encoding"), (adapter, "encode_prompts", "  encode_prompts"),
        (trainer.objective, "batch_latents", "latents (VAE + posterior draw)"),
        (trainer.objective, "loss", "objective.loss"), (trainer.objective, "predict", "  prediction"),
        (trainer, "backward", "trainer.backward"), (trainer.accelerator, "backward", "accelerator.backward"),
        (trainer, "optimizer_update", "optimizer_update"), (trainer.accelerator, "clip_grad_norm_", "  clip"),
        (getattr(trainer, "stepper", trainer.optimizer), "step", "  optimizer step"),
        (getattr(trainer, "stepper", trainer.optimizer), "zero_grad", "  zero_grad"),
        (monitor, "after_update", "monitor.after_update"), (monitor, "log_record", "  metrics line"),
        (monitor.status, "heartbeat", "  status heartbeat"), (monitor, "decide", "control check (decide)"),
    ]
    # torch's clipping: the plain loop's, and difftune's where it calls it (accelerate's own, before, does not)
    mine = [(plain.optimizer, "step", "  optimizer step"), (plain.optimizer, "zero_grad", "  zero_grad"),
            (torch.nn.utils, "clip_grad_norm_", "  clip")]
    for owner, name, label in shared + ours + mine:
        times.wrap(owner, name, label)


def measure(cached: bool, updates: int, rounds: int, profile: bool) -> tuple[dict, dict, str]:
    """Per-update milliseconds of each part of both loops (the median round), and cProfile's text if asked."""
    settings = replace(harness.FULL, rounds=rounds)
    with harness.progress_bars_off(), tempfile.TemporaryDirectory() as tmp:
        trainer = harness.ready_trainer(Path(tmp), cached, "cpu", settings)
        samples = harness.encoded_samples(trainer) if cached else harness.decoded_samples(trainer)
        plain = harness.PlainLoop(trainer, harness.held_in_memory(samples, settings.batch_size), encoded=cached)
        times = PartTimes()
        instrument(trainer, plain, times)
        ours = harness.DifftuneLoop(trainer)
        ours.round(harness.updates_per_round(trainer, settings), lambda: times.plain_update(plain))  # warm-up
        results = []
        for _ in range(rounds):
            times.tables = {"difftune": {}, "plain": {}}
            times.current = times.tables["difftune"]
            plain.start_round()
            done = ours.round(updates, lambda: times.plain_update(plain))
            tables = {name: {k: 1000 * v / updates for k, v in t.items()} for name, t in times.tables.items()}
            tables["difftune"]["total (harness clock)"] = 1000 * sum(done.durations) / updates
            tables["difftune"]["batch wait"] = 1000 * sum(done.waits) / updates
            tables["plain"]["total (harness clock)"] = 1000 * sum(plain.current.durations) / updates
            tables["plain"]["batch wait"] = 1000 * sum(plain.current.waits) / updates
            results.append(tables)
        text = ""
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            ours.round(updates)
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
            text = out.getvalue()
        trainer.close()
    middle = sorted(results, key=lambda r: r["difftune"]["total (harness clock)"])[len(results) // 2]
    return middle["difftune"], middle["plain"], text


#: parts made of other parts (an indented row is inside the row above it): no extra of their own is shown
COMPOSITE = {"captions + text encoding", "  encode_prompts", "latents (VAE + posterior draw)", "objective.loss",
             "  prediction", "trainer.backward", "accelerator.backward", "optimizer_update", "monitor.after_update"}


def table(ours: dict, plain: dict) -> str:
    """One row per part: difftune's and the plain loop's ms/update, and difftune's extra (its part, less the plain
    loop's where it has one)."""
    labels = list(dict.fromkeys([*ours, *plain]))
    order = ["total (harness clock)", "batch wait"]
    labels = order + [label for label in labels if label not in order]
    lines = [f"{'part (ms/update)':<34}{'difftune':>10}{'plain':>10}{'extra':>10}"]
    for label in labels:
        a, b = ours.get(label), plain.get(label)
        extra = "" if label in COMPOSITE else f"{(a or 0.0) - (b or 0.0):.3f}"
        lines.append(f"{label:<34}{'-' if a is None else f'{a:.3f}':>10}{'-' if b is None else f'{b:.3f}':>10}"
                     f"{extra:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cached", action="store_true", help="latent and text caches (against plain loop (c))")
    parser.add_argument("--updates", type=int, default=160, help="updates of each loop per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (the median one is shown)")
    parser.add_argument("--cprofile", action="store_true", help="also cProfile's top functions of difftune's loop")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ours, plain, text = measure(args.cached, args.updates, args.rounds, args.cprofile)
    print(table(ours, plain))
    if text:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
