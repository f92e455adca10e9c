"""Z-Image's parts as single files: the transformer (ComfyUI's and the original layout: fused qkv; or diffusers'
names), the Qwen3-4B text encoder (ComfyUI's qwen_3_4b), the VAE (FLUX.1's ae.safetensors). Z-Image and
Z-Image-Turbo have one layout: a file's name tells Turbo (`turbo`), else it is read as Z-Image. Free of torch.

The tokenizer (in no weight file): `model.tokenizer`, else a ComfyUI installation the files lie in
(`comfy/text_encoders/qwen25_tokenizer`, which ComfyUI uses for Qwen3-4B too), else `model.single_file_config`.
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
    load_variants,
    preset_variant,
)

VARIANTS = Path(__file__).parent / "variants.json"

COMFY_TOKENIZERS = {"tokenizer": "comfy/text_encoders/qwen25_tokenizer"}


def read_transformer(part: PartNames) -> dict[str, Any] | None:
    """Layers, width, caption width and refiner layers of a Z-Image transformer (the names these are read from are
    the same in both layouts)."""
    caption = part.shape("cap_embedder.1.weight")
    if caption is None or not (part.has("x_embedder.weight") or part.has("all_x_embedder.2-1.weight")):
        return None
    return {"layers": part.count(r"layers\.(\d+)\."), "width": caption[0], "caption width": caption[1],
            "refiner layers": part.count(r"noise_refiner\.(\d+)\.")}


def original_layout(part: PartNames) -> bool:
    """The original names (fused qkv; diffusers' converter splits and renames them), rather than diffusers' own."""
    return part.has("x_embedder.weight")


def zimage_files() -> FamilyFiles:
    from toolkit.models.zimage.tiny import TINY_ZIMAGE, ensure_tiny_zimage, ensure_tiny_zimage_turbo

    t, text, vae = TINY_ZIMAGE["transformer"], TINY_ZIMAGE["text_encoder"], TINY_ZIMAGE["vae"]
    facts = {"layers": t["n_layers"], "width": t["dim"], "caption width": t["cap_feat_dim"],
             "refiner layers": t["n_refiner_layers"]}
    tiny = [preset_variant("tiny-turbo", "tiny Z-Image preset (tiny-turbo)", facts, ensure_tiny_zimage_turbo,
                           hint="turbo"),
            preset_variant("tiny", "tiny Z-Image preset (tiny)", facts, ensure_tiny_zimage)]
    tiny_text = preset_variant("tiny-qwen3", "tiny Qwen3", {"layers": text["num_hidden_layers"],
                                                           "width": text["hidden_size"]},
                               ensure_tiny_zimage, {"text_encoder": "text_encoder"})
    tiny_vae = part_kinds.tiny_vae(vae, ensure_tiny_zimage)
    transformer = PartKind("zimage_transformer", "Z-Image transformer", read_transformer,
                           load_variants(VARIANTS, tiny), DENOISER_PREFIXES)
    return FamilyFiles(denoiser=transformer, text_encoders={"qwen3_4b": part_kinds.qwen3_4b([tiny_text])},
                       vae=part_kinds.flux_vae([tiny_vae]), comfy_tokenizers=COMFY_TOKENIZERS)
