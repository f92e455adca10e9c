"""FLUX.1's parts as single files: the transformer (BFL's and ComfyUI's layout, or diffusers' names), CLIP-L,
T5-XXL and the VAE, each told apart by its names and shapes. Free of torch.

Tokenizers (in no weight file): `model.tokenizer`, else a ComfyUI installation the files lie in (its
`comfy/sd1_tokenizer` for CLIP, `comfy/text_encoders/t5_tokenizer` for T5), else `model.single_file_config`.
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

#: where a ComfyUI installation keeps each tokenizer, by the pipeline's tokenizer subfolder
COMFY_TOKENIZERS = {"tokenizer": "comfy/sd1_tokenizer", "tokenizer_2": "comfy/text_encoders/t5_tokenizer"}


def read_transformer(part: PartNames) -> dict[str, Any] | None:
    """Block counts, width, input channels and the guidance embedding of a FLUX.1 transformer file, in BFL's names
    (`double_blocks.N`, `img_in`, `guidance_in`) or diffusers' (`transformer_blocks.N`, `x_embedder`)."""
    if part.has("img_in.weight"):
        embedder, double, single = "img_in.weight", "double_blocks", "single_blocks"
        guidance = "guidance_in.in_layer.weight"
    elif part.has("x_embedder.weight") and part.has("time_text_embed.timestep_embedder.linear_1.weight"):
        embedder, double, single = "x_embedder.weight", "transformer_blocks", "single_transformer_blocks"
        guidance = "time_text_embed.guidance_embedder.linear_1.weight"
    else:
        return None
    width, channels = part.shape(embedder)[:2]
    return {"double blocks": part.count(rf"{double}\.(\d+)\."), "single blocks": part.count(rf"{single}\.(\d+)\."),
            "width": width, "input channels": channels, "guidance embedding": part.has(guidance)}


def original_layout(part: PartNames) -> bool:
    """BFL's names (diffusers' converter renames them), rather than diffusers' own."""
    return part.has("img_in.weight")


def tiny_variant(name: str, preset: dict, folder, hint: str | None = None) -> Variant:
    """A tiny preset's transformer as a variant."""
    t = preset["transformer"]
    facts = {"double blocks": t["num_layers"], "single blocks": t["num_single_layers"],
             "width": t["num_attention_heads"] * t["attention_head_dim"], "input channels": t["in_channels"],
             "guidance embedding": t["guidance_embeds"]}
    return preset_variant(name, f"tiny FLUX.1 preset ({name})", facts, folder, hint=hint)


def tiny_parts(preset: dict, folder) -> dict[str, Variant]:
    """The tiny preset's text encoders and VAE as variants of their kinds."""
    clip, t5, vae = preset["text_encoder"], preset["text_encoder_2"], preset["vae"]
    return {
        "clip_l": part_kinds.tiny_clip("tiny-clip", "tiny CLIP", clip, folder),
        "t5xxl": preset_variant("tiny-t5", "tiny T5", {"blocks": t5["num_layers"], "width": t5["d_model"]}, folder,
                                {"text_encoder": "text_encoder_2"}),
        "vae": part_kinds.tiny_vae(vae, folder),
    }


def transformer_kind(variants_file: Path, tiny: list[Variant], title: str = "FLUX.1 transformer") -> PartKind:
    return PartKind("flux_transformer", title, read_transformer, load_variants(variants_file, tiny), DENOISER_PREFIXES)


def family_files(variants_file: Path, presets: dict[str, tuple[dict, Any]], title: str,
                 hint: str | None = None) -> FamilyFiles:
    """The single files of a FLUX.1-layout family: its transformer, CLIP-L and T5-XXL, the VAE; `presets` are its
    tiny presets ({name: (preset dict, folder builder)}), whose parts are known variants too (with the family's
    file-name `hint` where its layout is another family's)."""
    tiny = [tiny_variant(name, preset, folder, hint) for name, (preset, folder) in presets.items()]
    first_preset, first_folder = next(iter(presets.values()))
    parts = tiny_parts(first_preset, first_folder)
    return FamilyFiles(denoiser=transformer_kind(variants_file, tiny, title),
                       text_encoders={"clip_l": part_kinds.clip_l([parts["clip_l"]]),
                                      "t5xxl": part_kinds.t5_xxl([parts["t5xxl"]])},
                       vae=part_kinds.flux_vae([parts["vae"]]), comfy_tokenizers=COMFY_TOKENIZERS)


def flux_files() -> FamilyFiles:
    from toolkit.models.flux.tiny import (
        TINY_FLEX,
        TINY_FLUX_DEV,
        TINY_FLUX_SCHNELL,
        ensure_tiny_flex,
        ensure_tiny_flux,
        ensure_tiny_flux_schnell,
    )

    return family_files(VARIANTS, {"tiny": (TINY_FLUX_DEV, ensure_tiny_flux),
                                   "tiny-schnell": (TINY_FLUX_SCHNELL, ensure_tiny_flux_schnell),
                                   "tiny-flex": (TINY_FLEX, ensure_tiny_flex)}, "FLUX.1 transformer")
