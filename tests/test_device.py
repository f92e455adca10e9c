"""toolkit.device: module moves (plain and quanto-quantized), modules_on, memory_debug."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import toolkit.device as device_mod
from toolkit.device import memory_debug, modules_on, safe_module_to_device

CPU = torch.device("cpu")


def small_stack(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).to(dtype)


def quantized_stack(qtype: str) -> nn.Sequential:
    from optimum.quanto import freeze, qfloat8, qint8, quantize

    model = small_stack(torch.bfloat16)
    quantize(model, weights={"qint8": qint8, "qfloat8": qfloat8}[qtype])
    freeze(model)
    return model


def count_to_calls(module: nn.Module) -> list:
    """Wrap `module.to` (instance attribute) to record calls while still moving."""
    calls = []
    original = module.to

    def recording_to(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    module.to = recording_to
    return calls


@pytest.fixture
def flush_calls(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(device_mod, "flush", lambda: calls.append(True))
    return calls


def fake_devices(monkeypatch, device: torch.device) -> None:
    """Pretend every tensor of every module lives on `device` (there is no GPU in these tests)."""
    monkeypatch.setattr(device_mod, "tensor_devices", lambda module: {"0.weight": device, "0.bias": device})


# ---- safe_module_to_device -------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["cpu", CPU])
def test_move_to_the_device_it_is_on_calls_no_to(target, flush_calls):
    model = small_stack()
    calls = count_to_calls(model)
    assert safe_module_to_device(model, target) is model
    assert calls == []
    assert flush_calls == []


def test_move_of_a_module_elsewhere_calls_to_once(monkeypatch):
    """The counterpart of the no-op test: the wrapper does see a real move."""
    model = small_stack()
    calls = count_to_calls(model)
    safe_module_to_device(model, "meta")
    assert len(calls) == 1
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("qtype", ["qint8", "qfloat8"])
def test_quantized_module_moves_data_and_scales_and_keeps_dtype(qtype):
    from optimum.quanto import QTensor

    model = quantized_stack(qtype)
    data_dtype = model[0].weight._data.dtype
    safe_module_to_device(model, "meta")
    for layer in (model[0], model[2]):
        # Read through the module each time: a held reference would block the next move (see below).
        assert isinstance(layer.weight, QTensor) and isinstance(layer.weight, nn.Parameter)
        assert layer.weight._data.device.type == "meta" and layer.weight._scale.device.type == "meta"
        assert layer.weight.dtype == torch.bfloat16 and layer.weight._data.dtype == data_dtype
        assert layer.bias.device.type == "meta"


@pytest.mark.parametrize("qtype", ["qint8", "qfloat8"])
def test_quantized_module_moved_to_cpu_computes_the_same(qtype):
    """On this CPU-only machine this is the no-op path; the CUDA test below does the real round trip."""
    from optimum.quanto import QTensor

    model = quantized_stack(qtype)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
    safe_module_to_device(model, "cpu")
    with torch.no_grad():
        after = model(x)
    assert isinstance(model[0].weight, QTensor) and model[0].weight.dtype == torch.bfloat16
    assert after.dtype == torch.bfloat16
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", ["qint8", "qfloat8"])
def test_quantized_module_round_trip_through_cuda(qtype, flush_calls):
    model = quantized_stack(qtype)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
    safe_module_to_device(model, "cuda")
    assert model[0].weight._data.is_cuda and model[0].weight._scale.is_cuda
    with torch.no_grad():
        on_gpu = model(x.cuda())
    safe_module_to_device(model, "cpu")
    assert flush_calls == [True]
    assert model[0].weight._data.device == CPU and model[0].weight._scale.device == CPU
    with torch.no_grad():
        torch.testing.assert_close(model(x), before)
    torch.testing.assert_close(on_gpu.cpu(), before, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("base_requires_grad", [True, False])
def test_live_autograd_graph_on_a_quantized_weight_gives_an_explaining_error(base_requires_grad):
    """torch swaps QTensor parameters in place and refuses while a graph still refers to one; say so."""
    model = quantized_stack("qint8")
    model.requires_grad_(base_requires_grad)  # False: a frozen base under a LoRA
    output = model(torch.randn(2, 32, dtype=torch.bfloat16, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"Sequential.*autograd graph still refers"):
        safe_module_to_device(model, "meta")
    del output


def test_meta_tensor_is_an_error_naming_module_and_parameter():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    calls = count_to_calls(model)
    with pytest.raises(ValueError, match=r"Sequential.*'0\.weight'.*meta"):
        safe_module_to_device(model, "cpu")
    assert calls == []


def test_meta_buffer_is_named_too():
    model = nn.BatchNorm1d(4)
    model.running_mean = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match=r"BatchNorm1d.*'running_mean'"):
        safe_module_to_device(model, "cpu")


def test_moving_off_an_accelerator_flushes(monkeypatch, flush_calls):
    fake_devices(monkeypatch, torch.device("cuda", 0))
    model = small_stack()
    calls = count_to_calls(model)
    safe_module_to_device(model, "cpu")
    assert len(calls) == 1
    assert flush_calls == [True]


def test_moving_onto_an_accelerator_does_not_flush(monkeypatch, flush_calls):
    fake_devices(monkeypatch, CPU)
    model = small_stack()
    model.to = lambda *args, **kwargs: model  # there is no GPU to move to
    safe_module_to_device(model, "cuda:0")
    assert flush_calls == []


def test_target_without_index_matches_any_index(monkeypatch):
    fake_devices(monkeypatch, torch.device("cuda", 1))
    model = small_stack()
    calls = count_to_calls(model)
    safe_module_to_device(model, "cuda")
    assert calls == []


# ---- modules_on ----------------------------------------------------------------------------------------


def test_modules_on_moves_through_the_helper_and_back_even_on_error(monkeypatch):
    moves = []
    monkeypatch.setattr(device_mod, "safe_module_to_device", lambda module, to: moves.append((module, to)))
    first, second = small_stack(), small_stack()
    target = torch.device("cuda", 0)
    with pytest.raises(KeyError), modules_on([first, second], target):
        raise KeyError("sampling failed")
    assert moves == [(first, target), (second, target), (second, CPU), (first, CPU)]


def test_modules_on_sends_back_what_arrived_when_a_later_arrival_fails(monkeypatch):
    """E.g. the accelerator runs out of memory moving the second module: the first must not stay there."""
    moves = []
    first, second = small_stack(), small_stack()
    target = torch.device("cuda", 0)

    def move(module, to):
        if module is second and to == target:
            raise torch.OutOfMemoryError("no room")
        moves.append((module, to))

    monkeypatch.setattr(device_mod, "safe_module_to_device", move)
    with pytest.raises(torch.OutOfMemoryError), modules_on([first, second], target):
        pass
    assert moves == [(first, target), (first, CPU)]


# ---- memory_debug --------------------------------------------------------------------------------------


def forbid(monkeypatch, obj, name: str) -> None:
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} was called")

    monkeypatch.setattr(obj, name, fail)


@pytest.fixture
def measuring_forbidden(monkeypatch):
    for name in ("is_available", "is_initialized", "memory_allocated", "memory_reserved",
                 "max_memory_allocated"):
        forbid(monkeypatch, torch.cuda, name)
    for name in ("process_rss_bytes", "accelerator_memory", "memory_snapshot"):
        forbid(monkeypatch, device_mod, name)
    forbid(monkeypatch, device_mod.time, "perf_counter")


def test_memory_debug_off_measures_nothing_and_logs_nothing(measuring_forbidden, caplog):
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        with memory_debug("load", enabled=False) as record:
            pass
    assert record == {}
    assert caplog.records == []


def test_memory_debug_on_does_measure(measuring_forbidden):
    """The counterpart: the same patches do catch an enabled block, so the test above can fail."""
    with pytest.raises(AssertionError, match="was called"), memory_debug("load", enabled=True):
        pass


def test_memory_debug_on_logs_one_labelled_record(caplog):
    log = logging.getLogger("difftune.test")
    with caplog.at_level(logging.INFO, logger="difftune.test"), memory_debug("quantize", True, log) as record:
        kept = bytearray(8 * 2**20)
    del kept
    assert len(caplog.records) == 1
    logged = caplog.records[0]
    assert "quantize" in logged.getMessage() and "rss" in logged.getMessage()
    assert logged.memory is record and record["label"] == "quantize" and record["seconds"] >= 0
    assert record["rss_before"] > 0 and record["rss_after"] > 0
    assert "allocated_before" not in record  # CUDA unused in this process


def test_memory_debug_records_cuda_memory_when_cuda_is_in_use(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    readings = {"memory_allocated": [100, 1100], "memory_reserved": [200, 1200],
                "max_memory_allocated": [300, 1300]}
    for name, values in readings.items():
        monkeypatch.setattr(torch.cuda, name, lambda device=None, values=values: values.pop(0))
    with caplog.at_level(logging.INFO, logger="difftune"), memory_debug("sample", True) as record:
        pass
    assert (record["allocated_before"], record["reserved_before"], record["peak_before"]) == (100, 200, 300)
    assert (record["allocated_after"], record["reserved_after"], record["peak_after"]) == (1100, 1200, 1300)
    assert "peak" in caplog.records[0].getMessage()


def test_memory_debug_logs_when_the_block_fails(caplog):
    failing = memory_debug("sample", True)
    with caplog.at_level(logging.INFO, logger="difftune"), pytest.raises(MemoryError), failing:
        raise MemoryError
    assert len(caplog.records) == 1 and caplog.records[0].memory["label"] == "sample"
