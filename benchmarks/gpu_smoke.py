"""Smoke run of every family's tiny example job on a CUDA machine, in bf16 and in fp16:

    python -m benchmarks.gpu_smoke                                  # every family, bf16 and fp16, on cuda
    python -m benchmarks.gpu_smoke --families sd15,flux --precisions fp16 --steps 5 --keep /tmp/smoke
    python -m benchmarks.gpu_smoke --device cpu --families sd15     # a self-check of the script itself

The examples are config/examples/quickstart.yaml and every config/examples/*tiny*.yaml. Each runs as written
(its quantize, low_vram and cache settings kept), but with `model.dtype` and `train.dtype` both set to the
precision, `device` set, a few updates, a checkpoint and samples every 2 updates (and before the first), a
validation split, an EMA, its run folder and caches in a temporary folder and its dataset paths made absolute.
Every job runs through the real command (`python run.py JOB.yaml`), a subprocess each, so one crash does not
stop the rest.

One table row per job: status (ok, failed, refused at config time, timed out), seconds, the final loss,
whether every loss in metrics.jsonl is finite, the sample files written, the peak accelerator memory the
metrics lines recorded, and the error line of a failure or refusal. Exits 1 if any job failed, timed out or
wrote a non-finite loss (config-time refusals are reported, not failures); 2 when CUDA is asked for and
missing.

Needs no network: the tiny models are built offline (in the difftune cache).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "config" / "examples"
SAMPLE_SUFFIXES = {".png", ".jpg", ".webp", ".mp4"}
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:.*)?$")


def examples() -> dict[str, Path]:
    """Each family's tiny example job, by `model.arch`: quickstart.yaml, then every *tiny*.yaml."""
    found: dict[str, Path] = {}
    for path in [EXAMPLES / "quickstart.yaml", *sorted(EXAMPLES.glob("*tiny*.yaml"))]:
        process = yaml.safe_load(path.read_text())["config"]["process"][0]
        found.setdefault(process["model"]["arch"], path)
    return found


def shortened(example: Path, precision: str, device: str, steps: int, folder: Path) -> Path:
    """`example` as a short job in `folder` (its run folder and caches in there too); the job file's path."""
    job = yaml.safe_load(example.read_text())
    for process in job["config"]["process"]:
        process["device"] = device
        process["training_folder"] = str(folder / "output")
        process["model"]["dtype"] = precision
        process["train"].update(dtype=precision, steps=steps, ema={"decay": 0.9})
        process["save"] = {**process.get("save", {}), "save_every": 2}
        process.setdefault("sample", {}).update(sample_every=2, sample_at_start=True, sample_steps=2)
        process["validation"] = {"split": 0.25, "every": 2, "batch_size": 2}
        for dataset in process["datasets"]:
            dataset["folder_path"] = str((REPO / dataset["folder_path"]).resolve())
            dataset.setdefault("cache_dir", str(folder / "cache" / Path(dataset["folder_path"]).name))
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@dataclass
class Outcome:
    family: str
    precision: str
    status: str  # ok / failed / refused / timed out
    seconds: float
    final_loss: float | None = None
    finite: bool | None = None  # None: no loss was written
    samples: int = 0
    peak_mib: float | None = None
    error: str = ""

    @property
    def bad(self) -> bool:
        return self.status in ("failed", "timed out") or self.finite is False

    def row(self) -> str:
        loss = "" if self.final_loss is None else f"{self.final_loss:.5g}"
        finite = {None: "-", True: "yes", False: "NO"}[self.finite]
        peak = "" if self.peak_mib is None else f"{self.peak_mib:.0f}"
        return (f"{self.family:11s} {self.precision:5s} {self.status:10s} {self.seconds:7.1f} {loss:>9s} "
                f"{finite:>6s} {self.samples:7d} {peak:>9s}  {self.error}")


HEADER = (f"{'family':11s} {'prec':5s} {'status':10s} {'s':>7s} {'loss':>9s} {'finite':>6s} {'samples':>7s} "
          f"{'peak MiB':>9s}  error")


def error_line(log: str, first: bool) -> str:
    """A refusal's config error, its first line (`first`); else a failure's last exception (or ERROR) line."""
    lines = log.splitlines()
    if not first:
        exceptions = [line for line in lines if EXCEPTION_LINE.match(line)]
        if exceptions:
            return exceptions[-1][:200]
    at = [i for i, line in enumerate(lines) if " ERROR " in line and " ERROR failed: " not in line]
    if not at:
        return lines[-1][:200] if lines else ""
    i = at[0] if first else at[-1]
    line = lines[i].split(" ERROR ", 1)[1]
    if i + 1 < len(lines) and lines[i + 1].startswith("  "):  # "FILE: invalid config" and its first problem
        line += ": " + lines[i + 1].strip()
    return line[:200]


def read_run(run: Path, outcome: Outcome) -> None:
    """Losses, peak memory and samples from a run folder, into `outcome`."""
    if (run / "metrics.jsonl").is_file():
        text = (run / "metrics.jsonl").read_text()
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        losses = [v for line in lines for k, v in line.items()
                  if (k == "loss" or k.startswith("val_loss")) and not isinstance(v, list)]
        if losses:  # a non-finite value is written as null
            outcome.finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses)
        trained = [line["loss"] for line in lines if "loss" in line]
        outcome.final_loss = trained[-1] if trained and trained[-1] is not None else None
        peaks = [line["peak_memory_mib"] for line in lines if "peak_memory_mib" in line]
        outcome.peak_mib = max(peaks) if peaks else None
    if (run / "samples").is_dir():
        outcome.samples = sum(p.suffix.lower() in SAMPLE_SUFFIXES for p in (run / "samples").rglob("*"))


def run_one(family: str, example: Path, precision: str, args: argparse.Namespace, root: Path) -> Outcome:
    folder = root / f"{family}_{precision}"
    folder.mkdir(parents=True)
    job = shortened(example, precision, args.device, args.steps, folder)
    run = folder / "output" / yaml.safe_load(job.read_text())["config"]["name"]
    log_path = folder / "run.log"
    started = time.perf_counter()
    with log_path.open("w") as log:
        # a session of its own: a timeout ends its loader workers too; run elsewhere than the repo, so no path
        # of the job leans on it
        child = subprocess.Popen([sys.executable, str(REPO / "run.py"), str(job), "--quiet"], cwd=folder,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = child.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = None
    outcome = Outcome(family, precision, "", time.perf_counter() - started)
    text = log_path.read_text(errors="replace")
    read_run(run, outcome)
    if code is None:
        outcome.status, outcome.error = "timed out", f"after {args.timeout} s"
    elif code == 0:
        outcome.status = "ok"
    elif code == 1 and not (run / "status.json").exists() and "Traceback" not in text:
        outcome.status, outcome.error = "refused", error_line(text, first=True)
    else:
        outcome.status, outcome.error = "failed", error_line(text, first=False)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a self-check of the script (no accelerator figures)")
    parser.add_argument("--families", help="comma-separated model.arch names (default: every tiny example)")
    parser.add_argument("--precisions", default="bf16,fp16", help="comma-separated, of bf16 and fp16")
    parser.add_argument("--steps", type=int, default=3, help="optimizer updates per job")
    parser.add_argument("--keep", type=Path, help="keep the jobs' folders (job.yaml, run.log, run) here")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    args = parser.parse_args(argv)
    found = examples()
    families = args.families.split(",") if args.families else list(found)
    precisions = args.precisions.split(",")
    unknown = [f for f in families if f not in found] + [p for p in precisions if p not in ("bf16", "fp16")]
    if unknown:
        parser.error(f"unknown {', '.join(unknown)}; families: {', '.join(found)}; precisions: bf16, fp16")
    if args.keep and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep: {args.keep} is not empty")
    from benchmarks.memory_phases import cuda_missing

    if cuda_missing(args.device):
        return 2
    import torch

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    jobs = len(families) * len(precisions)
    print(f"{name}, torch {torch.__version__}: {jobs} jobs of {args.steps} updates")
    print(HEADER, flush=True)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
        root = args.keep or Path(tmp)
        for family in families:
            for precision in precisions:
                outcomes.append(run_one(family, found[family], precision, args, root))
                print(outcomes[-1].row(), flush=True)
    bad = [o for o in outcomes if o.bad]
    refused = sum(o.status == "refused" for o in outcomes)
    print(f"{len(outcomes) - len(bad) - refused} ok, {refused} refused at config time, {len(bad)} failed or not finite"
          + (f"; run folders in {args.keep}" if args.keep else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
