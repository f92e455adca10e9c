"""Device choice and memory housekeeping."""

from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def to_device(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor onto `device` without making the host wait: to CUDA it goes from pinned memory with
    `non_blocking` (a blocking copy waits for all the work already queued on the device); the dtype changes
    there. Anything else is a plain `.to`. The copy may still be running on return: do not change `tensor` in
    place afterwards (a tensor that is already pinned is copied from directly)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    if tensor.device == device and (dtype is None or tensor.dtype == dtype):
        return tensor  # already there: no `.to` dispatched (a dozen times per micro-batch)
    if device.type == "cuda" and tensor.device.type == "cpu":
        moved = tensor.pin_memory().to(device, non_blocking=True)
        return moved if dtype is None else moved.to(dtype)
    return tensor.to(device=device, dtype=dtype)


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)`, without dispatching anything where it has that dtype already (a dozen times per
    micro-batch: each dispatch is microseconds of host time between the model's kernels)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def flush() -> None:
    """Free cached memory (before saving, after sampling)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def trim_host_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; nothing elsewhere). Quantizing layer
    by layer frees each layer's full-precision tensors and the quantizer's temporaries between the small quantized
    tensors it keeps; glibc reuses such holes poorly, so without this the CPU's resident size grows by several
    times the quantized size of a block while the block loads (measured in tests/test_quantized_loading.py)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # another C library (e.g. musl)
            pass


def tensor_devices(module: torch.nn.Module) -> dict[str, torch.device]:
    """Where each parameter and buffer of `module` lives, by qualified name (parameters first).

    A quanto QTensor reports the device of its inner data, so quantized modules need no special case.
    """
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    return {name: tensor.device for name, tensor in tensors}


def _is_on(current: torch.device, target: torch.device) -> bool:
    # A target without an index ("cuda") matches any index of its type, as in "the module is on the GPU".
    return current.type == target.type and (target.index is None or current.index == target.index)


#: the attribute a model built empty (toolkit/models/empty.py) keeps its weight files in: such a model is filled on its
#: device shard by shard (toolkit/run/sharding.py), never moved as a whole
WEIGHTS_ATTRIBUTE = "difftune_streamed_weights"


def safe_module_to_device(module: torch.nn.Module, device: torch.device | str,
                          flush_after: bool = True) -> torch.nn.Module:
    """Move `module` to `device`; every module move in the project goes through here.

    Why not a bare `module.to(device)`: it is skipped when there is nothing to move (no copies, no
    allocator traffic); a module with `meta` tensors (never materialised) fails here with its name instead
    of deep inside torch; cached accelerator memory is released after a module leaves the accelerator;
    and a failed swap of a quantized weight gets an explanation. quanto's QTensors move with `.to` like any
    tensor (their data and scales move together, the dtype is kept), so no special case is needed.
    """
    target = torch.device(device)
    if hasattr(module, WEIGHTS_ATTRIBUTE):
        return module
    devices = tensor_devices(module)
    on_meta = [name for name, current in devices.items() if current.type == "meta"]
    if on_meta:
        raise ValueError(
            f"cannot move {type(module).__name__} to {target}: its tensor {on_meta[0]!r} is on the meta "
            "device (never loaded); load its weights first"
        )
    if all(_is_on(current, target) for current in devices.values()):
        return module
    leaves_accelerator = target.type == "cpu" and any(current.type != "cpu" for current in devices.values())
    _move(module, target)
    if leaves_accelerator and flush_after:  # `flush_after=False`: the caller flushes once after several moves
        flush()
    return module


def move_frozen(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Move what `module` holds frozen (parameters without gradient, buffers) to `device`; trainable parameters (a
    LoRA, which the optimizer and DDP hold) stay where they are. Subtrees without a trainable parameter move whole
    through `safe_module_to_device` (quantized weights included); the frozen tensors held directly by a module with
    trainable descendants (e.g. a block's modulation table) move one by one."""
    target = torch.device(device)
    if hasattr(module, WEIGHTS_ATTRIBUTE):  # sharded: each process keeps its shards where they are
        return module
    leaves_accelerator = target.type == "cpu" and any(d.type != "cpu" for d in tensor_devices(module).values())
    _move_frozen(module, target)
    if leaves_accelerator:
        flush()  # once, not per moved part: a flush is a full garbage collection
    return module


def _move_frozen(module: torch.nn.Module, target: torch.device) -> None:
    if not any(p.requires_grad for p in module.parameters()):
        safe_module_to_device(module, target, flush_after=False)
        return
    for child in module.children():
        _move_frozen(child, target)
    with torch.no_grad():
        for name, param in module._parameters.items():
            if param is not None and not param.requires_grad and not _is_on(param.device, target):
                # a new frozen Parameter (nothing holds frozen ones: not the optimizer, not DDP)
                module._parameters[name] = torch.nn.Parameter(param.data.to(target), requires_grad=False)
        for name, buffer in module._buffers.items():
            if buffer is not None and not _is_on(buffer.device, target):
                module._buffers[name] = buffer.to(target)


def _move(module: torch.nn.Module, target: torch.device) -> None:
    try:
        module.to(target)
    except RuntimeError as error:
        # torch moves tensor-subclass parameters (quanto QTensors) by swapping them in place, which it refuses
        # while an autograd graph still holds one; its own message does not say so.
        if "swap" not in str(error):
            raise
        raise RuntimeError(
            f"cannot move {type(module).__name__} to {target}: {error}. Quantized (QTensor) weights are "
            "swapped in place, which torch refuses while an autograd graph still refers to one (an output "
            "computed with gradients and not yet backpropagated or released). The module may now be partly "
            "moved."
        ) from error


def _home(module: torch.nn.Module) -> torch.device | None:
    return next(iter(tensor_devices(module).values()), None)


@contextmanager
def modules_on(modules: list[torch.nn.Module], device: torch.device,
               while_moving: Callable[[], AbstractContextManager] = nullcontext):
    """Bring modules that were moved off the accelerator back for a while (e.g. to render samples).
    `while_moving()` is entered around each batch of moves (e.g. to keep shared LoRA layers where they are)."""
    moved: list[tuple[torch.nn.Module, torch.device]] = []
    try:
        with while_moving():
            for module in modules:
                home = _home(module)
                safe_module_to_device(module, device)
                if home is not None:
                    moved.append((module, home))
        yield
    finally:
        # Everything that arrived goes home, also when a later arrival failed (e.g. out of memory);
        # safe_module_to_device flushes when a module leaves the accelerator, so no flush() here.
        with while_moving():
            for module, home in reversed(moved):
                safe_module_to_device(module, home)


def process_rss_bytes() -> int | None:
    """Resident memory of this process now; None where /proc is missing (not Linux).

    /proc/self/statm rather than psutil: no extra dependency, and `resource` only knows the peak.
    """
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def accelerator_memory() -> dict[str, int]:
    """CUDA allocated / reserved / peak bytes; empty unless CUDA is in use (asking would initialise it)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "peak": torch.cuda.max_memory_allocated(),
    }


def memory_snapshot() -> dict[str, int]:
    """Process RSS and accelerator memory now, in bytes (keys absent where unknown)."""
    rss = process_rss_bytes()
    return {**({"rss": rss} if rss is not None else {}), **accelerator_memory()}


@contextmanager
def memory_debug(label: str, enabled: bool, log: logging.Logger | None = None) -> Iterator[dict[str, Any]]:
    """Log memory before and after the block as one record, when `enabled` (the `debug_memory` setting).

    Yields the record, a plain dict (`label`, `seconds`, `<what>_before` / `<what>_after` in bytes for
    rss, allocated, reserved, peak), filled when the block ends, even by an exception (an OOM is
    when it matters most). The log record carries it as `record.memory` for a metrics writer. Disabled,
    it yields an empty dict and measures nothing, so call sites need no `if`. `peak` is torch's peak
    since start or its last reset: this does not reset it, so that nested blocks do not disturb each other.
    """
    if not enabled:
        yield {}
        return
    record: dict[str, Any] = {"label": label}
    before, start = memory_snapshot(), time.perf_counter()
    try:
        yield record
    finally:
        record["seconds"] = time.perf_counter() - start
        after = memory_snapshot()
        record.update({f"{key}_before": value for key, value in before.items()})
        record.update({f"{key}_after": value for key, value in after.items()})
        (log or logging.getLogger("difftune")).info(describe_memory(record), extra={"memory": record})


def memory_fields() -> dict[str, float]:
    """Memory for a metrics line, in MiB: the accelerator's peak allocation where there is one, else the
    process RSS."""
    accelerator = accelerator_memory()
    if accelerator:
        return {"peak_memory_mib": round(accelerator["peak"] / 2**20, 1)}
    rss = process_rss_bytes()
    return {} if rss is None else {"rss_mib": round(rss / 2**20, 1)}


def describe_memory(record: dict[str, Any]) -> str:
    """One log line for a memory_debug record, in MiB."""
    parts = [f"memory [{record['label']}] {record['seconds']:.2f}s"]
    for key in ("rss", "allocated", "reserved", "peak"):
        if f"{key}_before" in record:
            before, after = record[f"{key}_before"] / 2**20, record[f"{key}_after"] / 2**20
            parts.append(f"{key} {before:.0f}->{after:.0f} MiB")
    return ", ".join(parts)


class ModulePlacement:
    """Where the frozen encoders are during a run. With `low_vram` they wait on the CPU and visit the accelerator
    only while they work; once their outputs are cached they leave it (`offload`) and come back only to render
    samples."""

    def __init__(self, device: torch.device, low_vram: bool, debug_memory: bool = False):
        self.device = device
        self.low_vram = low_vram
        self.debug_memory = debug_memory
        #: modules moved off the accelerator for the rest of training
        self.offloaded: list[torch.nn.Module] = []

    def visiting(self, modules: list[torch.nn.Module]):
        return modules_on(modules, self.device) if self.low_vram else nullcontext()

    def offload(self, modules: list[torch.nn.Module], label: str) -> None:
        with memory_debug(label, self.debug_memory):
            for module in modules:
                safe_module_to_device(module, "cpu")
        self.offloaded += modules

    def is_offloaded(self, module: torch.nn.Module) -> bool:
        return any(module is other for other in self.offloaded)

    def keep_on_device(self, modules: list[torch.nn.Module]) -> None:
        """Modules still needed in the loop (live encoding) are on the accelerator, also under low_vram."""
        for module in modules:
            if not self.is_offloaded(module):
                safe_module_to_device(module, self.device)
