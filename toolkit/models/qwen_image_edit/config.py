"""`model` keys of Qwen-Image-Edit (`arch: qwen_image_edit`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from toolkit.config.base import Problem, aka
from toolkit.models.config import FamilyFacts, ModelConfigBase, QuantizedBaseOptions, ReferenceFacts, is_single_file

#: the pipelines' reference area (`VAE_IMAGE_SIZE`, 1024 x 1024) at the reference's own aspect ratio, sides multiples
#: of 32 (`calculate_dimensions`); up to three references (the Plus models; the first version takes one); a sample
#: without one trains from its instruction alone
REFERENCES = ReferenceFacts(slots=3, optional=True, size="budget", multiple=32, area=1024 * 1024, in_text=True)
FACTS = FamilyFacts(title="Qwen-Image-Edit", references=REFERENCES)

#: the versions, as `model.version` names them
VERSIONS = ("edit", "2509", "2511")


class QwenImageEditModelConfig(QuantizedBaseOptions, ModelConfigBase):
    """`model` with `arch: qwen_image_edit`: Qwen-Image-Edit (one reference image) and Qwen-Image-Edit-Plus 2509 and
    2511 (up to three): the Qwen-Image transformer given the references' latents beside the target's, and the
    Qwen2.5-VL text encoder reading the references with the instruction."""

    arch: Literal["qwen_image_edit"] = Field(..., description="qwen_image_edit: Qwen-Image-Edit, Edit-2509 and "
                                             "Edit-2511, image editing with reference images "
                                             "(`datasets[].control_path`).",
                                             json_schema_extra={"aka": ["model_type", "base_model"]})
    single_file_config: str | None = Field(
        None, description="For a single-file transformer: the diffusers folder or hub id that gives the transformer "
        "config, text encoder, processor, tokenizer, VAE and scheduler; default the Qwen/Qwen-Image-Edit repo of "
        "`version`.")
    version: Literal["edit", "2509", "2511"] | None = Field(
        None, description="Which model: `edit` (the first, one reference), `2509` or `2511` (Edit-Plus, up to three). "
        "Read from a diffusers folder (its pipeline class, and the transformer's config for 2511), where a value "
        "given here must agree; needed for a single file, which does not tell.",
        json_schema_extra=aka("edit_version"))
    reference_pixels: int | Literal["target"] | None = Field(
        None, description="The pixel area each reference image is trained at (its own aspect ratio kept, sides "
        "multiples of 32): a number, or `target` for its target's bucket's area. Default the pipelines' 1024 x 1024, "
        "which samples use too; a smaller area trains faster on references the model then sees larger at inference.")

    @field_validator("reference_pixels")
    @classmethod
    def _an_area(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 64 * 64:
            raise ValueError("give an area of at least 4096 pixels (64 x 64), or `target`")
        return value

    facts: ClassVar[FamilyFacts] = FACTS

    def problems(self) -> list[Problem]:
        problems = super().problems()
        if is_single_file(self.name_or_path) and self.version is None:
            problems.append(("version", "a single transformer file does not say which Qwen-Image-Edit it is: set "
                             "`edit`, `2509` or `2511`"))
        return problems
