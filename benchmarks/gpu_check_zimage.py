"""Device check for Z-Image training on a CUDA machine: runs a short job through the real path (quantized
training transformer, separate quantized sampling transformer sharing the LoRA, low_vram) and prints the
accelerator memory around each phase, from the trainer's own `logging.debug_memory` records.

    python -m benchmarks.gpu_check_zimage                      # the tiny preset: a quick smoke test
    python -m benchmarks.gpu_check_zimage --dim 1536 --layers 8 # a random model large enough for real figures
    python -m benchmarks.gpu_check_zimage --model /path/to/Z-Image --sampling /path/to/Z-Image-Turbo

Needs no network: random models are built offline (in the difftune cache). Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.memory_phases import MIB, collect_phases, cuda_missing, phase_table, run_job_file  # noqa: E402


def random_models(dim: int, layers: int) -> tuple[str, str]:
    """Training and sampling model folders: the tiny preset with a transformer of `dim` x `layers`."""
    from toolkit.models.zimage.tiny import TINY_ZIMAGE, ensure_tiny_zimage

    heads = max(2, dim // 128)
    transformer = {**TINY_ZIMAGE["transformer"], "dim": dim, "n_layers": layers, "n_heads": heads,
                   "n_kv_heads": heads, "axes_dims": [dim // heads // 4, 3 * dim // heads // 8,
                                                      3 * dim // heads // 8]}
    preset = {**TINY_ZIMAGE, "transformer": transformer}
    return str(ensure_tiny_zimage(preset)), str(ensure_tiny_zimage({**preset, "seed": 1}))


def job(folder: Path, model: str, sampling: str, args) -> Path:
    dtype = "bf16" if args.device == "cuda" else "fp32"
    process = {
        "type": "sd_trainer", "training_folder": str(folder), "device": args.device, "trigger_word": "shp",
        "network": {"linear": 16, "linear_alpha": 16},
        "save": {"save_every": 0},
        "datasets": [{"folder_path": str(REPO / "config/examples/quickstart_data"), "resolution": [args.resolution],
                      "cache_latents": True}],
        "train": {"batch_size": 1, "steps": args.steps, "lr": 1e-4, "dtype": dtype, "cache_text_embeddings": True,
                  "gradient_checkpointing": True},
        "model": {"arch": "zimage", "name_or_path": model, "quantize": True, "qtype": args.qtype, "low_vram": True,
                  "sampling": {"name_or_path": sampling, "quantize": True, "qtype": "qfloat8"}, "dtype": dtype},
        "sample": {"sample_every": args.steps, "prompts": ["[trigger], a red circle"], "sample_steps": 4,
                   "width": args.resolution, "height": args.resolution},
        "logging": {"debug_memory": True},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": "gpu_check", "process": [process]}}))
    return path


def qfloat8_bias_check(device: str) -> float:
    """Relative error of a qfloat8 Linear (256 -> 512, with bias) quantized through toolkit.quantize against
    its bf16 original on `device`: quanto's Marlin fp8 kernel (CUDA, capability 8+) drops the bias, which the
    project's guard avoids; a large error here means the guard does not hold on this machine."""
    from toolkit.quantize import quantize_blockwise

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(256, 512)).to(device, torch.bfloat16)
    with torch.no_grad():
        reference[0].bias.uniform_(1.0, 2.0)
    quantized = torch.nn.Sequential(torch.nn.Linear(256, 512)).to(torch.bfloat16)
    quantized.load_state_dict(reference.state_dict())
    quantize_blockwise(quantized, "qfloat8", [quantized[0]], None, device)
    x = torch.randn(8, 256, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        want, got = reference(x).float(), quantized(x).float()
    return float((got - want).norm() / want.norm())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Z-Image folder to train on (default: a random model)")
    parser.add_argument("--sampling", help="transformer folder for samples (default: a second random model)")
    parser.add_argument("--dim", type=int, default=32, help="random model width (32 = the tiny preset)")
    parser.add_argument("--layers", type=int, default=2, help="random model main layers")
    parser.add_argument("--qtype", default="qint8", choices=["qfloat8", "qint8", "qint4"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a smoke run of the script itself (no accelerator figures)")
    args = parser.parse_args()
    if cuda_missing(args.device):
        return 2

    model, sampling = args.model, args.sampling
    if model is None or sampling is None:
        built = random_models(args.dim, args.layers)
        model, sampling = model or built[0], sampling or built[1]
    collect = collect_phases()
    with tempfile.TemporaryDirectory() as tmp:
        wall = run_job_file(job(Path(tmp), model, sampling, args), REPO)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{name}: {args.steps} updates in {wall:.1f} s "
          f"(model {model}, sampling {sampling}, qtype {args.qtype})")
    print(phase_table(collect.records))
    if args.device == "cuda":
        print(f"peak allocated over the run: {torch.cuda.max_memory_allocated() / MIB:.0f} MiB")
    error = qfloat8_bias_check(args.device)
    print(f"qfloat8 Linear with bias vs bf16, relative error: {error:.4f} (fine below 0.05)")
    return 0 if error < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
