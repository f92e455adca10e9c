"""`model` keys of FLUX.1 (`arch: flux`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from toolkit.models.config import FamilyFacts, ModelConfigBase, PartFilesOptions, QuantizedBaseOptions

FACTS = FamilyFacts(title="FLUX.1", guidance_embedding=True, negative_prompt=False)


class FluxModelConfig(PartFilesOptions, QuantizedBaseOptions, ModelConfigBase):
    """`model` with `arch: flux`: FLUX.1 [dev] or [schnell] (a 12B MMDiT, CLIP-L and T5-XXL text encoders,
    16-channel VAE); [schnell] is recognised by its transformer having no guidance embedding."""

    arch: Literal["flux"] = Field(..., description="flux: FLUX.1 [dev] or [schnell].",
                                  json_schema_extra={"aka": ["model_type", "base_model"]})
    single_file_config: str | None = Field(
        None, description="For a single-file transformer: a diffusers folder or hub id whose configs describe it "
        "(for a file of no variant difftune knows) and which gives the parts no file is named for (text encoders, "
        "VAE, tokenizers). Default: the variant's configs ship with difftune; parts not given as files come from "
        "black-forest-labs/FLUX.1-dev (or -schnell).")
    max_sequence_length: int | None = Field(
        None, ge=1, le=512, description="T5 tokens per prompt (prompts are padded and cut to it). Default: 512 for "
        "[dev], 256 for [schnell] (read from the transformer: [schnell] has no guidance embedding), as FluxPipeline "
        "documents them.")

    facts: ClassVar[FamilyFacts] = FACTS
