"""The denoiser sharded over the processes with torch's FSDP2 (`train.sharding: fsdp`).

Built with torch's own API (`torch.distributed.fsdp.fully_shard`), not accelerate's FSDP plugin: accelerate (1.16)
turns an FSDP launch on the CPU into plain multi-process training, so its path could not be run or tested here, and
its plugin loads the whole model on every process (or on rank 0) before sharding. Here the model is built on the meta
device, sharded block by block, and each process reads only its own rows of each weight from the safetensors files.

What the rest of the trainer sees:
- the trained parameters (the LoRA) are DTensors sharded like the base; the optimizer, the EMA, clipping and the
  schedule-free swap work on them as on plain tensors;
- `gathered()` puts the full trained weights in place for a while (a collective: every process enters it), so the
  code that writes LoRA files runs unchanged; inside `loading()`, the code that loads them (peft's
  `set_peft_model_state_dict`) loads full tensors into the shards;
- `full_optimizer_state` / `shard_optimizer_state`: a checkpoint's optimizer state is always the full one, the same
  file an unsharded run writes, so a run resumes on any process count (2 -> 3) and with or without sharding.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from toolkit.device import WEIGHTS_ATTRIBUTE

log = logging.getLogger("difftune")

def block_modules(module: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The family's sharded blocks (`ModelAdapter.sharded_blocks`): each name a dotted path from the denoiser, `*`
    standing for each child of a ModuleList; a path ending at a ModuleList stands for each of its children, at any
    other module for that module. Paths that reach nothing (a block type without attentions) are skipped."""
    blocks = []
    for name in names:
        found = [module]
        for part in name.split("."):
            if part == "*":
                found = [child for parent in found for child in parent.children()]
            else:
                found = [getattr(parent, part) for parent in found if getattr(parent, part, None) is not None]
        for item in found:
            blocks += list(item) if isinstance(item, torch.nn.ModuleList) else [item]
    return blocks


def local_rows(param: DTensor) -> tuple[int, int]:
    """The rows of the full tensor this process holds (FSDP2 shards dim 0 as `torch.chunk` does)."""
    world, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    rows = param.shape[0]
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


class Unsharded:
    """Every process holds the whole denoiser (one process, or DDP): nothing to gather or cut."""

    enabled = False

    def gathered(self):
        return nullcontext()

    def loading(self):
        return nullcontext()

    def gradient_sync(self, sync: bool):
        return nullcontext()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def optimizer_state_for(self, saved: dict, optimizer: torch.optim.Optimizer) -> dict:
        return saved


class Sharded(Unsharded):
    """The denoisers sharded with FSDP2 (`shard_denoiser`); every method is collective."""

    enabled = True

    def __init__(self, denoisers: list[torch.nn.Module]):
        self.denoisers = denoisers

    def gathered(self):
        """The full trained weights in place inside the block, to be read (see `gathered`)."""
        return gathered(self.denoisers)

    def loading(self):
        """Full tensors loaded into the sharded weights inside the block (see `loading_full_tensors`)."""
        return loading_full_tensors(self.denoisers)

    @contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """Around a micro-batch's backward: gradients reduce-scattered over the processes only when `sync` (the
        micro-batch that ends an update), else accumulated unsharded on each process (FSDP2's own `no_sync`)."""
        if sync:
            yield
            return
        for module in self.denoisers:
            module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for module in self.denoisers:
                module.set_requires_gradient_sync(True)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return full_optimizer_state(optimizer)

    def optimizer_state_for(self, saved: dict, optimizer: torch.optim.Optimizer) -> dict:
        return shard_optimizer_state(saved, optimizer)


@contextmanager
def sharded_parameters(modules: list[torch.nn.Module], groups: list[dict]) -> Iterator[None]:
    """Around sharding `modules`: the optimizer's parameter groups then hold the sharded parameters (FSDP2 replaces
    each parameter of a module it shards by a DTensor of the same name) in place of the ones they held."""
    names = {id(param): (index, name) for index, module in enumerate(modules)
             for name, param in module.named_parameters()}
    yield
    now = [dict(module.named_parameters()) for module in modules]
    for group in groups:
        group["params"] = [now[names[id(p)][0]][names[id(p)][1]] if id(p) in names else p for p in group["params"]]


def shard_denoiser(module: torch.nn.Module, blocks: tuple[str, ...], device: torch.device,
                   cpu_offload: bool, host_group=None) -> torch.nn.Module:
    """Shard `module` block by block (then the rest of it) over every process and fill it: the frozen weights from
    its weight files (this process's rows only, block by block), the trained ones (the LoRA, made before sharding and
    the same on every process: rank 0's) from their values. A module loaded in full (not built empty) is sharded
    from its own values. `host_group`: a gloo group for the CPU-side broadcast of the LoRA's initial values (the
    default group is NCCL on GPUs)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    weights = getattr(module, WEIGHTS_ATTRIBUTE, None)
    world = torch.distributed.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,))
    held = {name: tensor.detach().clone() for name, tensor in module_tensors(module).items()
            if tensor.device.type != "meta"}
    trained = {name for name, param in module.named_parameters() if param.requires_grad}
    for name in sorted(held.keys() & trained):
        # the LoRA's initial values: rank 0's everywhere
        torch.distributed.broadcast(held[name], src=0, group=host_group)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    for block in block_modules(module, blocks):
        fully_shard(block, mesh=mesh, offload_policy=offload)
    fully_shard(module, mesh=mesh, offload_policy=offload)
    # peft's LoKr/LoHa skip a dropped module entirely, drawn per process: every process reduces every trained
    # parameter, a gradient it did not make counted as zeros (else the processes' reductions differ in size)
    module.set_reduce_scatter_unused_params(True)
    module.to_empty(device="cpu" if cpu_offload else device)
    fill(module, held, weights)
    return module


@torch.no_grad()
def fill(module: torch.nn.Module, held: dict[str, torch.Tensor], weights) -> None:
    """Each parameter's local rows and each buffer, from `held` (what existed before sharding) or the weight files,
    one tensor at a time (only this process's rows of it are read)."""
    state = module_tensors(module)
    to_read = [name for name in state if name not in held]
    if to_read and weights is None:
        raise ValueError(f"{type(module).__name__}: {to_read[0]} has no value and the model has no weight files")
    in_file = {name: name.replace(".base_layer.", ".") for name in to_read}  # peft's wrapper around an adapted layer
    missing = sorted(n for n in in_file.values() if n not in weights.location)
    if missing:
        raise ValueError(f"{type(module).__name__}: the weight files lack {len(missing)} tensors (e.g. {missing[0]})")
    for name, value in held.items():
        place(state[name], value)
    for name in to_read:
        target = state[name]
        if isinstance(target, DTensor):
            start, stop = local_rows(target)
            target.to_local().copy_(weights.read_rows(in_file[name], start, stop, target.dtype))
        else:
            target.copy_(weights.read([in_file[name]], target.dtype, "cpu")[in_file[name]])


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, non-persistent buffers (made at construction, not saved) included."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def place(target: torch.Tensor, value: torch.Tensor) -> None:
    """A full tensor `value` into `target`: a sharded parameter takes this process's rows of it."""
    if not isinstance(target, DTensor):
        target.copy_(value)
        return
    start, stop = local_rows(target)
    target.to_local().copy_(value[start:stop])


def resharded(modules: list[torch.nn.Module]) -> None:
    """Every FSDP unit back to its shards. A forward without backward (validation, samples) leaves the root unit
    gathered (FSDP2 keeps it for the backward it expects), and a `state_dict()` call reshards it: called on the main
    process alone (writing a file) that would leave the processes in different states, and their next forward would
    gather different units. Called on every process before the trained weights are read."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()


def trained_dtensors(modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, str, DTensor]]:
    """(owner, name, parameter) of every trained sharded parameter, in a fixed order (the same on every process)."""
    found = []
    for module in modules:
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if isinstance(param, DTensor) and param.requires_grad:
                    found.append((owner, name, param))
    return found


@contextmanager
def gathered(modules: list[torch.nn.Module]) -> Iterator[None]:
    """The full trained weights in place of their shards inside the block, to be read (collective: every process
    enters it, in the same order). Outside, the shards again. Loading goes through `loading_full_tensors` instead:
    FSDP2 takes a `load_state_dict` to mean its own parameters changed."""
    resharded(modules)
    swapped = []
    try:
        for owner, name, param in trained_dtensors(modules):
            full = torch.nn.Parameter(param.full_tensor().detach(), requires_grad=True)
            owner._parameters[name] = full
            swapped.append((owner, name, param))
        yield
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


@contextmanager
def loading_full_tensors(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Inside the block, `load_state_dict` on the sharded modules takes full tensors (what a LoRA file holds, e.g.
    through peft's `set_peft_model_state_dict`): each value for a sharded parameter is cut to this process's rows
    first, as a DTensor of the parameter's layout, which FSDP2 loads as its own (no collective)."""
    def to_shards(module, state_dict, prefix, *args) -> None:
        params = dict(module.named_parameters(prefix=prefix.rstrip(".")) if prefix else module.named_parameters())
        for key, value in list(state_dict.items()):
            param = params.get(key)
            if isinstance(param, DTensor) and torch.is_tensor(value) and not isinstance(value, DTensor):
                state_dict[key] = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements,
                                                    src_data_rank=None)

    resharded(modules)
    handles = [module._register_load_state_dict_pre_hook(to_shards, with_module=True) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict with every sharded tensor gathered (collective): the file an unsharded run
    writes."""
    saved = optimizer.state_dict()
    state = {}
    for index in sorted(saved["state"]):  # state_dict's entries are the optimizer's own dicts: copied, not changed
        entry = saved["state"][index]
        state[index] = {key: entry[key].full_tensor() if isinstance(entry[key], DTensor) else entry[key]
                        for key in sorted(entry)}
    return {**saved, "state": state}


def shard_optimizer_state(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A full optimizer state (any process count, sharded or not) cut to this process's shards of its parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    by_id = dict(zip(ids, params))
    state = {}
    for index, entry in saved["state"].items():
        param = by_id.get(index)
        state[index] = {key: distribute_tensor(value.to(param.to_local().device), param.device_mesh, param.placements,
                                               src_data_rank=None)
                        if isinstance(param, DTensor) and torch.is_tensor(value) and not isinstance(value, DTensor)
                        and value.shape == param.shape else value
                        for key, value in entry.items()}
    return {**saved, "state": state}


def autocast_forward(module: torch.nn.Module, accelerator) -> torch.nn.Module:
    """The training autocast on `module`'s forward, float32 outputs, as accelerate's `prepare` sets it on the model
    it wraps in DDP (accelerate 1.16, `Accelerator.prepare_model`): a sharded model is not prepared by accelerate, so
    this part of it is done here, with accelerate's own pieces. Nothing changes without mixed precision."""
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    if not accelerator.native_amp:
        return module
    autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    module._original_forward = module.forward
    module.forward = MethodType(autocast(module.forward.__func__), module)
    module.forward = MethodType(convert_outputs_to_fp32(module.forward.__func__), module)
    return module
