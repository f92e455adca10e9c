"""The text encoders and VAEs families share, as single files: how each is told from its tensor names and shapes,
and its published variants (configs shipped in toolkit/models/variants/*.json). Free of torch.

A family's part slot (its CLIP, its T5, its VAE) is a `PartKind` made with `kind(...)`: these readers and published
variants, plus the family's tiny presets' variants.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from toolkit.models.single_files import PartKind, PartNames, Variant

VARIANTS = Path(__file__).parent / "variants"

#: the prefixes ComfyUI's and the original checkpoints put before each text encoder's names (a CLIP file's names
#: start `text_model.`, which transformers' CLIPTextModel no longer has in its own; its `text_projection` is the
#: full CLIP model's, outside the prefix)
CLIP_L_PREFIXES = ("text_encoders.clip_l.transformer.text_model.", "cond_stage_model.transformer.text_model.",
                   "conditioner.embedders.0.transformer.text_model.", "clip_l.transformer.text_model.", "text_model.")
T5_PREFIXES = ("text_encoders.t5xxl.transformer.", "t5xxl.transformer.")
VAE_PREFIXES = ("first_stage_model.", "vae.")
#: a Qwen language model's names in ComfyUI's files (`model.layers.N`, the head outside, where there is one)
QWEN_PREFIXES = ("text_encoders.qwen3_4b.transformer.model.", "model.")


def published(file: str, *names: str) -> tuple[Variant, ...]:
    """Published variants from toolkit/models/variants/<file>.json (all, or the ones named)."""
    entries = json.loads((VARIANTS / file).read_text())
    return tuple(Variant(name, entry["title"], entry["facts"], entry["configs"]) for name, entry in entries.items()
                 if not names or name in names)


def kind(name: str, title: str, read: Callable[[PartNames], dict[str, Any] | None], variants: Iterable[Variant],
         prefixes: tuple[str, ...] = ()) -> PartKind:
    return PartKind(name, title, read, tuple(variants), prefixes)


def tiny_vae(vae: dict, folder) -> Variant:
    """A tiny preset's AutoencoderKL (its config dict `vae`, its pipeline folder's builder) as a variant."""
    from toolkit.models.single_files import preset_variant

    return preset_variant("tiny-vae", "tiny VAE", {"latent channels": vae["latent_channels"],
                                                   "widths": list(vae["block_out_channels"])}, folder, {"vae": "vae"})


def tiny_clip(name: str, title: str, text: dict, folder, subfolder: str = "text_encoder") -> Variant:
    """A tiny preset's CLIP text model (its config dict `text`, in the folder's `subfolder`) as a variant."""
    from toolkit.models.single_files import preset_variant

    return preset_variant(name, title, {"layers": text["num_hidden_layers"], "width": text["hidden_size"]}, folder,
                          {"text_encoder": subfolder})


def read_clip_text(part: PartNames) -> dict[str, Any] | None:
    """A CLIP text model in transformers' names under `text_model.` (as ComfyUI stores clip_l and clip_g, the prefix
    removed): its layer count, width and vocabulary."""
    embedding = part.shape("embeddings.token_embedding.weight")
    if embedding is None or not part.has("final_layer_norm.weight"):
        return None
    return {"layers": part.count(r"encoder\.layers\.(\d+)\."), "width": embedding[1], "vocabulary": embedding[0]}


def read_t5_encoder(part: PartNames) -> dict[str, Any] | None:
    """A T5 encoder in transformers' names (`encoder.block.N.layer...`, `shared.weight`), as ComfyUI stores T5-XXL and
    UMT5-XXL: block count, width, vocabulary, and whether every layer has its own position bias (UMT5) or only the
    first (T5)."""
    embedding = part.shape("shared.weight") or part.shape("encoder.embed_tokens.weight")
    if embedding is None or not part.has("encoder.block.0.layer.0.SelfAttention.q.weight"):
        return None
    return {"blocks": part.count(r"encoder\.block\.(\d+)\."), "width": embedding[1], "vocabulary": embedding[0],
            "per-layer position bias": part.has("encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight")}


#: an AutoencoderKL's encoder levels and each level's first convolution, in the original (LDM) names (as
#: ae.safetensors and the SD VAEs are stored) and in diffusers'
VAE_LAYOUTS = (("encoder.down", "block.0.conv1.weight"), ("encoder.down_blocks", "resnets.0.conv1.weight"))


def read_autoencoder_kl(part: PartNames) -> dict[str, Any] | None:
    """An AutoencoderKL in either layout: latent channels, the widths of its levels, and whether it has the quant
    convs."""
    conv_out = part.shape("encoder.conv_out.weight")
    for levels, first in VAE_LAYOUTS:
        if conv_out is not None and part.has(f"{levels}.0.{first}"):
            count = part.count(rf"{re.escape(levels)}\.(\d+)\.")
            widths = [part.shape(f"{levels}.{i}.{first}")[0] for i in range(count)]
            return {"latent channels": conv_out[0] // 2, "widths": widths, "quant conv": part.has("quant_conv.weight")}
    return None


def read_sd_unet(part: PartNames) -> dict[str, Any] | None:
    """A Stable Diffusion UNet in the original (LDM) names (`input_blocks.N`, as checkpoints store it) or diffusers'
    (`down_blocks.N`): its first width, input channels, the width of the text it attends to (cross-attention), whether
    its transformers project with linear layers (SD 2.x, SDXL) and whether it takes an added embedding (SDXL's size
    and pooled-text conditioning)."""
    first = part.shape("input_blocks.0.0.weight") or part.shape("conv_in.weight")
    middle = ("middle_block.0.in_layers.0.weight", "mid_block.resnets.0.conv1.weight")
    if first is None or not any(part.has(name) for name in middle):
        return None
    names = sorted(part.tensors)
    cross = next((part.shape(name) for name in names if name.endswith("attn2.to_k.weight")), None)
    proj_in = next((part.shape(name) for name in names if name.endswith(".proj_in.weight")), None)
    return {"width": first[0], "input channels": first[1], "context width": cross[1] if cross else None,
            "linear projection": bool(proj_in) and len(proj_in) == 2,
            "added embedding": part.has("label_emb.0.0.weight") or part.has("add_embedding.linear_1.weight")}


#: where CLIP-G's names start: SDXL checkpoints keep it in open_clip's layout; ComfyUI's clip_g file and SD3's in
#: transformers' names (with the projection beside `text_model.`)
CLIP_G_PREFIXES = ("conditioner.embedders.1.model.", "text_encoders.clip_g.transformer.", "clip_g.transformer.")


def read_clip_g(part: PartNames) -> dict[str, Any] | None:
    """A CLIP text model with its projection (CLIPTextModelWithProjection), in transformers' names or open_clip's
    (`transformer.resblocks.N`, `token_embedding`, `text_projection`): layers, width, vocabulary."""
    if part.has("text_model.embeddings.token_embedding.weight") and part.has("text_projection.weight"):
        embedding = part.shape("text_model.embeddings.token_embedding.weight")
        layers = part.count(r"text_model\.encoder\.layers\.(\d+)\.")
    elif part.has("token_embedding.weight") and part.has("text_projection"):
        embedding = part.shape("token_embedding.weight")
        layers = part.count(r"transformer\.resblocks\.(\d+)\.")
    else:
        return None
    return {"layers": layers, "width": embedding[1], "vocabulary": embedding[0]}


def read_clip_text_any(part: PartNames) -> dict[str, Any] | None:
    """A CLIP text model in transformers' names (its `text_model.` prefix removed) or in open_clip's (a whole CLIP
    model's file, e.g. laion's open_clip_pytorch_model: its text tower)."""
    if part.has("token_embedding.weight") and part.has("transformer.resblocks.0.ln_1.weight"):
        embedding = part.shape("token_embedding.weight")
        return {"layers": part.count(r"transformer\.resblocks\.(\d+)\."), "width": embedding[1],
                "vocabulary": embedding[0]}
    return read_clip_text(part)


def open_clip_layout(part: PartNames) -> bool:
    return part.has("token_embedding.weight")


def read_qwen3(part: PartNames) -> dict[str, Any] | None:
    """A Qwen3 language model (its `model.` part; q/k norms tell Qwen3 from Qwen2.5): layers, width, vocabulary."""
    embedding = part.shape("embed_tokens.weight")
    if embedding is None or not part.has("layers.0.self_attn.q_norm.weight"):
        return None
    return {"layers": part.count(r"layers\.(\d+)\."), "width": embedding[1], "vocabulary": embedding[0]}


def read_qwen25_vl(part: PartNames) -> dict[str, Any] | None:
    """Qwen2.5-VL (its language model with qkv biases, no q/k norms, and its vision tower) in ComfyUI's names
    (`model.layers.N`, `visual.blocks.N`: transformers' older layout) or transformers 5's (`model.language_model.`,
    `model.visual.`): layers, width, vocabulary, vision blocks."""
    for language, vision in (("model.", "visual."), ("model.language_model.", "model.visual.")):
        embedding = part.shape(f"{language}embed_tokens.weight")
        if embedding is not None and part.has(f"{language}layers.0.self_attn.q_proj.bias"):
            return {"layers": part.count(rf"{re.escape(language)}layers\.(\d+)\."), "width": embedding[1],
                    "vocabulary": embedding[0], "vision blocks": part.count(rf"{re.escape(vision)}blocks\.(\d+)\.")}
    return None


def comfy_qwen25_vl_names(checkpoint: dict) -> dict:
    """ComfyUI's (transformers' older) Qwen2.5-VL names in transformers 5's: `model.` -> `model.language_model.`,
    `visual.` -> `model.visual.`."""
    return {("model.language_model." + k[len("model."):] if k.startswith("model.") else
             "model." + k if k.startswith("visual.") else k): v for k, v in checkpoint.items()}


def clip_l(tiny: Iterable[Variant] = ()) -> PartKind:
    return kind("clip_l", "CLIP-L text encoder", read_clip_text,
                published("text_encoders.json", "clip-l") + tuple(tiny), CLIP_L_PREFIXES)


def t5_xxl(tiny: Iterable[Variant] = ()) -> PartKind:
    return kind("t5xxl", "T5-XXL text encoder", read_t5_encoder,
                published("text_encoders.json", "t5-xxl") + tuple(tiny), T5_PREFIXES)


def flux_vae(tiny: Iterable[Variant] = ()) -> PartKind:
    return kind("flux_vae", "FLUX.1 VAE", read_autoencoder_kl, published("vaes.json", "flux-vae") + tuple(tiny),
                VAE_PREFIXES)


def sd_vae(tiny: Iterable[Variant] = ()) -> PartKind:
    return kind("sd_vae", "Stable Diffusion VAE", read_autoencoder_kl, published("vaes.json", "sd-vae") + tuple(tiny),
                VAE_PREFIXES)


def clip_g(tiny: Iterable[Variant] = ()) -> PartKind:
    return kind("clip_g", "CLIP-G text encoder", read_clip_g, published("text_encoders.json", "clip-g") + tuple(tiny),
                CLIP_G_PREFIXES)


def sdxl_vae(tiny: Iterable[Variant] = ()) -> PartKind:
    return kind("sdxl_vae", "SDXL VAE", read_autoencoder_kl, published("vaes.json", "sdxl-vae") + tuple(tiny),
                VAE_PREFIXES)


def qwen3_4b(tiny: Iterable[Variant] = ()) -> PartKind:
    return kind("qwen3_4b", "Qwen3-4B text encoder", read_qwen3,
                published("text_encoders.json", "qwen3-4b") + tuple(tiny), QWEN_PREFIXES)


def clip_bigg_text(tiny: Iterable[Variant] = ()) -> PartKind:
    """OpenCLIP ViT-bigG/14's text tower without its projection (the Wuerstchen prior's text encoder)."""
    return kind("clip_bigg", "CLIP ViT-bigG text encoder", read_clip_text_any,
                published("text_encoders.json", "clip-bigg-text") + tuple(tiny), ("text_model.",))


def qwen25_vl_7b(tiny: Iterable[Variant] = ()) -> PartKind:
    return kind("qwen25_vl_7b", "Qwen2.5-VL-7B text encoder", read_qwen25_vl,
                published("text_encoders.json", "qwen25-vl-7b") + tuple(tiny))
