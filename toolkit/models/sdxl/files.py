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

    def text(name: str, title: str, config: dict, subfolder: str):
        return preset_variant(name, title, {"layers": config["num_hidden_layers"], "width": config["hidden_size"]},
                              ensure_tiny_sdxl, {"text_encoder": subfolder})

    tiny_vae = preset_variant("tiny-vae", "tiny VAE", {"latent channels": vae["latent_channels"],
                                                       "widths": list(vae["block_out_channels"])},
                              ensure_tiny_sdxl, {"vae": "vae"})
    unet_kind = PartKind("sdxl_unet", "SDXL UNet", part_kinds.read_sd_unet, load_variants(VARIANTS, [tiny_unet]),
                         DENOISER_PREFIXES)
    return FamilyFiles(denoiser=unet_kind,
                       text_encoders={"clip_l": part_kinds.clip_l([text("tiny-clip", "tiny CLIP", clip,
                                                                        "text_encoder")]),
                                      "clip_g": part_kinds.clip_g([text("tiny-clip-g", "tiny CLIP-G", clip_g,
                                                                        "text_encoder_2")])},
                       vae=part_kinds.sdxl_vae([tiny_vae]), comfy_tokenizers=COMFY_TOKENIZERS)
