"""Device check for Qwen-Image on a CUDA machine, before trusting a long run to it:

1. per qtype (qfloat8, qint8, qint4), the transformer read and quantized layer by layer onto the GPU: the GPU's
   peak while loading against the quantized model's size (the full-precision model must never be whole on the
   GPU), and the quantized model's prediction against the bf16 model's (quanto's CUDA kernels have dropped a
   layer's bias before: Qwen-Image's attention projections have biases);
2. a short training job through the real path (quantized transformer and text encoder, both caches, low_vram,
   samples with true CFG), printing the accelerator memory around each phase from the trainer's own
   `logging.debug_memory` records.

    python -m benchmarks.gpu_check_qwen_image                       # the tiny preset: a quick smoke test
    python -m benchmarks.gpu_check_qwen_image --dim 3072 --layers 8 # a random model wide as the real one
    python -m benchmarks.gpu_check_qwen_image --device cpu          # a smoke run of the script itself

Needs no network: random models are built offline (in the difftune cache). Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.memory_phases import MIB, collect_phases, cuda_missing, phase_table, run_job_file  # noqa: E402

#: a quantized prediction this far from bf16 (relative to its norm) means a kernel computes something else
MAX_RELATIVE_ERROR = {"qfloat8": 0.05, "qint8": 0.05, "qint4": 0.15}
#: loading may hold the quantized model plus one layer in full precision and the quantizer's temporaries
MAX_LOAD_PEAK = 1.3


def random_model(dim: int, layers: int) -> str:
    """The tiny preset with a transformer `dim` wide (heads of 128, as the real one) and `layers` deep."""
    from toolkit.models.qwen_image.tiny import TINY_QWEN_IMAGE, ensure_tiny_qwen_image

    if dim == TINY_QWEN_IMAGE["transformer"]["num_attention_heads"] * TINY_QWEN_IMAGE["transformer"]["attention_head_dim"]:
        transformer = {**TINY_QWEN_IMAGE["transformer"], "num_layers": layers}
    else:
        transformer = {**TINY_QWEN_IMAGE["transformer"], "num_layers": layers, "attention_head_dim": 128,
                       "num_attention_heads": max(1, dim // 128), "axes_dims_rope": [16, 56, 56]}
    return str(ensure_tiny_qwen_image({**TINY_QWEN_IMAGE, "transformer": transformer}))


def loading_check(model: str, qtype: str, device: torch.device) -> dict:
    """Peak accelerator memory while loading (quantized layer by layer) against the quantized size, and the
    quantized prediction's relative error against the bf16 model's."""
    from toolkit.models.base import PromptEmbeds
    from toolkit.models.qwen_image.adapter import QwenImageAdapter
    from toolkit.quantize import weight_bytes

    dtype = torch.bfloat16
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    quantized = QwenImageAdapter.load_transformer(model, model, dtype, qtype, device)
    peak = torch.cuda.max_memory_allocated() - start if device.type == "cuda" else 0
    size = weight_bytes(quantized)
    reference = QwenImageAdapter.load_transformer(model, model, dtype).to(device)
    config = reference.config
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, config.in_channels, 16, 16, generator=generator).to(device, dtype)  # 2x2-packed
    text = torch.randn(1, 12, config.joint_attention_dim, generator=generator).to(device, dtype)
    embeds = PromptEmbeds(text, torch.ones(1, 12, dtype=torch.bool), torch.tensor([12]))
    outputs = []
    for transformer in (reference, quantized):
        with torch.no_grad():
            outputs.append(transformer(hidden_states=latents.flatten(2).transpose(1, 2), timestep=torch.tensor(
                [0.6], device=device, dtype=dtype), encoder_hidden_states=embeds.embeds, img_shapes=[[(1, 16, 16)]],
                return_dict=False)[0].float())
    error = float((outputs[1] - outputs[0]).norm() / outputs[0].norm())
    del quantized, reference
    return {"qtype": qtype, "quantized_mib": size / 2**20, "load_peak_mib": peak / 2**20, "relative_error": error}


def job(folder: Path, model: str, args) -> Path:
    dtype = "bf16" if args.device == "cuda" else "fp32"
    process = {
        "type": "sd_trainer", "training_folder": str(folder), "device": args.device, "trigger_word": "shp",
        "network": {"linear": 16, "linear_alpha": 16},
        "save": {"save_every": 0},
        "datasets": [{"folder_path": str(REPO / "config/examples/quickstart_data"), "resolution": [args.resolution],
                      "cache_latents": True}],
        "train": {"batch_size": 1, "steps": args.steps, "lr": 1e-4, "dtype": dtype, "cache_text_embeddings": True,
                  "gradient_checkpointing": True, "timestep_type": "shift", "timestep_params": {"dynamic_shift": True}},
        "model": {"arch": "qwen_image", "name_or_path": model, "quantize": True, "qtype": args.qtype,
                  "quantize_te": True, "qtype_te": "qfloat8" if args.device == "cuda" else "qint8", "low_vram": True,
                  "dtype": dtype},
        "sample": {"sample_every": args.steps, "prompts": ["[trigger], a red circle"], "sample_steps": 4,
                   "width": args.resolution, "height": args.resolution},
        "logging": {"debug_memory": True},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": "gpu_check", "process": [process]}}))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Qwen-Image folder (default: a random model)")
    parser.add_argument("--dim", type=int, default=32, help="random model width (32 = the tiny preset)")
    parser.add_argument("--layers", type=int, default=2, help="random model blocks")
    parser.add_argument("--qtype", default="qint4", choices=["qfloat8", "qint8", "qint4"], help="of the training job")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a smoke run of the script itself (no accelerator figures)")
    args = parser.parse_args(argv)
    if cuda_missing(args.device):
        return 2
    device = torch.device(args.device)
    model = args.model or random_model(args.dim, args.layers)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    failures = []
    print(f"{name}: loading checks on {model}")
    # qint4 on the CPU is slow and not what this checks; the smoke run covers the loader with the 8-bit types
    for qtype in ("qfloat8", "qint8", "qint4") if args.device == "cuda" else ("qint8",):
        result = loading_check(model, qtype, device)
        ratio = result["load_peak_mib"] / result["quantized_mib"]
        print(f"  {qtype:8s} quantized {result['quantized_mib']:9.1f} MiB, GPU peak while loading "
              f"{result['load_peak_mib']:9.1f} MiB ({ratio:.2f}x), relative error vs bf16 {result['relative_error']:.4f}")
        if result["relative_error"] > MAX_RELATIVE_ERROR[qtype]:
            failures.append(f"{qtype}: relative error {result['relative_error']:.4f}")
        if args.device == "cuda" and ratio > MAX_LOAD_PEAK:
            failures.append(f"{qtype}: loading peaked at {ratio:.2f}x the quantized size")

    collect = collect_phases()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as tmp:
        wall = run_job_file(job(Path(tmp), model, args), REPO)
    print(f"\n{name}: {args.steps} updates in {wall:.1f} s (qtype {args.qtype}, {args.resolution} px)")
    print(phase_table(collect.records))
    if args.device == "cuda":
        print(f"peak allocated over the job: {torch.cuda.max_memory_allocated() / MIB:.0f} MiB")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
