"""The SDXL UNet's module paths in the original (SGM) layout, which kohya trains and names its LoRA keys by
(`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`); ComfyUI, A1111/Forge and diffusers read them too.

The SGM UNet numbers its blocks in order: `input_blocks.0` is conv_in, then each down block's resnets (each with
its attention, if any, as `.1`) and its downsampler; `middle_block` is resnet, attention, resnet; `output_blocks`
are each up block's resnets (with attention as `.1`), the block's upsampler joining its last one. The map is
derived from the module names, so it holds for any block layout (the tiny preset's included)."""

from __future__ import annotations

import re

#: fixed modules outside the block structure
FIXED = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
#: a resnet's children: diffusers -> SGM
RESNET_PARTS = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
                "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def _count(names: set[str], prefix: str) -> int:
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)$")
    return len({m.group(1) for m in map(pattern.match, names) if m})


def sgm_unet_renames(module_names: list[str]) -> dict[str, str]:
    """{diffusers module path prefix: SGM path} for a diffusers UNet with these module names."""
    names = set(module_names)
    renames = dict(FIXED)

    def resnet(ours: str, theirs: str) -> None:
        renames[ours] = theirs
        for part, sgm in RESNET_PARTS.items():
            renames[f"{ours}.{part}"] = f"{theirs}.{sgm}"

    index = 1
    for i in range(_count(names, "down_blocks")):
        block = f"down_blocks.{i}"
        for j in range(_count(names, f"{block}.resnets")):
            resnet(f"{block}.resnets.{j}", f"input_blocks.{index}.0")
            if f"{block}.attentions.{j}" in names:
                renames[f"{block}.attentions.{j}"] = f"input_blocks.{index}.1"
            index += 1
        if f"{block}.downsamplers.0" in names:
            renames[f"{block}.downsamplers.0.conv"] = f"input_blocks.{index}.0.op"
            index += 1
    for j in range(_count(names, "mid_block.resnets")):
        resnet(f"mid_block.resnets.{j}", f"middle_block.{2 * j}")
    if "mid_block.attentions.0" in names:
        renames["mid_block.attentions.0"] = "middle_block.1"
    index = 0
    for i in range(_count(names, "up_blocks")):
        block = f"up_blocks.{i}"
        has_attention = f"{block}.attentions.0" in names
        for j in range(_count(names, f"{block}.resnets")):
            resnet(f"{block}.resnets.{j}", f"output_blocks.{index}.0")
            if has_attention:
                renames[f"{block}.attentions.{j}"] = f"output_blocks.{index}.1"
            index += 1
        if f"{block}.upsamplers.0" in names:
            renames[f"{block}.upsamplers.0.conv"] = f"output_blocks.{index - 1}.{2 if has_attention else 1}.conv"
    return renames
