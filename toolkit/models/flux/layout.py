"""BFL's (and ComfyUI's) FLUX.1 transformer names to diffusers'.

diffusers has this converter (`convert_flux_transformer_checkpoint_to_diffusers`), but it splits the single-stream
blocks' fused `linear1` with FLUX.1's full-size widths written in (3072, mlp 12288), so it cannot read a file of any
other width (the tiny presets the tests load). This one reads the widths from the tensors themselves and otherwise
does what diffusers' does; tests/test_flux_files.py checks it against diffusers' on the full-size layout, row for row.
"""

from __future__ import annotations

import torch

#: whole tensors renamed: BFL name -> diffusers name (`.weight` and `.bias` each)
GLOBAL = {
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "txt_in": "context_embedder",
    "img_in": "x_embedder",
    "final_layer.linear": "proj_out",
}

DOUBLE = {
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
}
DOUBLE_NORMS = {
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
}
DOUBLE_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
              "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}

SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out"}
SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}


def block_indices(checkpoint: dict, prefix: str) -> list[int]:
    return sorted({int(k.split(".")[1]) for k in checkpoint if k.startswith(prefix + ".")})


def to_diffusers(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors under diffusers' names: fused q/k/v split into thirds, each single block's `linear1` into q,
    k, v (the width of `linear2`'s output each) and the MLP (the rest), and the final modulation's shift and scale
    halves swapped (diffusers' AdaLayerNormContinuous takes scale first)."""
    source = dict(checkpoint)
    out: dict[str, torch.Tensor] = {}

    def move(old: str, new: str) -> None:
        for suffix in (".weight", ".bias"):
            if old + suffix in source:
                out[new + suffix] = source.pop(old + suffix)

    for old, new in GLOBAL.items():
        move(old, new)
    for suffix in (".weight", ".bias"):
        shift, scale = source.pop("final_layer.adaLN_modulation.1" + suffix).chunk(2, dim=0)
        out["norm_out.linear" + suffix] = torch.cat([scale, shift], dim=0)
    for i in block_indices(source, "double_blocks"):
        old, new = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for a, b in DOUBLE.items():
            move(old + a, new + b)
        for a, b in DOUBLE_NORMS.items():
            out[new + b] = source.pop(old + a)
        for fused, parts in DOUBLE_QKV.items():
            for suffix in (".weight", ".bias"):
                for part, tensor in zip(parts, source.pop(old + fused + suffix).chunk(3, dim=0)):
                    out[new + part + suffix] = tensor
    for i in block_indices(source, "single_blocks"):
        old, new = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        width = source[old + "linear2.weight"].shape[0]
        for a, b in SINGLE.items():
            move(old + a, new + b)
        for a, b in SINGLE_NORMS.items():
            out[new + b] = source.pop(old + a)
        for suffix in (".weight", ".bias"):
            fused = source.pop(old + "linear1" + suffix)
            q, k, v, mlp = fused.split([width, width, width, fused.shape[0] - 3 * width], dim=0)
            for part, tensor in zip(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), (q, k, v, mlp)):
                out[new + part + suffix] = tensor
    if source:
        names = sorted(source)
        raise KeyError(f"{len(names)} tensors of no FLUX.1 transformer module (e.g. {names[0]})")
    return out
