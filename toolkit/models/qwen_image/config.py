"""`model` keys of Qwen-Image (`arch: qwen_image`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from toolkit.models.config import FamilyFacts, ModelConfigBase, QuantizedBaseOptions, TextFilesOptions

FACTS = FamilyFacts(title="Qwen-Image")


class QwenImageModelConfig(TextFilesOptions, QuantizedBaseOptions, ModelConfigBase):
    """`model` with `arch: qwen_image`: Qwen-Image (a 20B MMDiT, the Qwen2.5-VL 7B text encoder, a 16-channel
    VAE). With `quantize`, the transformer is read and quantized one block at a time, so loading never holds it
    in full precision; `quantize_te` quantizes the text encoder as its weights load."""

    arch: Literal["qwen_image"] = Field(..., description="qwen_image: Qwen-Image.",
                                        json_schema_extra={"aka": ["model_type", "base_model"]})
    single_file_config: str | None = Field(
        None, description="For a single-file transformer (e.g. ComfyUI's qwen_image_bf16.safetensors): the diffusers "
        "folder or hub id that gives the transformer config, text encoder, tokenizer, VAE and scheduler; default "
        "Qwen/Qwen-Image.")
    max_sequence_length: int = Field(
        1024, ge=1, le=1024, description="Prompt tokens kept after the template (QwenImagePipeline's "
        "`max_sequence_length`; longer prompts are cut, and said so). Batches are padded to their longest prompt "
        "only, with a mask.")

    facts: ClassVar[FamilyFacts] = FACTS
