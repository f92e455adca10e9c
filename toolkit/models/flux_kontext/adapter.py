"""FLUX.1 Kontext [dev]: FLUX.1's transformer, text encoders and VAE, conditioned on a reference image.

Conventions, as FluxKontextPipeline.__call__ applies them:
- the reference is encoded at the VAE's mode, (mean - shift_factor) x scaling_factor, packed 2x2 as the target is,
  and its tokens follow the target's in one sequence;
- its position ids are the target's layout over its own grid with the first coordinate 1 (the target's is 0);
- the transformer's output is cut to the target's tokens: what the Euler step integrates, and all the loss sees;
- the dynamic shift is the target's token count alone.
Everything else (prompts, guidance embedding, LoRA files) is FLUX.1 [dev]'s (toolkit/models/flux).
"""

from __future__ import annotations

import dataclasses

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline
from PIL import Image

from toolkit.models.flux.adapter import FluxAdapter, FluxSampling
from toolkit.models.flux_kontext.config import FACTS
from toolkit.models.flux_kontext.files import kontext_files
from toolkit.models.flux_kontext.tiny import ensure_tiny_flux_kontext


def fitted(image: Image.Image, width: int, height: int) -> Image.Image:
    """A picture resized to cover width x height and centre-cropped to it: how training sizes a reference to its
    target (`ReferenceFacts.size` "target")."""
    scale = max(width / image.width, height / image.height)
    resized = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))),
                           Image.Resampling.BICUBIC)
    left, top = (resized.width - width) // 2, (resized.height - height) // 2
    return resized.crop((left, top, left + width, top + height))


class FluxKontextSampling(FluxSampling):
    """FluxKontextPipeline over the current components; a sample's reference is sized to the sample as training sizes
    references to their targets, and the pipeline's own resizing to its preferred resolutions is turned off
    (`_auto_resize`), so that a sample shows what training taught."""

    def pipeline(self) -> FluxKontextPipeline:
        a = self.adapter
        return FluxKontextPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(a.scheduler.config),
                                   vae=a.vae, text_encoder=a.text_encoder, tokenizer=a.tokenizer,
                                   text_encoder_2=a.text_encoder_2, tokenizer_2=a.tokenizer_2,
                                   transformer=a.transformer)

    def size_arguments(self, width: int, height: int) -> dict:
        """The pipeline scales width and height to `max_area` (1024 x 1024 unless told): the sample's own area keeps
        them."""
        return {"width": width, "height": height, "max_area": width * height}

    def reference_arguments(self, images: list[Image.Image], width: int, height: int) -> dict:
        return {"image": fitted(images[0], width, height), "_auto_resize": False}


class FluxKontextAdapter(FluxAdapter):
    arch = "flux_kontext"
    facts = FACTS
    # the FLUX.1 form (ComfyUI, Forge and diffusers read Kontext LoRAs under FLUX.1's names)
    files = dataclasses.replace(FluxAdapter.files, modelspec_architecture="flux-1-kontext-dev/lora")
    sampling_parts = FluxKontextSampling
    tiny_sources = {"tiny": ensure_tiny_flux_kontext}
    default_components = {True: "black-forest-labs/FLUX.1-Kontext-dev", False: "black-forest-labs/FLUX.1-Kontext-dev"}
    single_files = staticmethod(kontext_files)

    def reference_tokens(self, references: list[torch.Tensor], dtype: torch.dtype,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each reference's latents packed as the pipeline packs them, with the target's position layout over the
        reference's own grid and the first coordinate 1 (`FluxKontextPipeline.prepare_latents`)."""
        tokens, ids = [], []
        for latents in references:
            batch, channels, height, width = latents.shape
            tokens.append(FluxPipeline._pack_latents(latents.to(device, dtype), batch, channels, height, width))
            ids.append(self.image_ids(height, width, device, dtype, first=1))
        return torch.cat(tokens, dim=1), torch.cat(ids)

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "variant": "kontext-dev"}



