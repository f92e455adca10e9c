"""Where each part of a FLUX.1-layout base comes from (toolkit/models/base_parts.py): the transformer in BFL's or
diffusers' names, CLIP-L and T5-XXL, the VAE in the original or diffusers' names, the CLIP and T5 tokenizers."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

from toolkit.models.base_parts import CLIP_EXTRAS, BaseParts, ldm_vae_converter
from toolkit.models.flux.files import original_layout
from toolkit.models.flux.layout import to_diffusers

def load_flux_parts(adapter_class, model_cfg, source: str, dtype: torch.dtype, empty: bool) -> tuple[dict, dict]:
    """({pipeline component: part}, {part: where it came from}) of a FLUX.1-layout base."""
    parts = BaseParts(adapter_class.single_files(), model_cfg, source, adapter_class.resolve_source,
                      lambda variant: adapter_class.default_components[
                          variant.config("transformer")["guidance_embeds"] if variant else True])
    transformer = parts.denoiser(FluxTransformer2DModel, "transformer", dtype, empty,
                                 converter=lambda part, _: to_diffusers if original_layout(part) else None)
    encoders = parts.text_encoders(
        {"clip_l": ("text_encoder", lambda c: CLIPTextModel(CLIPTextConfig(**c)), CLIPTextModel),
         "t5xxl": ("text_encoder_2", lambda c: T5EncoderModel(T5Config(**c)), T5EncoderModel)},
        dtype, ignore={"clip_l": CLIP_EXTRAS}, optional={"t5xxl": ("embed_tokens.weight",)})
    encoders["t5xxl"].tie_weights()
    found = {"transformer": transformer, "scheduler": parts.scheduler(FlowMatchEulerDiscreteScheduler),
             "text_encoder": encoders["clip_l"], "text_encoder_2": encoders["t5xxl"],
             "vae": parts.vae(AutoencoderKL, dtype, converter=ldm_vae_converter),
             **parts.tokenizers({"tokenizer": CLIPTokenizer, "tokenizer_2": AutoTokenizer})}
    return found, parts.origins
