"""Stable Diffusion 1.x's parts as single files: a checkpoint (`models/checkpoints/`: the UNet under
`model.diffusion_model.`, CLIP-L under `cond_stage_model.transformer.`, the VAE under `first_stage_model.`, each read
from the same file), or a UNet, CLIP-L and VAE each in its own file. Free of torch.

The tokenizer (in no weight file): `model.tokenizer`, else a ComfyUI installation the files lie in
(`comfy/sd1_tokenizer`), else `model.single_file_config`.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.models import part_kinds
from toolkit.models.single_files import DENOISER_PREFIXES, FamilyFiles, PartKind, load_variants, preset_variant

VARIANTS = Path(__file__).parent / "variants.json"

COMFY_TOKENIZERS = {"tokenizer": "comfy/sd1_tokenizer"}


def original_layout(part) -> bool:
    """The original (LDM) UNet names (diffusers' converter renames them), rather than diffusers' own."""
    return part.has("input_blocks.0.0.weight")


def sd15_files() -> FamilyFiles:
    from toolkit.models.sd15.tiny import TINY_SD15, ensure_tiny_sd15

    unet, clip, vae = TINY_SD15["unet"], TINY_SD15["text_encoder"], TINY_SD15["vae"]
    tiny_unet = preset_variant("tiny", "tiny SD 1.x preset", {
        "width": unet["block_out_channels"][0], "input channels": unet["in_channels"],
        "context width": unet["cross_attention_dim"], "linear projection": False, "added embedding": False},
        ensure_tiny_sd15)
    tiny_clip = part_kinds.tiny_clip("tiny-clip", "tiny CLIP", clip, ensure_tiny_sd15)
    tiny_vae = part_kinds.tiny_vae(vae, ensure_tiny_sd15)
    unet_kind = PartKind("sd15_unet", "Stable Diffusion 1.x UNet", part_kinds.read_sd_unet,
                         load_variants(VARIANTS, [tiny_unet]), DENOISER_PREFIXES)
    return FamilyFiles(denoiser=unet_kind, text_encoders={"clip_l": part_kinds.clip_l([tiny_clip])},
                       vae=part_kinds.sd_vae([tiny_vae]), comfy_tokenizers=COMFY_TOKENIZERS)
