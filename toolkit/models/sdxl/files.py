"""Stable Diffusion XL's parts as single files: a checkpoint (`models/checkpoints/`: the UNet under
`model.diffusion_model.`, CLIP-L under `conditioner.embedders.0.transformer.`, CLIP-G in open_clip's layout under
`conditioner.embedders.1.model.`, the VAE under `first_stage_model.`), or each part in its own file (ComfyUI's clip_l
and clip_g). Free of torch.

Tokenizers (in no weight file): `model.tokenizer`, else a ComfyUI installation the files lie in (both from
`comfy/sd1_tokenizer`; the second pads with "!", as SDXL's does), else `model.single_file_config`.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.models import part_kinds
from toolkit.models.single_files import DENOISER_PREFIXES, FamilyFiles, PartKind, load_variants, preset_variant

VARIANTS = Path(__file__).parent / "variants.json"

COMFY_TOKENIZERS = {"tokenizer": "comfy/sd1_tokenizer", "tokenizer_2": "comfy/sd1_tokenizer"}


def sdxl_files() -> FamilyFiles:
    from toolkit.models.sdxl.tiny import TINY_SDXL, ensure_tiny_sdxl

    unet, clip, clip_g, vae = (TINY_SDXL[k] for k in ("unet", "text_encoder", "text_encoder_2", "vae"))
    tiny_unet = preset_variant("tiny", "tiny SDXL preset", {
        "width": unet["block_out_channels"][0], "input channels": unet["in_channels"],
        "context width": unet["cross_attention_dim"], "linear projection": True, "added embedding": True},
        ensure_tiny_sdxl)
    tiny_vae = part_kinds.tiny_vae(vae, ensure_tiny_sdxl)
    tiny_clip = part_kinds.tiny_clip("tiny-clip", "tiny CLIP", clip, ensure_tiny_sdxl)
    tiny_clip_g = part_kinds.tiny_clip("tiny-clip-g", "tiny CLIP-G", clip_g, ensure_tiny_sdxl, "text_encoder_2")
    unet_kind = PartKind("sdxl_unet", "SDXL UNet", part_kinds.read_sd_unet, load_variants(VARIANTS, [tiny_unet]),
                         DENOISER_PREFIXES)
    return FamilyFiles(denoiser=unet_kind, text_encoders={"clip_l": part_kinds.clip_l([tiny_clip]),
                                                          "clip_g": part_kinds.clip_g([tiny_clip_g])},
                       vae=part_kinds.sdxl_vae([tiny_vae]), comfy_tokenizers=COMFY_TOKENIZERS)
