"""Qwen-Image's parts as single files: the transformer (ComfyUI keeps diffusers' names, with or without
`model.diffusion_model.`; read layer by layer, fp8 kept as stored) and the Qwen2.5-VL-7B text encoder (ComfyUI's
qwen_2.5_vl_7b, its vision tower included). Free of torch.

The tokenizer (in no weight file): `model.tokenizer`, else a ComfyUI installation the files lie in
(`comfy/text_encoders/qwen25_tokenizer`), else `model.single_file_config`. The VAE (ComfyUI's qwen_image_vae, in Wan
2.1's original layout) is not read from a file yet: it comes from the base's folder or `vae_name_or_path` (a
diffusers VAE folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.models import part_kinds
from toolkit.models.single_files import (
    DENOISER_PREFIXES,
    FamilyFiles,
    PartKind,
    PartNames,
    Variant,
    load_variants,
    preset_variant,
)

VARIANTS = Path(__file__).parent / "variants.json"

COMFY_TOKENIZERS = {"tokenizer": "comfy/text_encoders/qwen25_tokenizer"}


def read_transformer(part: PartNames) -> dict[str, Any] | None:
    """Layers, width, input channels and text width of a Qwen-Image transformer (diffusers' names)."""
    image, text = part.shape("img_in.weight"), part.shape("txt_in.weight")
    if image is None or text is None or not part.has("txt_norm.weight"):
        return None
    return {"layers": part.count(r"transformer_blocks\.(\d+)\."), "width": image[0], "input channels": image[1],
            "text width": text[1]}


def tiny_parts(preset: dict, folder, name: str, title: str, variants_file: Path = VARIANTS,
               hint: str | None = None) -> FamilyFiles:
    """A Qwen-Image-layout family's files with its tiny preset's parts as variants."""
    t, text = preset["transformer"], preset["text_encoder"]
    tiny = preset_variant(name, f"tiny {title} preset ({name})", {
        "layers": t["num_layers"], "width": t["num_attention_heads"] * t["attention_head_dim"],
        "input channels": t["in_channels"], "text width": t["joint_attention_dim"]}, folder, hint=hint)
    tiny_text = preset_variant("tiny-qwen25-vl", "tiny Qwen2.5-VL", {
        "layers": text["text_config"]["num_hidden_layers"], "width": text["text_config"]["hidden_size"],
        "vision blocks": text["vision_config"]["depth"]}, folder, {"text_encoder": "text_encoder"})
    return FamilyFiles(denoiser=transformer_kind(variants_file, [tiny], f"{title} transformer"),
                       text_encoders={"qwen25_vl_7b": part_kinds.qwen25_vl_7b([tiny_text])}, vae=None,
                       comfy_tokenizers=COMFY_TOKENIZERS)


def transformer_kind(variants_file: Path, tiny: list[Variant], title: str) -> PartKind:
    return PartKind("qwen_image_transformer", title, read_transformer, load_variants(variants_file, tiny),
                    DENOISER_PREFIXES)


def qwen_image_files() -> FamilyFiles:
    from toolkit.models.qwen_image.tiny import TINY_QWEN_IMAGE, ensure_tiny_qwen_image

    return tiny_parts(TINY_QWEN_IMAGE, ensure_tiny_qwen_image, "tiny", "Qwen-Image")
