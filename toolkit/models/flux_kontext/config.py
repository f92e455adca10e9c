"""`model` keys of FLUX.1 Kontext (`arch: flux_kontext`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from toolkit.models.config import FamilyFacts, ReferenceFacts
from toolkit.models.flux.config import FluxModelConfig

#: one reference image per sample, resized to the target's bucket as Kontext's training pairs are; a sample without
#: one trains as FLUX.1 [dev] does (Kontext generates from text alone too)
FACTS = FamilyFacts(title="FLUX.1 Kontext", guidance_embedding=True, negative_prompt=False,
                    references=ReferenceFacts(slots=1, optional=True, size="target"))


class FluxKontextModelConfig(FluxModelConfig):
    """`model` with `arch: flux_kontext`: FLUX.1 Kontext [dev] (the FLUX.1 [dev] layout, trained to edit a reference
    image: its latents join the target's as tokens with position ids of their own)."""

    arch: Literal["flux_kontext"] = Field(..., description="flux_kontext: FLUX.1 Kontext [dev], image editing with "
                                          "a reference image (`datasets[].control_path`).",
                                          json_schema_extra={"aka": ["model_type", "base_model"]})
    single_file_config: str | None = Field(
        None, description="For a single-file transformer: a diffusers folder or hub id whose configs describe it "
        "(for a file of no variant difftune knows) and which gives the parts no file is named for (text encoders, "
        "VAE, tokenizers). Default: the variant's configs ship with difftune; parts not given as files come from "
        "black-forest-labs/FLUX.1-Kontext-dev.")

    facts: ClassVar[FamilyFacts] = FACTS
