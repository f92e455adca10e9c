"""Host memory of loading a denoiser, sharded (`train.sharding: fsdp`) against whole, per process.

    python -m benchmarks.sharded_memory                   # Qwen-Image's transformer at full width, 4 of its 60 blocks
    python -m benchmarks.sharded_memory --blocks 8 --processes 2 3

A full-size-shaped model cut to a few blocks (Qwen-Image: 3072 wide, each block about 0.4 B parameters, 0.8 GB in
bf16) is written once in diffusers' format with random weights. Then, each in fresh processes on the CPU:
- whole: diffusers' `from_pretrained` (what every DDP process holds);
- sharded over N processes: the trainer's own path (the denoiser built on the meta device, the LoRA added, FSDP2 over
  its blocks, each process reading its rows from the weight files: toolkit/run/sharding.py).
Each process reports its peak resident memory over the load and a first read of every weight (Linux's VmHWM, reset
before the load; a model loaded from a memory-mapped file is resident only once read), less what it held before; the
table sets it beside the model's size, the size over N, and the largest block.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: Qwen-Image's transformer (Qwen/Qwen-Image) at full width; `num_layers` set by --blocks
QWEN_IMAGE_TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, attention_head_dim=128,
                              num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=[16, 56, 56])


def resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Linux: VmHWM back to the current resident size."""
    Path("/proc/self/clear_refs").write_text("5")


def build(folder: Path, blocks: int) -> None:
    """The transformer with random weights, bf16, as `<folder>/transformer` in diffusers' format (filled tensor by
    tensor: a normal initialisation of 1.5 B parameters would take minutes here)."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    with init_empty_weights():
        model = QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER, num_layers=blocks)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model.to(torch.bfloat16).save_pretrained(folder / "transformer", safe_serialization=True,
                                             max_shard_size="2GB")


def worker(mode: str, folder: Path) -> dict:
    """Load as `mode` says; the figures of this process."""
    import torch
    from diffusers import QwenImageTransformer2DModel

    from toolkit.config.sections import NetworkConfig
    from toolkit.models.common import pretrained_denoiser
    from toolkit.models.qwen_image.adapter import QwenImageAdapter
    from toolkit.network.lora import add_lora

    sharded = mode == "sharded"
    if sharded:
        torch.distributed.init_process_group("gloo")
    reset_peak()
    before = resident_kib("VmRSS")
    model = pretrained_denoiser(QwenImageTransformer2DModel, str(folder), "transformer", torch.bfloat16, sharded)
    model.requires_grad_(False)
    add_lora(model, NetworkConfig(linear=16, linear_alpha=16), ["to_q", "to_k", "to_v", "to_out.0"],
             device=torch.device("cpu"))
    if sharded:
        from toolkit.run.sharding import shard_denoiser

        shard_denoiser(model, QwenImageAdapter.sharded_blocks, torch.device("cpu"), False)
    with torch.no_grad():  # every page of the weights read, as the first forward (or the move to a GPU) reads them:
        for param in model.parameters():  # a model loaded from a memory-mapped file is not resident before that
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.numel():
                local.reshape(-1)[:: 4096 // local.element_size()].float().sum()
    peak = resident_kib("VmHWM") - before
    held = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
               for p in model.parameters())
    figures = {"mode": mode, "rank": int(os.environ.get("RANK", 0)), "peak_gib": peak / 2**20, "held_gib": held / 2**30}
    if sharded:
        torch.distributed.destroy_process_group()
    return figures


def sizes(folder: Path) -> dict:
    """The model's bytes and its largest block's, from the weight files."""
    from safetensors import safe_open

    total, blocks = 0, {}
    for path in sorted((folder / "transformer").glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for key in handle.keys():
                part = handle.get_slice(key)
                count = 1
                for dim in part.get_shape():
                    count *= dim
                size = count * 2  # bf16
                total += size
                if key.startswith("transformer_blocks."):
                    block = ".".join(key.split(".")[:2])
                    blocks[block] = blocks.get(block, 0) + size
    return {"model_gib": total / 2**30, "block_gib": max(blocks.values()) / 2**30}


def launch(mode: str, folder: Path, processes: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    script = [str(Path(__file__).resolve()), "--worker", mode, "--model", str(folder)]
    if mode == "whole":
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), *script]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} x{processes} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line[len("FIGURES "):]) for line in done.stdout.splitlines() if line.startswith("FIGURES ")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--processes", type=int, nargs="+", default=[2])
    parser.add_argument("--worker", choices=["whole", "sharded"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("FIGURES " + json.dumps(worker(args.worker, Path(args.model))), flush=True)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        build(folder, args.blocks)
        size = sizes(folder)
        print(f"Qwen-Image transformer, {args.blocks} blocks at full width, bf16: {size['model_gib']:.2f} GiB "
              f"(largest block {size['block_gib']:.2f} GiB); peak host memory of the load per process, above what "
              "the process held before it:")
        whole = launch("whole", folder, 1)[0]
        print(f"  whole (every DDP process):   peak {whole['peak_gib']:.2f} GiB, holds {whole['held_gib']:.2f} GiB")
        for processes in args.processes:
            ranks = launch("sharded", folder, processes)
            peak = max(r["peak_gib"] for r in ranks)
            held = max(r["held_gib"] for r in ranks)
            expected = size["model_gib"] / processes + size["block_gib"]
            print(f"  sharded over {processes} processes: peak {peak:.2f} GiB (largest of the processes), holds "
                  f"{held:.2f} GiB; size / {processes} + one block = {expected:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
