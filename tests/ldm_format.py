"""Write a diffusers SD 1.x folder as one original-layout (LDM) checkpoint, for single-file loading tests.

diffusers ships only the other direction (LDM -> diffusers); this inverts it for the block layout of any
SD 1.x-shaped UNet (last down block and first up block without attention), so tiny models work too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _unet_prefix_map(config: dict) -> list[tuple[str, str]]:
    """(ldm prefix, diffusers prefix) pairs."""
    blocks = len(config["block_out_channels"])
    layers = config["layers_per_block"]
    pairs = []
    for i in range(blocks):
        for j in range(layers):
            pairs.append((f"input_blocks.{(layers + 1) * i + j + 1}.0.", f"down_blocks.{i}.resnets.{j}."))
            if i < blocks - 1:
                pairs.append((f"input_blocks.{(layers + 1) * i + j + 1}.1.", f"down_blocks.{i}.attentions.{j}."))
        for j in range(layers + 1):
            pairs.append((f"output_blocks.{(layers + 1) * i + j}.0.", f"up_blocks.{i}.resnets.{j}."))
            if i > 0:
                pairs.append((f"output_blocks.{(layers + 1) * i + j}.1.", f"up_blocks.{i}.attentions.{j}."))
        if i < blocks - 1:
            pairs.append((f"input_blocks.{(layers + 1) * (i + 1)}.0.op.", f"down_blocks.{i}.downsamplers.0.conv."))
            up_index = 1 if i == 0 else 2
            pairs.append((f"output_blocks.{(layers + 1) * i + layers}.{up_index}.", f"up_blocks.{i}.upsamplers.0."))
    pairs.append(("middle_block.1.", "mid_block.attentions.0."))
    for j in range(2):
        pairs.append((f"middle_block.{2 * j}.", f"mid_block.resnets.{j}."))
    return pairs


UNET_FIXED = {
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "conv_in.": "input_blocks.0.0.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
}
RESNET_PARTS = [("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("out_layers.0", "norm2"),
                ("out_layers.3", "conv2"), ("emb_layers.1", "time_emb_proj"), ("skip_connection", "conv_shortcut")]


def convert_unet(state: dict, config: dict) -> dict:
    out = {}
    prefixes = _unet_prefix_map(config)
    for key, value in state.items():
        new = key
        for hf, ldm in UNET_FIXED.items():
            if new.startswith(hf):
                new = ldm + new[len(hf):]
        for ldm, hf in prefixes:
            if new.startswith(hf):
                new = ldm + new[len(hf):]
                if "resnets" in hf:
                    for ldm_part, hf_part in RESNET_PARTS:
                        new = new.replace(hf_part, ldm_part)
                break
        out[f"model.diffusion_model.{new}"] = value
    return out


def convert_vae(state: dict, config: dict) -> dict:
    blocks = len(config["block_out_channels"])
    layers = config["layers_per_block"]
    pairs = [("nin_shortcut", "conv_shortcut"), ("norm_out", "conv_norm_out"), ("mid.attn_1.", "mid_block.attentions.0.")]
    for i in range(blocks):
        for j in range(layers):
            pairs.append((f"encoder.down.{i}.block.{j}.", f"encoder.down_blocks.{i}.resnets.{j}."))
        if i < blocks - 1:
            pairs.append((f"down.{i}.downsample.", f"down_blocks.{i}.downsamplers.0."))
            pairs.append((f"up.{blocks - 1 - i}.upsample.", f"up_blocks.{i}.upsamplers.0."))
        for j in range(layers + 1):
            pairs.append((f"decoder.up.{blocks - 1 - i}.block.{j}.", f"decoder.up_blocks.{i}.resnets.{j}."))
    for i in range(2):
        pairs.append((f"mid.block_{i + 1}.", f"mid_block.resnets.{i}."))
    attn = [("norm.", "group_norm."), ("q.", "to_q."), ("k.", "to_k."), ("v.", "to_v."), ("proj_out.", "to_out.0.")]
    out = {}
    for key, value in state.items():
        new = key
        for ldm, hf in pairs:
            new = new.replace(hf, ldm)
        if "attn_1" in new:
            for ldm, hf in attn:
                new = new.replace(hf, ldm)
            if new.endswith(("q.weight", "k.weight", "v.weight", "proj_out.weight")) and value.dim() == 2:
                value = value[:, :, None, None]
        out[f"first_stage_model.{new}"] = value
    return out


def save_as_ldm_checkpoint(folder: Path, out_file: Path) -> Path:
    def part(name: str) -> tuple[dict, dict]:
        config = json.loads((folder / name / "config.json").read_text())
        weights = next((folder / name).glob("*.safetensors"))
        return load_file(str(weights)), config

    unet, unet_cfg = part("unet")
    vae, vae_cfg = part("vae")
    text, _ = part("text_encoder")
    state = {**convert_unet(unet, unet_cfg), **convert_vae(vae, vae_cfg)}
    # the original layout keeps CLIP's `text_model.` level, which transformers 5 drops when saving
    state.update({f"cond_stage_model.transformer.text_model.{k.removeprefix('text_model.')}": v
                  for k, v in text.items()})
    save_file({k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}, str(out_file))
    return out_file


def sgm_unet(state: dict) -> dict:
    """An SDXL diffusers UNet's weights in the original (SGM) layout, by the family's own module map."""
    from toolkit.models.sdxl.names import sgm_unet_renames
    from toolkit.network.formats import renamed

    modules = sorted({key.rsplit(".", 1)[0] for key in state})
    parents = sorted({".".join(m.split(".")[:n]) for m in modules for n in range(1, m.count(".") + 2)})
    renames = sgm_unet_renames(parents)
    out = {}
    for key, value in state.items():
        module, weight = key.rsplit(".", 1)
        out[f"model.diffusion_model.{renamed(module, renames)}.{weight}"] = value
    return out


def open_clip(state: dict, prefix: str) -> dict:
    """A transformers CLIPTextModelWithProjection's weights in OpenCLIP's layout (SDXL's second text encoder)."""
    out = {
        f"{prefix}positional_embedding": state["text_model.embeddings.position_embedding.weight"],
        f"{prefix}token_embedding.weight": state["text_model.embeddings.token_embedding.weight"],
        f"{prefix}ln_final.weight": state["text_model.final_layer_norm.weight"],
        f"{prefix}ln_final.bias": state["text_model.final_layer_norm.bias"],
        f"{prefix}text_projection": state["text_projection.weight"].T.contiguous(),
    }
    layers = sorted({int(k.split(".")[3]) for k in state if k.startswith("text_model.encoder.layers.")})
    parts = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
             "self_attn.out_proj": "attn.out_proj"}
    for n in range(layers[-1] + 1):
        ours, theirs = f"text_model.encoder.layers.{n}.", f"{prefix}transformer.resblocks.{n}."
        for kind in ("weight", "bias"):
            out[f"{theirs}attn.in_proj_{kind}"] = torch.cat(
                [state[f"{ours}self_attn.{p}_proj.{kind}"] for p in ("q", "k", "v")])
            for part, their_part in parts.items():
                out[f"{theirs}{their_part}.{kind}"] = state[f"{ours}{part}.{kind}"]
    return out


def save_as_sgm_checkpoint(folder: Path, out_file: Path) -> Path:
    """An SDXL diffusers folder as one original-layout checkpoint (what fine-tunes such as Pony ship as)."""
    def part(name: str) -> tuple[dict, dict]:
        config = json.loads((folder / name / "config.json").read_text())
        weights = next((folder / name).glob("*.safetensors"))
        return load_file(str(weights)), config

    unet, _ = part("unet")
    vae, vae_cfg = part("vae")
    text, _ = part("text_encoder")
    text_2, _ = part("text_encoder_2")
    state = {**sgm_unet(unet), **convert_vae(vae, vae_cfg), **open_clip(text_2, "conditioner.embedders.1.model.")}
    state.update({f"conditioner.embedders.0.transformer.text_model.{k.removeprefix('text_model.')}": v
                  for k, v in text.items()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_file))
    return out_file
