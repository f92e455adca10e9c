"""A model part loaded from a single file as its weights are stored: names converted to diffusers' (or
transformers') by the family's converter, fp8 weights (ComfyUI's plain and "scaled" fp8 files) kept in fp8, GGUF
weights kept quantized.

An fp8 Linear weight becomes an optimum-quanto qfloat8 weight made of the stored bytes and the file's scale (1 for a
plain fp8 file), never upcast first: a layer computes with the stored weight dequantized in the compute dtype (the
bytes times the scale), which is how ComfyUI computes with such a file, and a LoRA trains on top as on any quantized
base (toolkit/quantize.py). quanto lacks a way to take already-quantized bytes as they are; the layer is built from
its own classes (`WeightQBytesTensor`), so everything else about it (matmul, the LoRA's backward, its size) is
quanto's. Other fp8 tensors (convolutions, embeddings, norms: a small part) are dequantized into the compute dtype.

A GGUF file (read by diffusers' `load_gguf_checkpoint`) keeps its quantized Linear weights as diffusers' GGUFLinear
(dequantized into the compute dtype at each call, as ComfyUI-GGUF computes); diffusers' own GGUF loading goes through
its single-file converters, which assume the full-size widths for some families (FLUX.1), hence this path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolkit.errors import UserError
from toolkit.quantize import dequantized, stored_linear
from toolkit.models.single_files import (
    INPUT_SCALE_SUFFIXES,
    QUANT_CONFIG_SUFFIX,
    SCALED_FP8_MARKER,
    WEIGHT_SCALE_SUFFIXES,
    pickled_tensors,
)

#: pickled checkpoints (read mapped, tensors only)
PICKLED = (".ckpt", ".pt", ".pth")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

#: a converter: the part's tensors under the file's names -> the same tensors under the model's names
Converter = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass
class StoredState:
    """A part's tensors as stored (names without the file's prefix), and each fp8 weight's scale per output row
    (float32; every row the same for ComfyUI's per-tensor scales)."""

    tensors: dict[str, torch.Tensor]
    row_scales: dict[str, torch.Tensor] = field(default_factory=dict)


def read_stored(path: str | Path, prefix: str = "", skip: tuple[str, ...] = ()) -> StoredState:
    """The tensors of `path` under `prefix` (removed), in their stored dtypes, with scaled-fp8 scales taken out; those
    whose names (the prefix removed) start with `skip` are not read (another model's part of the file). A file that
    does not read (damaged, cut short) is named."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        if path.suffix == ".gguf":
            from diffusers.models.model_loading_utils import load_gguf_checkpoint

            return StoredState({k[len(prefix):]: v for k, v in load_gguf_checkpoint(str(path)).items()
                                if k.startswith(prefix)})
        wanted = lambda key: key.startswith(prefix) and not key[len(prefix):].startswith(skip)  # noqa: E731
        if path.suffix in PICKLED:
            tensors = {k[len(prefix):]: v for k, v in pickled_tensors(path).items() if wanted(k)}
            return split_scales(tensors, path)
        with safe_open(str(path), "pt") as handle:
            tensors = {key[len(prefix):]: handle.get_tensor(key) for key in handle.keys() if wanted(key)}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:  # a damaged or cut-short file
        raise UserError(f"{path}: the weights cannot be read ({error})") from None
    return split_scales(tensors, path)


def split_scales(tensors: dict[str, torch.Tensor], path: Path | str = "") -> StoredState:
    """ComfyUI's scaled-fp8 layouts taken apart: the older one (a `scaled_fp8` marker, `<layer>.scale_weight`,
    `<layer>.scale_input`) and the newer one (`<layer>.weight_scale`, `<layer>.input_scale`, and the layer's format as
    JSON bytes in `<layer>.comfy_quant`). Markers, formats and input scales are dropped; each weight scale becomes its
    weight's per-row scale. A layer in a format other than fp8 (nvfp4) is refused by name. A scale without its weight,
    or a weight scale that is not one number, is named."""
    tensors = dict(tensors)
    for name in [n for n in tensors if n == SCALED_FP8_MARKER or n.endswith("." + SCALED_FP8_MARKER)]:
        del tensors[name]
    for name in [n for n in tensors if n.endswith(QUANT_CONFIG_SUFFIX)]:
        layer_format = json.loads(bytes(tensors.pop(name).tolist()).decode("utf-8")).get("format", "")
        if layer_format not in ("float8_e4m3fn", "float8_e5m2"):
            raise UserError(f"{path}: {name} stores its layer as {layer_format or 'an unnamed format'}; difftune reads "
                            "fp8 (float8_e4m3fn, float8_e5m2) layers, not this one")
    row_scales = {}
    for name in [n for n in tensors if n.endswith(INPUT_SCALE_SUFFIXES)]:
        del tensors[name]
    for name in [n for n in tensors if n.endswith(WEIGHT_SCALE_SUFFIXES)]:
        scale = tensors.pop(name)
        weight_name = name.rsplit(".", 1)[0] + ".weight"
        weight = tensors.get(weight_name)
        if weight is None:
            raise UserError(f"{path}: {name} scales a weight the file does not have ({weight_name})")
        if scale.numel() != 1 and scale.numel() != weight.shape[0]:
            raise UserError(f"{path}: {name} has {scale.numel()} values; difftune reads a scale per tensor or per "
                            f"output row ({weight.shape[0]})")
        row_scales[weight_name] = scale.float().reshape(-1).expand(weight.shape[0]).clone()
    return StoredState(tensors, row_scales)


def convert(state: StoredState, converter: Converter | None) -> StoredState:
    """`converter` applied to the tensors, and to the scales alike: each scale rides on a tensor with its weight's
    rows (dim 0) and nothing else, so whatever the converter does to rows (split fused q/k/v, join, reorder) it does to
    the scales, and each converted weight gets the scales of the rows it was made of."""
    if converter is None:
        return state
    tensors = converter(dict(state.tensors))
    if not state.row_scales:
        return StoredState(tensors)
    carriers = {}
    for name, tensor in state.tensors.items():
        rows = tensor.shape[0] if tensor.dim() else 1
        scale = state.row_scales.get(name, torch.ones(rows))
        carriers[name] = scale.reshape((rows,) + (1,) * max(tensor.dim() - 1, 0)) if tensor.dim() else scale[0]
    carried = converter(carriers)
    row_scales = {name: carried[name].reshape(-1).clone() for name, tensor in tensors.items()
                  if tensor.dtype in FP8_DTYPES}
    return StoredState(tensors, row_scales)


def is_gguf(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "GGUFParameter"


def gguf_linear(linear: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device) -> torch.nn.Module:
    """diffusers' GGUFLinear holding a GGUF file's quantized weight as stored: each call dequantizes it into `dtype`
    (`compute_dtype`), which is how ComfyUI-GGUF computes with the same file."""
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    module = GGUFLinear(linear.in_features, linear.out_features, bias is not None, compute_dtype=dtype,
                        device="meta")
    module.weight = GGUFParameter(weight.as_tensor().to(device), quant_type=weight.quant_type)
    module.bias = None if bias is None else torch.nn.Parameter(bias.to(device, dtype), requires_grad=False)
    module.requires_grad_(False)
    return module


def fill_stored(model: torch.nn.Module, state: StoredState, dtype: torch.dtype, device: torch.device | str,
                source: str, optional: tuple[str, ...] = (), keep_fp8: bool = True) -> torch.nn.Module:
    """Fill `model` (built on the meta device) from a part's converted tensors: fp8 Linear weights kept as stored
    (`stored_linear`) when `keep_fp8`, everything else in `dtype` (the modules its library keeps in float32, in
    float32: `float32_modules`). Missing tensors are named, except those ending in `optional` (tied weights the
    model ties itself); tensors the model has no place for are named too."""
    from accelerate.utils import set_module_tensor_to_device

    device = torch.device(device)
    if device.type == "cpu":
        device = torch.device("cpu")
    tensors = dict(state.tensors)
    expected = set(model.state_dict())
    missing = sorted(n for n in expected - set(tensors) if not n.endswith(optional))
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        detail = [f"missing {len(missing)} tensors (e.g. {missing[0]})"] if missing else []
        detail += [f"{len(unexpected)} tensors the model does not have (e.g. {unexpected[0]})"] if unexpected else []
        raise UserError(f"{source}: the weights do not fit {type(model).__name__}'s config: {'; '.join(detail)}")
    keep_fp32 = float32_modules(model, dtype)
    for name, module in list(model.named_modules()):
        weight = tensors.get(f"{name}.weight")
        if type(module) is not torch.nn.Linear or weight is None:
            continue
        if is_gguf(weight):
            replacement = gguf_linear(module, tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.bias", None), dtype,
                                      device)
        elif keep_fp8 and weight.dtype in FP8_DTYPES:
            replacement = stored_linear(module, tensors.pop(f"{name}.weight"), state.row_scales.get(f"{name}.weight"),
                                        tensors.pop(f"{name}.bias", None), dtype, device)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, replacement)
    for name, tensor in tensors.items():
        wanted = torch.float32 if keep_fp32 & set(name.split(".")) else dtype
        if is_gguf(tensor):  # a quantized tensor outside a Linear layer (a convolution, an embedding): dequantized
            from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

            tensor = torch.Tensor._make_subclass(torch.Tensor, dequantize_gguf_tensor(tensor)).to(wanted)
        elif tensor.dtype in FP8_DTYPES:
            tensor = dequantized(tensor, state.row_scales.get(name), wanted)
        elif tensor.is_floating_point():
            tensor = tensor.to(wanted)
        set_module_tensor_to_device(model, name, device, value=tensor, dtype=tensor.dtype, clear_cache=False)
    model.requires_grad_(False)
    return model.eval()


def float32_modules(model: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """The module names a model keeps in float32 whatever it is loaded in, by its library's own rule: diffusers'
    `_keep_in_fp32_modules` always; transformers' `_keep_in_fp32_modules` in float16 only, and
    `_keep_in_fp32_modules_strict` in float16 and bf16 (T5's `wo` stays bf16 in a bf16 load)."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    if not hasattr(model, "_keep_in_fp32_modules_strict"):  # a diffusers model
        return keep
    strict = set(model._keep_in_fp32_modules_strict or [])
    return keep | strict if dtype == torch.float16 else strict if dtype == torch.bfloat16 else set()


def empty_model(build: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
    """A model built on the meta device in `dtype` (no weight made), for `fill_stored`; buffers are made on the CPU
    as construction makes them (rotary tables, position ids)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


# ---- a part from its file ----------------------------------------------------------------------------------------


def load_part(path: str, kind, component: str, build: Callable[[dict], torch.nn.Module], dtype: torch.dtype,
              device: torch.device | str, converter: Callable | None = None, key: str = "model.name_or_path",
              config: dict | None = None, ignore: tuple[str, ...] = (), optional: tuple[str, ...] = (),
              skip: tuple[str, ...] = ()):
    """One part (`component` of the pipeline: transformer, text_encoder, vae) from a single file: which variant of
    `kind` it is (from its names and shapes), the model built from that variant's shipped config (or `config`, from
    `model.single_file_config`; the variant is then None where it is of no known one), its tensors converted
    (`converter(part names, config)` gives the converter for the file's layout, or None for names already the
    model's) and loaded as stored; tensors whose names start with `skip` (another model's, in the same file) are not
    read, those ending in `ignore` are dropped."""
    from toolkit.models.single_files import UnknownFile, read_header

    header = read_header(path)
    try:
        part, variant = kind.variant(header)
    except UnknownFile:
        if config is None:
            raise
        part, variant = header.part(kind.prefixes), None  # the configs come from `single_file_config`
    config = config if config is not None else variant.config(component)
    model = empty_model(lambda: build(config), dtype)
    state = read_stored(path, part.prefix, skip)
    for name in [n for n in state.tensors if n.endswith(ignore)]:
        del state.tensors[name]
    state = convert(state, converter(part, config) if converter else None)
    fill_stored(model, state, dtype, device, f"{key} {path}", optional=optional)
    return LoadedPart(model, variant, part.storage)


@dataclass
class LoadedPart:
    """A part loaded from its file: the model, the variant it was read as (None: configs from
    `single_file_config`), and how its weights are stored (`bf16`, `scaled fp8`, `gguf Q8_0`, ...)."""

    model: torch.nn.Module
    variant: object
    storage: str

    def origin(self, path: str) -> str:
        title = self.variant.title if self.variant is not None else "configs of model.single_file_config"
        return f"{path} ({title}, {self.storage})"


def assign_files(paths: list[str], kinds: dict, key: str) -> dict[str, str]:
    """Which of a family's part slots ({slot: PartKind}) each file is, from its names and shapes: {slot: path}. A file
    of no slot, two files of one slot, and a slot without a file are named."""
    from toolkit.models.single_files import detect, read_header

    found: dict[str, str] = {}
    for path in paths:
        header = read_header(path)
        match = detect(header, [kinds[slot] for slot in kinds])
        if match is None:
            titles = " or ".join(k.title for k in kinds.values())
            raise UserError(f"{key}: {path} is not a {titles} file")
        slot = next(slot for slot, k in kinds.items() if k is match[0])
        if slot in found:
            raise UserError(f"{key}: {found[slot]} and {path} are both a {match[0].title}; give one of each")
        found[slot] = path
    missing = [kinds[slot].title for slot in kinds if slot not in found]
    if missing:
        raise UserError(f"{key}: no {' or '.join(missing)} among {', '.join(paths)}; this family takes one file "
                        f"each of: {', '.join(k.title for k in kinds.values())}")
    return found
