"""How a loader worker's batch reaches the training process.

torch sends every tensor of a worker's batch through shared memory: the worker moves the tensor's storage into a
shared segment and the training process maps it, which costs the receiving side about 1-1.5 ms per tensor (a file
descriptor passed over a socket, then mapped) whatever the tensor's size. Copying a small tensor through the
worker's pipe with the rest of the batch costs a fraction of that: measured on a 2-core machine, a 48 KiB tensor
was received in 0.7 ms by value against 1.75 ms through shared memory, a 256 KiB one in 0.87 against 1.38 ms; from
about 600 KiB on, shared memory wins (docs/performance.md). `collate_in_worker` therefore marks a batch's tensors of
up to `BY_VALUE_BYTES` to travel by value; larger ones still go through shared memory. torch has no setting for
this: its sharing strategies (`file_descriptor`, `file_system`) choose how shared memory is named, for every tensor
of the process.
"""

from __future__ import annotations

import torch

from toolkit.data.dataset import collate

#: tensors up to this size travel in the worker's pipe with their batch; larger ones through shared memory
BY_VALUE_BYTES = 256 * 1024


class ByValue:
    """A tensor that is pickled as its bytes (and unpickled as a new tensor), not as a shared-memory handle."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __reduce__(self):
        tensor = self.tensor.detach().contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return tensor_from_bytes, (data, tensor.dtype, tuple(tensor.shape))


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor `ByValue` pickled, in memory of its own (writable, as the shared-memory path gives)."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def by_value(value):
    """A batch (a dict, nested dicts included) whose CPU tensors of up to `BY_VALUE_BYTES` are marked `ByValue`. A
    larger tensor that is a view of another (a batch of one sample is a view of its rows: `batch_of`, the latent
    cache's own tensor in a worker) is copied first: torch would move the whole storage it views into shared memory,
    for good, and the worker would keep a shared segment and its file descriptor per cache entry it ever sent."""
    if isinstance(value, torch.Tensor):
        small = value.device.type == "cpu" and value.numel() * value.element_size() <= BY_VALUE_BYTES
        if small:
            return ByValue(value)
        return value.clone() if value._base is not None else value
    if isinstance(value, dict):
        return {key: by_value(item) for key, item in value.items()}
    return value


def collate_in_worker(samples: list[dict]) -> dict:
    """`collate` for a loader worker: the batch with its small tensors sent by value (`by_value`)."""
    return by_value(collate(samples))
