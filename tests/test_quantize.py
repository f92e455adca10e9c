"""toolkit.quantize: block-by-block quanto quantization, stored sizes, and a LoRA training on top."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import toolkit.quantize as quantize_mod
from toolkit.quantize import QTYPES, quantize_blockwise, weight_bytes

QINT4 = pytest.param(
    "qint4",
    marks=pytest.mark.skipif(os.environ.get("DIFFTUNE_TEST_QINT4") != "1",
                             reason="qint4 may compile a C++ extension; set DIFFTUNE_TEST_QINT4=1"),
)
# What each weight type may keep of the bf16 bytes: 1 byte (qint4: 4 bits) per weight, plus scales and biases.
MAX_FRACTION = {"qint8": 0.55, "qfloat8": 0.55, "qint4": 0.30}
FULL_PRECISION = ["embed", "final"]


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class TinyTransformer(nn.Module):
    """Embedder, blocks, a Linear outside the blocks, final layer: the shape of a diffusion transformer."""

    def __init__(self, width: int = 256, depth: int = 4, features: int = 16):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.proj_out = nn.Linear(width, width)
        self.final = nn.Linear(width, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.final(self.proj_out(x))


def tiny(dtype: torch.dtype = torch.bfloat16, **kwargs) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(**kwargs).to(dtype)


def is_quantized(module: nn.Module) -> bool:
    """Replaced by a quanto module and frozen (its weight is a QTensor)."""
    from optimum.quanto import QModuleMixin, QTensor

    return isinstance(module, QModuleMixin) and isinstance(module.weight, QTensor)


def is_touched(module: nn.Module) -> bool:
    """Replaced by a quanto module, frozen or not."""
    from optimum.quanto import QModuleMixin

    return isinstance(module, QModuleMixin)


def quantized_copy(model: nn.Module, qtype: str, exclude: list[str] | None = FULL_PRECISION) -> nn.Module:
    quantized = copy.deepcopy(model)
    return quantize_blockwise(quantized, qtype, quantized.blocks, exclude=exclude, device="cpu")


@pytest.mark.parametrize("qtype", ["qint8", "qfloat8", QINT4])
def test_quantized_weights_are_counted_as_stored_and_about_halve_bf16(qtype):
    model = tiny()
    full = weight_bytes(model)
    assert full == sum(p.numel() * 2 for p in model.parameters())
    fraction = weight_bytes(quantized_copy(model, qtype)) / full
    assert fraction <= MAX_FRACTION[qtype]


def test_a_shared_tensor_is_counted_once():
    layer = nn.Linear(8, 8)
    assert weight_bytes(nn.Sequential(layer, layer)) == weight_bytes(layer)


@pytest.mark.parametrize("qtype", ["qint8", "qfloat8"])
def test_excluded_modules_keep_full_precision_and_the_rest_is_quantized(qtype):
    from optimum.quanto import QLinear

    model = quantized_copy(tiny(), qtype, exclude=[*FULL_PRECISION, "blocks.*.fc2"])
    for name in ("embed", "final", *(f"blocks.{i}.fc2" for i in range(4))):
        module = model.get_submodule(name)
        assert type(module) is nn.Linear and type(module.weight.data) is torch.Tensor, name
        assert module.weight.dtype == torch.bfloat16, name
    for name in ("proj_out", *(f"blocks.{i}.fc1" for i in range(4))):
        module = model.get_submodule(name)
        assert isinstance(module, QLinear) and is_quantized(module), name
        assert module.weight.qtype == QTYPES[qtype], name


@pytest.mark.parametrize(
    ("qtype", "tolerance"),
    [("qint8", 0.02), ("qfloat8", 0.05), pytest.param("qint4", 0.12, marks=QINT4.marks)],
)
def test_quantized_model_computes_close_to_the_full_precision_one(qtype, tolerance):
    model = tiny()
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        expected, found = model(x).float(), quantized_copy(model, qtype)(x).float()
    assert not torch.equal(found, expected)
    assert (found - expected).norm() / expected.norm() < tolerance


def test_blocks_are_quantized_one_at_a_time_on_the_device(monkeypatch):
    """When block i arrives on the device, blocks before it are quantized and it and later ones are not.

    Eleven blocks, so that block 1's patterns must not catch block 10.
    """
    model = tiny(width=8, depth=11, features=4)
    seen = []

    def recording_move(module, device):
        blocks = [(is_quantized(block.fc1), is_touched(block.fc2)) for block in model.blocks]
        seen.append((module, device, blocks, is_touched(model.proj_out)))
        return module

    monkeypatch.setattr(quantize_mod, "safe_module_to_device", recording_move)
    quantize_blockwise(model, "qint8", list(model.blocks), exclude=FULL_PRECISION, device="cpu")
    assert [module for module, *_ in seen] == list(model.blocks)
    for index, (_, device, quantized, rest_quantized) in enumerate(seen):
        assert device == "cpu"
        assert quantized == [(i < index, i < index) for i in range(11)]
        assert not rest_quantized
    assert all(is_quantized(block.fc1) and is_quantized(block.fc2) for block in model.blocks)
    assert is_quantized(model.proj_out)


def test_no_device_quantizes_where_the_blocks_are(monkeypatch):
    monkeypatch.setattr(quantize_mod, "safe_module_to_device", lambda module, device: pytest.fail("moved"))
    model = tiny(width=8)
    quantize_blockwise(model, "qint8", model.blocks, exclude=FULL_PRECISION)
    assert all(is_quantized(block.fc1) for block in model.blocks) and not is_quantized(model.embed)


def test_bad_arguments_are_named():
    model = tiny(width=8)
    with pytest.raises(ValueError, match="qint3.*qfloat8, qint8, qint4"):
        quantize_blockwise(model, "qint3", model.blocks)
    with pytest.raises(ValueError, match="Block is not a submodule of TinyTransformer"):
        quantize_blockwise(model, "qint8", [Block(8)])
    quantize_blockwise(model, "qint8", model.blocks)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_blockwise(model, "qint8", model.blocks)


def test_lora_trains_on_a_quantized_frozen_base():
    """peft wraps quanto's QLinear like any Linear: only LoRA weights learn, the quantized base stays put."""
    from optimum.quanto import QLinear
    from peft import LoraConfig, inject_adapter_in_model

    model = quantized_copy(tiny(width=64), "qfloat8")
    targets = ["fc1", "fc2", "proj_out"]
    config = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=targets)
    model = inject_adapter_in_model(config, model)
    assert isinstance(model.blocks[0].fc1.base_layer, QLinear)
    base = {name: stored(param) for name, param in model.named_parameters() if "lora_" not in name}
    lora = [param for name, param in model.named_parameters() if "lora_" in name]
    assert lora and all(param.requires_grad for param in lora)
    for param in lora:
        param.data = param.data.float()  # as toolkit.network.lora.add_lora keeps them

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=generator, dtype=torch.bfloat16)
    y = torch.randn(64, 16, generator=generator, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    losses = []
    for _ in range(15):
        loss = nn.functional.mse_loss(model(x).float(), y.float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    assert all(param.grad is not None and param.grad.abs().sum() > 0 for param in lora)
    for name, param in model.named_parameters():
        if "lora_" not in name:
            assert not param.requires_grad and param.grad is None, name
            now = stored(param)
            assert len(now) == len(base[name]) and all(map(torch.equal, now, base[name])), name
    assert losses[-1] < 0.9 * losses[0]


def stored(param: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a (possibly quantized) parameter holds, as raw bytes (no torch.equal for float8 on CPU)."""
    if hasattr(param, "__tensor_flatten__"):
        names, _ = param.__tensor_flatten__()
        return [t for name in names for t in stored(getattr(param, name))]
    return [param.detach().clone().contiguous().view(torch.uint8)]
