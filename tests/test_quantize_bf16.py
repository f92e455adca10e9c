"""A LoRA on a quanto-quantized base trains under bf16 autocast (`train.dtype: bf16`) whatever the base dtype.

The base's dtype (`model.dtype`: float32 on the CPU by default, bfloat16 on CUDA) and the autocast dtype differ
on the CPU. quanto's quantized linear computes its forward in the autocast dtype, then its backward, which runs
outside autocast, multiplied that bf16 gradient with the float32 (dequantized) weight: "expected m1 and m2 to
have the same dtype" (qint8 and qfloat8). And on the CPU, a qint8 layer fed bf16 activations failed in the
forward already: "expected scalar type BFloat16 but found Float" (torch._weight_int8pack_mm with float32
scales). See `toolkit.quantize.keep_quantized_linear_dtypes_matched`.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import QUICKSTART_DATA, REPO, trainer_process, write_job
from safetensors.torch import load_file
from torch import nn

from toolkit.quantize import quantize_blockwise
from toolkit.run.metrics import read_metrics

QTYPES = ["qint8", "qfloat8"]


def tiny_stack(dtype: torch.dtype) -> nn.Sequential:
    """Linear layers with and without bias (Z-Image's attention projections have none): a bias-free quantized
    layer's output stays in the autocast dtype, so the gradient reaching its backward is bf16."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.GELU(),
        nn.Linear(64, 64, bias=False), nn.GELU(),
        nn.Linear(64, 64, bias=False), nn.GELU(),
        nn.Linear(64, 16),
    ).to(dtype)


def with_lora(model: nn.Module) -> tuple[nn.Module, list[torch.Tensor]]:
    """A float32 LoRA on every Linear, as toolkit.network.lora.add_lora makes it."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["0", "2", "4", "6"])
    model = inject_adapter_in_model(config, model)
    lora = [param for name, param in model.named_parameters() if "lora_" in name]
    for param in lora:
        param.data = param.data.float()
    return model, lora


def lora_gradients(model: nn.Module, lora: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list:
    for param in lora:
        param.grad = None
    # as accelerate's mixed precision: autocast around the forward only, backward outside it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    nn.functional.mse_loss(out.float(), y).backward()
    return [param.grad.detach().clone() for param in lora]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(32, 16, generator=generator), torch.randn(32, 16, generator=generator)


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16], ids=["fp32_base", "bf16_base"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_lora_on_a_quantized_base_trains_under_bf16_autocast(qtype, base_dtype):
    """fp32 base (the CPU default) + bf16 autocast crashed in backward; bf16 base (the CUDA default) did not, and
    both go through the same quantized linear backward."""
    model, lora = with_lora(quantize_blockwise(tiny_stack(base_dtype), qtype))
    x, y = data()
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    before = [param.detach().clone() for param in lora]
    losses = []
    for _ in range(10):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        for param in lora:
            assert param.grad is not None and param.grad.dtype == torch.float32
            assert torch.isfinite(param.grad).all()
        optimizer.step()
        losses.append(loss.item())
    # every LoRA weight learned, including those of the first layer, whose gradient comes through the
    # quantized layers' backward
    assert all(not torch.equal(param, old) for param, old in zip(lora, before))
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < 0.9 * losses[0]


@pytest.mark.parametrize("qtype", QTYPES)
def test_gradients_through_the_quantized_base_match_the_full_precision_ones(qtype):
    """The gradients are right, not just computable: the LoRA gradients on the quantized fp32 base under bf16
    autocast are close to those on the full-precision base, whose nn.Linear handles autocast itself."""
    full = tiny_stack(torch.float32)
    quantized, lora_q = with_lora(quantize_blockwise(copy.deepcopy(full), qtype))
    full, lora_f = with_lora(full)
    generator = torch.Generator().manual_seed(2)
    for param_q, param_f in zip(lora_q, lora_f):
        # LoRA's up weights start at zero, and so would the down weights' gradients: make them all non-zero
        param_f.data = 0.1 * torch.randn(param_f.shape, generator=generator)
        param_q.data = param_f.data.clone()
    x, y = data()
    for found, expected in zip(lora_gradients(quantized, lora_q, x, y), lora_gradients(full, lora_f, x, y)):
        assert torch.isfinite(found).all()
        assert nn.functional.cosine_similarity(found.flatten(), expected.flatten(), dim=0) > 0.98


def test_the_fix_is_installed_once_and_leaves_matching_dtypes_alone():
    from optimum.quanto.library import qbytes_mm as kernels
    from optimum.quanto.tensor.function import QuantizedLinearFunction

    quantize_blockwise(nn.Sequential(nn.Linear(8, 8)), "qint8")
    installed, int8pack_mm = QuantizedLinearFunction.backward, kernels.qbytes_int8pack_mm
    assert getattr(installed, "difftune_guard", False) and getattr(int8pack_mm, "difftune_guard", False)
    quantize_blockwise(nn.Sequential(nn.Linear(8, 8)), "qint8")
    assert QuantizedLinearFunction.backward is installed and kernels.qbytes_int8pack_mm is int8pack_mm
    # without autocast, all in one dtype: the same gradients as quanto's own backward
    model = quantize_blockwise(tiny_stack(torch.float32), "qint8")
    x = torch.randn(4, 16, requires_grad=True)
    model(x).square().sum().backward()
    found = x.grad.clone()
    x.grad = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(QuantizedLinearFunction, "backward", installed.__wrapped_original__)
        model(x).square().sum().backward()
    assert torch.equal(found, x.grad)


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_quantized_base_trains_under_gradient_checkpointing(qtype):
    """Checkpointed activations unpack once only: the dtype fix must not read the saved tensors itself (it did,
    and a full-size Z-Image job with gradient checkpointing failed in backward)."""
    from torch.utils.checkpoint import checkpoint

    model, lora = with_lora(quantize_blockwise(tiny_stack(torch.float32), qtype))
    x, y = data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = checkpoint(model, x, use_reentrant=False)
    nn.functional.mse_loss(out.float(), y).backward()
    assert all(param.grad is not None and torch.isfinite(param.grad).all() for param in lora)


@pytest.mark.slow
def test_zimage_trains_quantized_in_bf16_through_run_py(tmp_path):
    """The real job path: `python run.py qint8.yaml qfloat8.yaml` (one command, the jobs in turn), a tiny Z-Image
    with a quantized transformer, bf16 mixed precision on the CPU (base weights float32, `model.dtype: auto`)."""
    jobs = []
    for qtype in QTYPES:
        process = trainer_process(
            tmp_path,
            model={"arch": "zimage", "name_or_path": "tiny", "quantize": True, "qtype": qtype},
            train={"dtype": "bf16", "steps": 2, "batch_size": 1, "lr": 1e-2},
            datasets=[{"folder_path": str(QUICKSTART_DATA), "resolution": [32]}],
            save={"dtype": "float32", "save_every": 1, "max_step_saves_to_keep": 2},  # a checkpoint per update
        )
        jobs.append(str(write_job(tmp_path / f"{qtype}.yaml", f"zimage_{qtype}", process)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(REPO / "run.py"), *jobs], check=False,
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    for qtype in QTYPES:
        run_dir = tmp_path / "output" / f"zimage_{qtype}"
        records = read_metrics(run_dir / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2]
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
                   for r in records)
        after_1, after_2 = (load_file(str(run_dir / "checkpoints" / f"step_00000000{step}" / "lora.safetensors"))
                            for step in (1, 2))
        assert after_1 and after_1.keys() == after_2.keys()
        assert all(torch.isfinite(t).all() for t in (*after_1.values(), *after_2.values()))
        # every LoRA weight learned: the up weights start at zero and moved in update 1, all moved in update 2
        assert all(t.abs().sum() > 0 for key, t in after_1.items() if ".lora.up." in key)
        assert all(not torch.equal(after_1[key], after_2[key]) for key in after_1)
