"""Device check for Wan 2.2 A14B's two experts on a CUDA machine, before trusting a long run to them:

a short training job through the real path (both experts quantized, low_vram, the experts in turn, clips through both
caches, a sample video), recording at every training forward how much of each expert's frozen weight is on the GPU:
with low_vram exactly one expert may be there at a time (the one that runs). Prints the accelerator memory per phase
from the trainer's own `logging.debug_memory` records, the peak while training, and exits non-zero on a failure.

    python -m benchmarks.gpu_check_wan                       # the tiny preset: a quick smoke test
    python -m benchmarks.gpu_check_wan --dim 1536 --layers 8 # random experts as wide as Wan 2.1 1.3B's
    python -m benchmarks.gpu_check_wan --device cpu          # a smoke run of the script itself

Needs no network: random models are built offline (in the difftune cache).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.memory_phases import MIB, collect_phases, cuda_missing, phase_table, run_job_file  # noqa: E402


def random_model(dim: int, layers: int) -> str:
    """The tiny two-expert preset with experts `dim` wide (heads of 128 beyond the tiny width) and `layers` deep."""
    from toolkit.models.wan.tiny import TINY_WAN22_A14B, ensure_tiny_wan22_a14b

    base = TINY_WAN22_A14B["transformers"][0]
    transformer = {**base, "num_layers": layers}
    if dim != base["num_attention_heads"] * base["attention_head_dim"]:
        transformer.update(num_attention_heads=max(1, dim // 128), attention_head_dim=128, ffn_dim=4 * dim)
    return str(ensure_tiny_wan22_a14b({**TINY_WAN22_A14B, "transformers": [transformer, transformer]}))


def write_clips(folder: Path, size: int, frames: int) -> None:
    from toolkit.run.video import write_video

    folder.mkdir(parents=True, exist_ok=True)
    for index in range(4):
        video = np.zeros((frames, size, size, 3), np.uint8)
        for k in range(frames):
            video[k, :, (index * 7 + 3 * k) % size] = (200, 60 + 40 * index, 40)
        write_video(folder / f"clip_{index}", video, 16.0, {})
        (folder / f"clip_{index}.txt").write_text(f"a line sweeping right, number {index}")


def job(folder: Path, model: str, args) -> Path:
    dtype = "bf16" if args.device == "cuda" else "fp32"
    process = {
        "type": "sd_trainer", "training_folder": str(folder / "output"), "device": args.device, "trigger_word": "shp",
        "network": {"linear": 16, "linear_alpha": 16},
        "save": {"save_every": 0},
        "datasets": [{"folder_path": str(folder / "data"), "resolution": [args.resolution], "num_frames": args.frames,
                      "cache_latents": True}],
        "train": {"batch_size": 1, "steps": args.steps, "lr": 1e-4, "dtype": dtype, "cache_text_embeddings": True,
                  "gradient_checkpointing": True},
        "model": {"arch": "wan", "name_or_path": model, "quantize": True, "qtype": args.qtype, "quantize_te": True,
                  "qtype_te": "qfloat8" if args.device == "cuda" else "qint8", "low_vram": True,
                  "expert_switch_every": 2, "dtype": dtype},
        "sample": {"sample_every": args.steps, "prompts": ["[trigger], a line sweeping right"], "sample_steps": 8,
                   "width": args.resolution, "height": args.resolution, "num_frames": args.frames},
        "logging": {"debug_memory": True},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": "gpu_check_wan", "process": [process]}}))
    return path


def frozen_bytes_on(module: torch.nn.Module, device_type: str) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters()
               if not p.requires_grad and p.device.type == device_type)


def placement_failures(seen: list[tuple[str, dict[str, int]]]) -> list[str]:
    """Forwards where the running expert had no weights on the GPU, or the other expert had some."""
    failures = []
    for expert, on_gpu in seen:
        others = {n: b for n, b in on_gpu.items() if n != expert and b}
        if not on_gpu[expert] or others:
            failures.append(f"{expert} ran with {on_gpu[expert] / MIB:.0f} MiB of its weights on the GPU and "
                            f"{ {n: round(b / MIB) for n, b in others.items()} } MiB of the other's")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Wan 2.2 A14B folder (default: random experts)")
    parser.add_argument("--dim", type=int, default=32, help="random experts' width (32 = the tiny preset)")
    parser.add_argument("--layers", type=int, default=2, help="random experts' blocks")
    parser.add_argument("--qtype", default="qfloat8", choices=["qfloat8", "qint8", "qint4"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a smoke run of the script itself (no accelerator figures)")
    args = parser.parse_args(argv)
    if cuda_missing(args.device):
        return 2
    from toolkit.models.wan.adapter import WanExperts

    model = args.model or random_model(args.dim, args.layers)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    failures: list[str] = []
    seen: list[tuple[str, dict[str, int]]] = []
    forward = WanExperts.forward

    def watched(self, expert, **kwargs):
        output = forward(self, expert, **kwargs)  # the expert's pre-hook has brought it by now
        seen.append((expert, {n: frozen_bytes_on(e, args.device) for n, e in self.experts.items()}))
        return output

    WanExperts.forward = watched
    collect = collect_phases()
    with tempfile.TemporaryDirectory() as tmp:
        write_clips(Path(tmp) / "data", args.resolution, args.frames)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        wall = run_job_file(job(Path(tmp), model, args), REPO)
        samples = sorted((Path(tmp) / "output" / "gpu_check_wan" / "samples").glob("*.mp4"))
    WanExperts.forward = forward
    print(f"{name}: {args.steps} updates in {wall:.1f} s ({args.qtype}, {args.resolution} px x {args.frames} frames)")
    print(phase_table(collect.records))
    if args.device == "cuda":
        print(f"peak allocated over the job: {torch.cuda.max_memory_allocated() / MIB:.0f} MiB")
        failures += placement_failures(seen)
    print("experts per forward:", "".join("H" if e == "high_noise" else "L" for e, _ in seen))
    if {e for e, _ in seen} != {"high_noise", "low_noise"}:
        failures.append(f"both experts should have trained, saw {sorted({e for e, _ in seen})}")
    if not samples:
        failures.append("no sample video was written")
    for failure in failures[:10]:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
