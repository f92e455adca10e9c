"""The Wuerstchen v2 prior's parts as single files. ComfyUI has no Wuerstchen layout (it reads Stable Cascade, not
Wuerstchen v2), so these are the original published files: the prior (stage C) as the authors released it (a torch
checkpoint whose `ema_state_dict` holds the prior with torch's fused attention, e.g. model_v2_stage_c.pt), or in
diffusers' names; and the text encoder, OpenCLIP ViT-bigG/14 (laion's open_clip_pytorch_model file: the whole CLIP
model, whose text tower is read; or transformers' names). Free of torch.

The tokenizer (in no weight file): `model.tokenizer` (e.g. warp-ai/wuerstchen-prior, whose tokenizer pads with
<|endoftext|>), else a ComfyUI installation the files lie in (CLIP's vocabulary: `comfy/sd1_tokenizer`), else
`single_file_config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.models import part_kinds
from toolkit.models.single_files import FamilyFiles, PartKind, PartNames, load_variants, preset_variant

VARIANTS = Path(__file__).parent / "variants.json"

COMFY_TOKENIZERS = {"tokenizer": "comfy/sd1_tokenizer"}


def read_prior(part: PartNames) -> dict[str, Any] | None:
    """Width, condition width, block count and input channels of a prior, in the original names (fused attention)
    or diffusers'."""
    projection, condition = part.shape("projection.weight"), part.shape("cond_mapper.0.weight")
    if projection is None or condition is None:
        return None
    return {"width": projection[0], "condition width": condition[1], "blocks": part.count(r"blocks\.(\d+)\."),
            "input channels": projection[1]}


def original_layout(part: PartNames) -> bool:
    return any(name.endswith("attention.attn.in_proj_weight") for name in part.tensors)


def wuerstchen_files() -> FamilyFiles:
    from toolkit.models.wuerstchen.tiny import TINY_WUERSTCHEN, ensure_tiny_wuerstchen

    prior, text = TINY_WUERSTCHEN["prior"], TINY_WUERSTCHEN["text_encoder"]
    folder = lambda: ensure_tiny_wuerstchen() / "prior"  # noqa: E731
    tiny_prior = preset_variant("tiny", "tiny Wuerstchen preset", {
        "width": prior["c"], "condition width": prior["c_cond"], "blocks": 3 * prior["depth"],
        "input channels": prior["c_in"]}, folder)
    tiny_text = part_kinds.tiny_clip("tiny-clip", "tiny CLIP", text, folder)
    return FamilyFiles(denoiser=PartKind("wuerstchen_prior", "Wuerstchen v2 prior", read_prior,
                                         load_variants(VARIANTS, [tiny_prior])),
                       text_encoders={"clip_bigg": part_kinds.clip_bigg_text([tiny_text])}, vae=None,
                       comfy_tokenizers=COMFY_TOKENIZERS)
