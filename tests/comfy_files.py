"""Tiny models written as ComfyUI keeps a base: its folders (`models/diffusion_models`, `models/text_encoders`,
`models/vae`), its file layouts (original names, fused tensors), its storage (bf16/float32, fp8, and both scaled-fp8
layouts) and its source tree's tokenizer folders, for the single-file tests.

diffusers reads these layouts but does not write them; the inverse conversions here are the tests' own."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ldm_format import convert_vae
from toolkit.models.flux.layout import DOUBLE, DOUBLE_NORMS, DOUBLE_QKV, GLOBAL, SINGLE, SINGLE_NORMS

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def flux_original_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers FluxTransformer2DModel state dict in BFL's names (as ComfyUI and BFL store it): q/k/v fused, each
    single block's q, k, v and MLP input fused into `linear1`, the final modulation's halves as shift, scale."""
    source = dict(state)
    out = {}

    def move(new: str, old: str) -> None:
        for suffix in (".weight", ".bias"):
            if new + suffix in source:
                out[old + suffix] = source.pop(new + suffix)

    for old, new in GLOBAL.items():
        move(new, old)
    for suffix in (".weight", ".bias"):
        scale, shift = source.pop("norm_out.linear" + suffix).chunk(2, dim=0)
        out["final_layer.adaLN_modulation.1" + suffix] = torch.cat([shift, scale])
    doubles = sorted({int(k.split(".")[1]) for k in source if k.startswith("transformer_blocks.")})
    for i in doubles:
        new, old = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for a, b in DOUBLE.items():
            move(new + b, old + a)
        for a, b in DOUBLE_NORMS.items():
            out[old + a] = source.pop(new + b)
        for fused, parts in DOUBLE_QKV.items():
            for suffix in (".weight", ".bias"):
                out[old + fused + suffix] = torch.cat([source.pop(new + p + suffix) for p in parts])
    singles = sorted({int(k.split(".")[1]) for k in source if k.startswith("single_transformer_blocks.")})
    for i in singles:
        new, old = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for a, b in SINGLE.items():
            move(new + b, old + a)
        for a, b in SINGLE_NORMS.items():
            out[old + a] = source.pop(new + b)
        for suffix in (".weight", ".bias"):
            out[old + "linear1" + suffix] = torch.cat([source.pop(new + p + suffix)
                                                       for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")])
    assert not source, sorted(source)
    return out


def is_matrix(name: str, tensor: torch.Tensor) -> bool:
    """What ComfyUI's fp8 files store in fp8: the 2-D weights (biases, norms and embeddings' vectors stay)."""
    return name.endswith(".weight") and tensor.dim() == 2


def stored(state: dict[str, torch.Tensor], storage: str) -> dict[str, torch.Tensor]:
    """`state` as a file of `storage` holds it: `float32`/`bf16`: cast; `fp8`: 2-D weights cast to float8_e4m3fn;
    `scaled_fp8`: ComfyUI's older layout (`scaled_fp8` marker, per-tensor `scale_weight`, amax / 448); `comfy_quant`:
    its newer one (`weight_scale`, `input_scale`, the format as JSON bytes in `comfy_quant`)."""
    if storage in ("float32", "bf16"):
        dtype = torch.float32 if storage == "float32" else torch.bfloat16
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    out = {}
    for name, tensor in state.items():
        if not is_matrix(name, tensor):
            out[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            continue
        layer = name[: -len(".weight")]
        if storage == "fp8":
            out[name] = tensor.to(FP8)
            continue
        scale = (tensor.abs().max().float() / FP8_MAX).clamp(min=1e-12)
        out[name] = (tensor.float() / scale).to(FP8)
        if storage == "scaled_fp8":
            out[f"{layer}.scale_weight"] = scale.reshape(())
        else:
            out[f"{layer}.weight_scale"] = scale.reshape(())
            out[f"{layer}.input_scale"] = torch.tensor(1.0)
            out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                       dtype=torch.uint8)
    if storage == "scaled_fp8":
        out["scaled_fp8"] = torch.empty(0, dtype=FP8)
    return out


def dequantized_state(path: Path, prefix: str = "", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A stored file's tensors as ComfyUI computes with them: fp8 values times their scale, both in the compute dtype
    (`x.to(dtype) * scale.to(dtype)`, as ComfyUI's fp8 layout dequantizes)."""
    raw = load_file(str(path))
    out = {}
    for name, tensor in raw.items():
        if not name.startswith(prefix) or name.endswith(("scale_weight", "weight_scale", "input_scale", "comfy_quant",
                                                          "scaled_fp8")):
            continue
        value = tensor.to(dtype)
        layer = name[: -len(".weight")]
        for scale_name in (f"{layer}.scale_weight", f"{layer}.weight_scale"):
            if name.endswith(".weight") and scale_name in raw:
                value = value * raw[scale_name].to(dtype)
        out[name[len(prefix):]] = value
    return out


def write_gguf(state: dict[str, torch.Tensor], path: Path, arch: str) -> Path:
    """`state` as a GGUF file as ComfyUI-GGUF's converter writes one: 2-D weights whose rows are whole Q8_0 blocks
    quantized to Q8_0, the rest float32; `general.architecture` is `arch`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    for name, tensor in state.items():
        array = tensor.float().numpy()
        if is_matrix(name, tensor) and tensor.shape[1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_dequantized(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A GGUF file's tensors as the compute dtype sees them (diffusers' dequantization, then `dtype`)."""
    from diffusers.models.model_loading_utils import load_gguf_checkpoint
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    out = {}
    for name, tensor in load_gguf_checkpoint(str(path)).items():
        if type(tensor).__name__ == "GGUFParameter":
            tensor = torch.Tensor._make_subclass(torch.Tensor, dequantize_gguf_tensor(tensor))
        out[name] = tensor.to(dtype)
    return out


def write_tokenizer_tree(root: Path, tokenizers: dict[str, object]) -> Path:
    """A ComfyUI source tree holding tokenizers where ComfyUI keeps them ({`comfy/...` folder: tokenizer})."""
    for folder, tokenizer in tokenizers.items():
        tokenizer.save_pretrained(str(root / folder))
    return root


def write_flux_comfy(adapter, root: Path, storage: str = "float32", prefix: str = "") -> dict[str, Path]:
    """A loaded tiny FLUX.1-layout adapter written as a ComfyUI installation at `root`: the transformer in BFL's names
    (under `prefix`), clip_l (with the projection ComfyUI's file keeps), t5xxl (without the tied embedding copy) and
    ae.safetensors in the original VAE names, each part stored as `storage` (the VAE in float32), and the two
    tokenizers in the source tree. Returns the files by part."""
    models = root / "models"
    paths = {"transformer": models / "diffusion_models" / f"flux_{storage}.safetensors",
             "clip_l": models / "text_encoders" / "clip_l.safetensors",
             "t5xxl": models / "text_encoders" / f"t5xxl_{storage}.safetensors",
             "vae": models / "vae" / "ae.safetensors"}
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    transformer = flux_original_layout(plain(adapter.transformer))
    if storage == "gguf":
        paths["transformer"] = write_gguf({prefix + k: v for k, v in transformer.items()},
                                          paths["transformer"].with_suffix(".gguf"), "flux")
        storage = "float32"  # the other parts
    else:
        save_file(contiguous({prefix + k: v for k, v in stored(transformer, storage).items()}),
                  str(paths["transformer"]))
    clip = {f"text_model.{k}": v for k, v in plain(adapter.text_encoder).items()}
    width = clip["text_model.final_layer_norm.weight"].shape[0]
    clip["text_projection.weight"] = torch.zeros(width, width)
    save_file(contiguous(stored(clip, "float32")), str(paths["clip_l"]))
    t5 = {k: v for k, v in plain(adapter.text_encoder_2).items() if k != "encoder.embed_tokens.weight"}
    save_file(contiguous(stored(t5, storage)), str(paths["t5xxl"]))
    vae = {k[len("first_stage_model."):]: v
           for k, v in convert_vae(plain(adapter.vae), dict(adapter.vae.config)).items()}
    save_file(contiguous(vae), str(paths["vae"]))
    write_tokenizer_tree(root, {"comfy/sd1_tokenizer": adapter.tokenizer,
                                "comfy/text_encoders/t5_tokenizer": adapter.tokenizer_2})
    return paths


def plain(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in state.items()}
