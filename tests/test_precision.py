"""The dtype rule of a run (toolkit/precision.py): what `model.dtype` and `train.dtype` resolve to, the denoiser
computing under the training autocast inside a sampling pipeline and returning the base's dtype, fp16 with a
GradScaler on the CPU, the combinations refused at config time, and torch's CPU int8 kernel kept from the shapes
it crashes on."""

from __future__ import annotations

import subprocess
import sys
from types import MethodType

import pytest
import torch
from helpers import REPO, inline_job
from torch import nn

from toolkit.config.loader import ConfigError, load_config
from toolkit.precision import Precision, floats_as

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(("model", "train", "device", "base", "compute"), [
    ("auto", "auto", CPU, torch.float32, None),
    ("auto", "auto", CUDA, torch.bfloat16, torch.bfloat16),
    ("auto", "fp16", CUDA, torch.float16, torch.float16),  # an fp16 job on a GPU gets an fp16 base, not bf16
    ("fp16", "auto", CUDA, torch.float16, torch.float16),
    ("auto", "fp16", CPU, torch.float32, torch.float16),
    ("bf16", "auto", CPU, torch.bfloat16, None),
    ("fp32", "bf16", CUDA, torch.float32, torch.bfloat16),
    ("bfloat16", "float32", CUDA, torch.bfloat16, None),
])
def test_auto_follows_the_other_keys_half_precision_on_cuda_and_is_float32_on_the_cpu(model, train, device, base,
                                                                                         compute):
    precision = Precision.of(model, train, device)
    assert (precision.base, precision.compute, precision.trained) == (base, compute, torch.float32)
    assert precision.scales_loss == (compute == torch.float16)
    assert precision.mixed_precision == {None: "no", torch.bfloat16: "bf16", torch.float16: "fp16"}[compute]


@pytest.mark.parametrize(("model", "train"), [("fp16", "bf16"), ("bfloat16", "float16")])
def test_two_different_half_precisions_are_refused_by_key(tmp_path, registry, model, train):
    with pytest.raises(ConfigError) as error:
        load_config(str(inline_job(tmp_path / "job.yaml", model=f"arch: sd15, name_or_path: tiny, dtype: {model}",
                                           train=f", dtype: {train}")), registry)
    assert "model.dtype" in str(error.value) and f"train.dtype: {train}" in str(error.value)


@pytest.mark.parametrize(("model", "train"), [("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp16"), ("bf16", "fp32"),
                                              ("auto", "fp16")])
def test_one_half_precision_or_float32_beside_it_is_taken(tmp_path, registry, model, train):
    load_config(str(inline_job(tmp_path / "job.yaml", model=f"arch: sd15, name_or_path: tiny, dtype: {model}",
                                           train=f", dtype: {train}")), registry)


class Denoiser(nn.Module):
    """A stand-in denoiser: a Linear in the base's dtype, and what dtype it computed in."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.proj = nn.Linear(4, 4).to(dtype)
        self.computed_in: torch.dtype | None = None

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict:
        out = self.proj(x.to(self.proj.weight.dtype))
        self.computed_in = out.dtype
        return {"sample": out * scale, "steps": torch.tensor([1, 2])}


def accelerate_prepared(module: nn.Module) -> nn.Module:
    """What accelerate's prepare does to a module's forward under bf16 mixed precision: autocast, float32 outputs."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = torch.autocast("cpu", dtype=torch.bfloat16)(type(module).forward)
    module.forward = MethodType(convert_outputs_to_fp32(forward), module)
    return module


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared_by_accelerate", "expert_not_prepared"])
def test_a_pipelines_denoiser_computes_under_the_training_autocast_and_returns_the_base_dtype(prepared):
    precision = Precision.of("fp32", "bf16", CPU)
    module = Denoiser(torch.float32)
    if prepared:
        module = accelerate_prepared(module)
        training_forward = module.forward
    x, scale = torch.randn(2, 4), torch.tensor(2.0)
    with precision.denoisers_for_pipeline([module, module]):  # a module named twice is wrapped once
        out = module(x, scale)
        assert module.computed_in == torch.bfloat16  # the training autocast
        assert out["sample"].dtype == torch.float32 and out["steps"].dtype == torch.int64  # the base's dtype
    if prepared:
        assert module.forward == training_forward  # accelerate's wrapper is back
    else:
        assert "forward" not in module.__dict__
        module(x, scale)
        assert module.computed_in == torch.float32


def test_a_bf16_base_trained_in_bf16_hands_the_pipeline_bf16_not_accelerates_float32():
    """A pipeline of a bf16 base decodes with a bf16 VAE: the denoiser's float32 training outputs would reach it
    ("Input type (float) and bias type (c10::BFloat16) should be the same")."""
    precision = Precision.of("bf16", "bf16", CPU)
    module = accelerate_prepared(Denoiser(torch.bfloat16))
    assert module(torch.randn(1, 4), torch.tensor(1.0))["sample"].dtype == torch.float32
    with precision.denoisers_for_pipeline([module]):
        assert module(torch.randn(1, 4), torch.tensor(1.0))["sample"].dtype == torch.bfloat16


def test_without_mixed_precision_the_pipeline_denoiser_runs_in_its_own_dtype():
    precision = Precision.of("bf16", "fp32", CPU)
    module = Denoiser(torch.bfloat16)
    with precision.denoisers_for_pipeline([module]):
        assert module(torch.randn(1, 4), torch.tensor(1.0))["sample"].dtype == torch.bfloat16
        assert module.computed_in == torch.bfloat16


def test_floats_as_keeps_the_output_class_and_casts_floating_tensors_only():
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    out = floats_as((Transformer2DModelOutput(sample=torch.ones(2)), [torch.ones(1, dtype=torch.int32)]),
                    torch.float16)
    assert isinstance(out[0], Transformer2DModelOutput) and out[0].sample.dtype == torch.float16
    assert out[1][0].dtype == torch.int32


def test_fp16_on_the_cpu_autocasts_and_scales_the_loss_as_on_cuda(tmp_path):
    """accelerate leaves fp16 off on the CPU without a word; the run accelerator turns on torch's CPU autocast and
    GradScaler, so the model wrapper computes in fp16 and `backward` scales the loss."""
    from toolkit.config.sections import RuntimeSection
    from toolkit.run.accelerator import RunAccelerator

    runtime = RunAccelerator(RuntimeSection(dtype="fp16"), "cpu", tmp_path, model_dtype="fp32")
    try:
        acc = runtime.accelerator
        assert runtime.precision.scales_loss and isinstance(acc.scaler, torch.amp.GradScaler)
        model = acc.prepare(Denoiser(torch.float32))
        out = model(torch.randn(2, 4), torch.tensor(1.0))
        assert model.computed_in == torch.float16 and out["sample"].dtype == torch.float32
        loss = out["sample"].square().mean()
        acc.backward(loss)
        grad = model.proj.weight.grad.clone()
        model.zero_grad()
        loss = model(torch.randn(2, 4), torch.tensor(1.0))["sample"].square().mean()
        loss.backward()
        assert grad.abs().max() > 100 * model.proj.weight.grad.abs().max()  # scaled by 2**16 before unscaling
    finally:
        runtime.close()


INT8_KERNEL_PROBE = """
import torch
from torch import nn
from optimum.quanto import freeze, qint8, quantize
from toolkit.quantize import keep_quantized_linear_dtypes_matched
keep_quantized_linear_dtypes_matched()
for width in (24, 40, 32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 32), nn.Linear(32, width)).to(torch.bfloat16)
    x = torch.randn(3, width, dtype=torch.bfloat16)
    reference = model(x).float()
    quantize(model, weights=qint8)
    freeze(model)
    out = model(x).float()
    print(width, ((out - reference).norm() / reference.norm()).item())
"""


def test_qint8_layers_of_widths_torchs_int8_kernel_crashes_on_run_in_bf16():
    """torch 2.14.1's CPU `_weight_int8pack_mm` ends the process (segmentation fault) for bf16 activations whose width
    is not a multiple of 16 (24, 40 here; 32 takes the kernel); such layers take quanto's generic path. In a
    subprocess, so that a crash is a failure here, not the end of the test session."""
    result = subprocess.run([sys.executable, "-c", INT8_KERNEL_PROBE], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    errors = dict(line.split() for line in result.stdout.splitlines())
    assert list(errors) == ["24", "40", "32"] and all(float(e) < 0.05 for e in errors.values()), errors


def test_int8_kernel_is_used_where_it_can_be():
    from toolkit.quantize import int8pack_mm_takes

    bf16, fp32 = torch.ones(2, 32, dtype=torch.bfloat16), torch.ones(2, 24)
    assert int8pack_mm_takes(bf16, torch.ones(4, dtype=torch.bfloat16))
    assert int8pack_mm_takes(fp32, torch.ones(4))
    assert not int8pack_mm_takes(torch.ones(2, 24, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16))
    assert not int8pack_mm_takes(bf16, torch.ones(4))  # scales of another dtype
