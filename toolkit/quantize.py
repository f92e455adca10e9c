"""Weight quantization of a frozen base model with optimum-quanto, and what it saves.

The base stays frozen while a LoRA trains on top: peft wraps quanto's QLinear (an nn.Linear subclass)
like any Linear layer, and only the LoRA weights get gradients.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterable
from fnmatch import fnmatch
from pathlib import Path

import torch
from optimum.quanto import freeze, qfloat8, qint4, qint8, quantize
from optimum.quanto.nn import QModuleMixin
from safetensors import safe_open

from toolkit.device import safe_module_to_device, trim_host_heap

QTYPES = {"qfloat8": qfloat8, "qint8": qint8, "qint4": qint4}

#: the layers quanto quantizes for weights only (it quantizes LayerNorm only with activations)
QUANTIZABLE = (torch.nn.Linear, torch.nn.Conv2d)


def keep_qfloat8_off_marlin() -> None:
    """optimum-quanto (0.2.7) turns qfloat8 weights of layers >= 64 wide into its Marlin fp8 kernel on CUDA GPUs
    of compute capability 8+, and that kernel's linear function drops the layer's bias (Z-Image's adaLN layers
    have one): outputs are silently wrong. Its generic qfloat8 path (dequantize, then matmul) is correct, so
    quanto's check for the CUDA extension, as seen by the qfloat8 weight factory only, answers no."""
    from optimum.quanto.tensor.weights import qbytes

    if getattr(qbytes.is_extension_available, "difftune_guard", False):
        return
    original = qbytes.is_extension_available

    def without_marlin(extension_type: str) -> bool:
        return False if extension_type == "quanto_cuda" else original(extension_type)

    without_marlin.difftune_guard = True
    without_marlin.__wrapped_original__ = original
    qbytes.is_extension_available = without_marlin


def keep_quantized_linear_dtypes_matched() -> None:
    """Let a LoRA train on a quantized base whose dtype is not the autocast dtype (`model.dtype` float32, the
    CPU default, with `train.dtype: bf16`). Two optimum-quanto (0.2.7) bugs stop it; both patches below change
    nothing when the dtypes already match (a bf16 base under bf16 autocast, the CUDA default):

    - quanto's quantized linear (`QuantizedLinearFunction`, the autograd function of every QLinear) computes
      its forward under autocast, so a layer without bias returns bf16, but its backward runs outside autocast
      and multiplies that bf16 gradient with the weight, dequantized to the weight's float32: "expected m1 and
      m2 to have the same dtype". On any device. The gradient is brought to the weight's dtype first.
    - on the CPU, quanto's qint8 matmul sends bf16 activations to `torch._weight_int8pack_mm`, which needs the
      scales in the activations' dtype too, and the float32 scales fail: "expected scalar type BFloat16 but
      found Float". Such a call takes quanto's generic path instead (dequantize, then matmul, where autocast
      applies), the one it takes on CUDA. So do the calls that kernel would crash on (`int8pack_mm_takes`)."""
    from optimum.quanto.library import qbytes_mm as kernels
    from optimum.quanto.tensor.function import QuantizedLinearFunction

    backward = QuantizedLinearFunction.backward
    if not getattr(backward, "difftune_guard", False):

        def backward_in_weight_dtype(ctx, grad_output: torch.Tensor):
            """quanto's own backward (0.2.7), with the gradient brought to the weight's dtype first. Written out
            rather than wrapped: the dtype is known only from the saved tensors, and under gradient checkpointing
            those unpack once, so a wrapper that looked at them would break quanto's own unpacking."""
            input, other = ctx.saved_tensors
            if grad_output.dtype != other.dtype:
                grad_output = grad_output.to(other.dtype)  # the engine brings the input's gradient back
            input_grad = other_grad = bias_grad = None
            out_features, in_features = other.shape
            if ctx.needs_input_grad[0]:
                input_grad = torch.matmul(grad_output, other)
            if ctx.needs_input_grad[1]:
                other_grad = torch.matmul(grad_output.view(-1, out_features).t(), input.view(-1, in_features))
            if ctx.needs_input_grad[2]:
                bias_grad = grad_output.sum(tuple(range(grad_output.ndim - 1)))
            return input_grad, other_grad, bias_grad

        backward_in_weight_dtype.difftune_guard = True
        backward_in_weight_dtype.__wrapped_original__ = backward
        # every quantized linear function (qint8/qfloat8, qint4, Marlin, ...) inherits this backward
        QuantizedLinearFunction.backward = backward_in_weight_dtype

    int8pack_mm = kernels.qbytes_int8pack_mm
    if not getattr(int8pack_mm, "difftune_guard", False):

        def int8pack_mm_of_one_dtype(activations, weights, output_scales):
            if not int8pack_mm_takes(activations, output_scales):
                return kernels.qbytes_mm(activations, weights, output_scales)
            return int8pack_mm(activations, weights, output_scales)

        int8pack_mm_of_one_dtype.difftune_guard = True
        int8pack_mm_of_one_dtype.__wrapped_original__ = int8pack_mm
        # quanto's CPU kernel looks this name up in its module when it runs
        kernels.qbytes_int8pack_mm = int8pack_mm_of_one_dtype


def int8pack_mm_takes(activations: torch.Tensor, output_scales: torch.Tensor) -> bool:
    """Whether torch's CPU `_weight_int8pack_mm` (quanto's qint8 matmul on the CPU) can take these: the scales in the
    activations' dtype, and, for activations below float32, an inner dimension (the layer's in_features) that is a
    multiple of 16. In torch 2.14.1 bf16 activations of any other width end the process with a segmentation fault
    (tried: 8, 24, 40, 56 crash; 16, 32, 48, 64, 80 run; float32 runs at every width). Full-size models' widths are
    multiples of 16; tiny ones' and some projections' need not be."""
    if activations.dtype != output_scales.dtype:
        return False
    return activations.dtype == torch.float32 or activations.shape[-1] % 16 == 0


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_qtype(dtype: torch.dtype):
    from optimum.quanto import qfloat8_e4m3fn, qfloat8_e5m2

    return {torch.float8_e4m3fn: qfloat8_e4m3fn, torch.float8_e5m2: qfloat8_e5m2}[dtype]


def stored_linear(linear: torch.nn.Linear, weight: torch.Tensor, row_scale: torch.Tensor | None,
                  bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A quanto QLinear holding an fp8 weight as stored (`weight` bytes, `row_scale` or 1 per row, in `dtype`): an fp8
    file's layer, never upcast (toolkit/models/stored_weights.py). quanto has no way to take already-quantized bytes
    as they are; the layer is made of its own classes, so the rest (matmul, a LoRA's backward, its size) is quanto's."""
    from optimum.quanto.nn import QLinear
    from optimum.quanto.tensor.weights.qbytes import WeightQBytesTensor

    keep_qfloat8_off_marlin()
    keep_quantized_linear_dtypes_matched()
    qtype = fp8_qtype(weight.dtype)
    module = QLinear.qcreate(linear, qtype, None, None, device="meta").to_empty(device=device)
    module.input_scale = torch.ones_like(module.input_scale)
    module.output_scale = torch.ones_like(module.output_scale)
    rows = weight.shape[0]
    scale = (row_scale if row_scale is not None else torch.ones(rows)).reshape(rows, 1).to(device, dtype)
    data = weight.to(device).contiguous()
    quantized = WeightQBytesTensor.create(qtype, 0, data.shape, data.stride(), data, scale)
    module.weight = torch.nn.Parameter(quantized, requires_grad=False)
    module.bias = None if bias is None else torch.nn.Parameter(bias.to(device, dtype), requires_grad=False)
    return module


def dequantized(tensor: torch.Tensor, row_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 tensor as the compute dtype sees it: the stored values (times their scale) in `dtype`."""
    value = tensor.to(dtype)
    if row_scale is None:
        return value
    return value * row_scale.reshape((-1,) + (1,) * (tensor.dim() - 1)).to(dtype)


def quanto_qtype(name: str):
    """The quanto weight type for a config name (`qfloat8`, `qint8`, `qint4`)."""
    if name not in QTYPES:
        raise ValueError(f"unknown qtype {name!r}; choose one of {', '.join(QTYPES)}")
    return QTYPES[name]


def quantize_blockwise(
    model: torch.nn.Module,
    qtype: str,
    blocks: Iterable[torch.nn.Module] | None = None,
    exclude: list[str] | None = None,
    device: torch.device | str | None = None,
    keep_quantized: bool = False,
) -> torch.nn.Module:
    """Quantize and freeze `model`'s weights in place, one block at a time, and return it.

    Each block (e.g. each transformer layer, a submodule of `model`) is moved to `device` and quantized
    there, and stays there: the accelerator then holds the quantized blocks plus one full-precision block,
    never the whole full-precision model. Quantizing on the accelerator is also much faster than on the
    CPU. Modules outside `blocks` are quantized afterwards where they live, and the caller decides where
    they go. `exclude` holds fnmatch patterns over names in `model` (quanto's `exclude=`); matching modules
    (embedders, final layers) keep full precision. `device=None` quantizes every block where it lives.
    `keep_quantized`: layers already quantized (an fp8 file's layers, kept as stored) stay as they are and the rest
    is quantized; otherwise a model with quantized layers is refused.
    """
    weights = quanto_qtype(qtype)
    keep_qfloat8_off_marlin()
    keep_quantized_linear_dtypes_matched()
    exclude = list(exclude or [])
    quantized = [glob.escape(name) for name, module in model.named_modules() if isinstance(module, QModuleMixin)]
    if quantized and not keep_quantized:
        raise ValueError(f"{type(model).__name__} is already quantized; quantize a full-precision model once")
    exclude += quantized
    names = block_names(model, blocks or [])
    for name in names:
        if device is not None:
            safe_module_to_device(model.get_submodule(name), device)
        quantize(model, weights=weights, include=subtree_patterns(name), exclude=exclude)
        # Freezing right away replaces the float weights by quantized ones, so they are freed before the
        # next block arrives.
        freeze_new(model.get_submodule(name))
        trim_host_heap()
    done = [pattern for name in names for pattern in subtree_patterns(name)]
    quantize(model, weights=weights, exclude=exclude + done)
    freeze_new(model)
    return model


def freeze_new(model: torch.nn.Module) -> None:
    """quanto's `freeze`, skipping frozen modules: it would wrap their weights in new Parameters again."""
    for module in model.modules():
        if isinstance(module, QModuleMixin) and not module.frozen:
            module.freeze()


def block_names(model: torch.nn.Module, blocks: Iterable[torch.nn.Module]) -> list[str]:
    """The qualified names of `blocks` in `model`, in the given order.

    Names rather than module objects because quanto replaces quantized submodules (a block that is itself
    a Linear becomes a new QLinear), so the name is what stays valid.
    """
    name_of = {id(module): name for name, module in model.named_modules() if name}
    names = []
    for block in blocks:
        if id(block) not in name_of:
            raise ValueError(f"block {type(block).__name__} is not a submodule of {type(model).__name__}")
        names.append(name_of[id(block)])
    return names


def subtree_patterns(name: str) -> list[str]:
    """fnmatch patterns for a module and everything under it (and not `layers.10` for `layers.1`)."""
    escaped = glob.escape(name)
    return [escaped, f"{escaped}.*"]


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes `module`'s parameters and buffers occupy as stored, each shared tensor once.

    A quanto QTensor counts by what it holds (int8/float8 data or packed 4-bit data, plus scales and
    shifts), not by its dequantized size, which is what `numel() * element_size()` would give.
    """
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(stored_bytes(tensor) for tensor in tensors)


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor; a tensor subclass (QTensor, quanto's PackedTensor) by its inner tensors."""
    if hasattr(tensor, "__tensor_flatten__"):
        inner_names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in inner_names]
        return sum(stored_bytes(part) for part in inner if part is not None)
    return tensor.numel() * tensor.element_size()


# ---- loading a quantized model without ever holding it in full precision --------------------------------------


def weight_files(folder: Path, variant: str | None = None) -> list[Path]:
    """The safetensors weight files of a diffusers model folder (sharded or not, of `variant` if given)."""
    suffix = f".{variant}.safetensors" if variant else ".safetensors"
    index = sorted(folder.glob("*.safetensors.index.json" if not variant else f"*.safetensors.index.{variant}.json"))
    if index:
        shards = sorted(set(json.loads(index[0].read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = [path for path in sorted(folder.glob(f"*{suffix}"))
             if variant or path.name.count(".") == 1]  # `x.fp16.safetensors` is another variant's
    if not files:
        raise FileNotFoundError(f"no {suffix.lstrip('.')} weights in {folder}")
    return files


class StreamedWeights:
    """Where each tensor of a model's weight files lives: {state-dict name: (file, name in the file)}. Files may
    carry a common prefix (e.g. ComfyUI's `model.diffusion_model.`), which `strip` removes. ComfyUI's scaled-fp8
    bookkeeping (markers, input scales, formats) is left out, and each weight scale is kept apart (`scales`)."""

    def __init__(self, files: list[Path], strip: tuple[str, ...] = ()):
        from toolkit.models.single_files import (
            INPUT_SCALE_SUFFIXES,
            QUANT_CONFIG_SUFFIX,
            SCALED_FP8_MARKER,
            WEIGHT_SCALE_SUFFIXES,
        )

        self.location: dict[str, tuple[Path, str]] = {}
        #: {weight name: (file, name of its scale in the file)} (scaled fp8)
        self.scales: dict[str, tuple[Path, str]] = {}
        for path in files:
            with safe_open(str(path), "pt") as handle:
                for key in handle.keys():
                    name = next((key[len(p):] for p in strip if key.startswith(p)), key)
                    if name.endswith(WEIGHT_SCALE_SUFFIXES):
                        self.scales[name.rsplit(".", 1)[0] + ".weight"] = (path, key)
                    elif not name.endswith(INPUT_SCALE_SUFFIXES + (QUANT_CONFIG_SUFFIX, SCALED_FP8_MARKER)):
                        self.location[name] = (path, key)

    def read(self, names: list[str], dtype: torch.dtype, device: torch.device | str,
             as_stored: bool = False) -> dict[str, torch.Tensor]:
        """The named tensors, in `dtype` (floating point only; with `as_stored`, fp8 tensors stay fp8) on `device`;
        each file is opened for the read and closed after, so that no mapping of the whole file stays resident."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.location[name][0], []).append(name)
        tensors = {}
        for path, in_file in by_file.items():
            with safe_open(str(path), "pt") as handle:
                for name in in_file:
                    tensor = handle.get_tensor(self.location[name][1])
                    cast = dtype if tensor.is_floating_point() and not (as_stored and is_fp8(tensor)) else None
                    if is_fp8(tensor) and cast is not None:  # the stored values times their scale
                        tensor = dequantized(tensor, self.scale(name), dtype)
                    # a copy, even where dtype and device already match: a tensor kept as read would keep the
                    # whole file mapped, and every page of it read so far resident
                    tensors[name] = tensor.to(device, cast, copy=True)
        return tensors

    def scale(self, name: str) -> torch.Tensor:
        """A stored fp8 weight's scale per output row (float32; 1 for an unscaled fp8 file)."""
        if name not in self.scales:
            return torch.ones(1)
        path, key = self.scales[name]
        with safe_open(str(path), "pt") as handle:
            return handle.get_tensor(key).float().reshape(-1)

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows `start:stop` (of dim 0) of one tensor, in `dtype` (floating point only), on the CPU: only those rows
        are read from the file (a sharded process's part of a weight)."""
        path, key = self.location[name]
        with safe_open(str(path), "pt") as handle:
            part = handle.get_slice(key)
            shape = part.get_shape()
            tensor = part[start:stop] if shape else handle.get_tensor(key)
            return tensor.to("cpu", dtype if tensor.is_floating_point() else None, copy=True)


def load_quantized(empty_model: torch.nn.Module, weights: StreamedWeights, dtype: torch.dtype, qtype: str | None,
                   blocks: list[str], exclude: list[str], device: torch.device | str, source: str) -> torch.nn.Module:
    """Fill `empty_model` (built on the meta device) from `weights` and quantize it, block by block and within a
    block layer by layer: each layer's tensors are read in `dtype` straight onto `device` and quantized and frozen
    there before the next layer is read, so neither host nor accelerator ever holds more than the quantized model
    plus one full-precision layer (and the quantizer's temporaries for it).

    diffusers' own quanto loading (`QuantoConfig`) reads a whole weight shard (about 5 GB for the big DiTs) into
    host memory first and quantizes where the tensors land; this keeps peak memory at one layer and quantizes on
    the accelerator. `blocks` are module names; the rest of the model (embedders, final layers, norms) is read
    last, with `exclude` (fnmatch patterns over module names) kept in full precision. `qtype` None reads the model
    the same way without quantizing it. An fp8 file's Linear weights are kept as stored (its bytes and scales, as
    quanto qfloat8 layers: toolkit/models/stored_weights.py), quantized or not; its other fp8 tensors are
    dequantized into `dtype`."""
    from accelerate.utils import set_module_tensor_to_device

    weights_type = quanto_qtype(qtype) if qtype else None
    keep_qfloat8_off_marlin()
    keep_quantized_linear_dtypes_matched()
    device = torch.device(device)
    if device.type == "cpu":  # `cpu:0` (a multi-process CPU run's device) would make accelerate copy each Parameter
        device = torch.device("cpu")  # into a plain tensor
    expected = set(empty_model.state_dict())
    missing = sorted(expected - set(weights.location))
    unexpected = sorted(set(weights.location) - expected)
    if missing or unexpected:
        detail = [f"missing {len(missing)} tensors (e.g. {missing[0]})"] if missing else []
        detail += [f"{len(unexpected)} tensors the model does not have (e.g. {unexpected[0]})"] if unexpected else []
        raise ValueError(f"{source}: the weights do not fit {type(empty_model).__name__}'s config: "
                         f"{'; '.join(detail)}")
    done: set[str] = set()
    stored_layers: list[str] = []

    def fill(names: list[str]) -> None:
        tensors = weights.read(names, dtype, device, as_stored=True)
        for name, tensor in list(tensors.items()):
            layer = name.rpartition(".")[0]
            if is_fp8(tensor) and name.endswith(".weight") and type(empty_model.get_submodule(layer)) is torch.nn.Linear:
                # an fp8 file's Linear layer, kept as stored
                parent, _, child = layer.rpartition(".")
                linear = empty_model.get_submodule(layer)
                bias = tensors.pop(f"{layer}.bias", None)
                if bias is None and linear.bias is not None:
                    bias = weights.read([f"{layer}.bias"], dtype, device)[f"{layer}.bias"]
                    done.add(f"{layer}.bias")
                replacement = stored_linear(linear, tensors.pop(name), weights.scale(name).expand(tensor.shape[0]),
                                            bias, dtype, device)
                setattr(empty_model.get_submodule(parent) if parent else empty_model, child, replacement)
                stored_layers.append(layer)
        for name, tensor in tensors.items():
            if is_fp8(tensor):  # outside a Linear layer: dequantized
                tensor = dequantized(tensor, weights.scale(name), dtype)
            # clear_cache off: accelerate would empty the CUDA cache for every tensor
            set_module_tensor_to_device(empty_model, name, device, value=tensor, dtype=tensor.dtype, clear_cache=False)
        done.update(names)

    for block in blocks:
        if weights_type is None:  # read one block at a time, nothing quantized
            fill(sorted(n for n in expected - done if n.startswith(block + ".")))
            continue
        block_module = empty_model.get_submodule(block)
        for name, layer in list(block_module.named_modules()):
            full = f"{block}.{name}"
            if not isinstance(layer, QUANTIZABLE) or any(fnmatch(full, pattern) for pattern in exclude):
                continue
            fill(sorted(n for n in expected - done if n.rpartition(".")[0] == full))
            if full in stored_layers:  # an fp8 file's layer: kept as stored, not quantized again
                continue
            quantize(block_module, weights=weights_type, include=[glob.escape(name)])
            freeze(block_module.get_submodule(name))
            trim_host_heap()  # the layer's full-precision tensors and the quantizer's temporaries
        fill(sorted(n for n in expected - done if n.startswith(block + ".")))  # norms, unquantized layers
    fill(sorted(expected - done))
    if weights_type is not None:
        quantize(empty_model, weights=weights_type, exclude=exclude + [p for b in blocks for p in subtree_patterns(b)]
                 + [glob.escape(layer) for layer in stored_layers])
        freeze_new(empty_model)
    empty_model.requires_grad_(False)
    return empty_model.eval()
