"""`model` keys of Wan (`arch: wan`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from toolkit.config.base import Problem, aka
from toolkit.models.config import FamilyFacts, ModelConfigBase, QuantizedBaseOptions, is_single_file

FACTS = FamilyFacts(title="Wan", frame_step=4, file_parts=("high_noise", "low_noise"))


class WanModelConfig(QuantizedBaseOptions, ModelConfigBase):
    """`model` with `arch: wan`: Wan 2.1 (T2V 1.3B / 14B) and Wan 2.2 (TI2V-5B; A14B with its high-noise and
    low-noise experts), the UMT5 text encoder, the Wan VAE (16 channels; 48 for TI2V-5B). Trains on clips and
    images (a one-frame clip)."""

    arch: Literal["wan"] = Field(..., description="wan: Wan 2.1 / 2.2 text-to-video.",
                                 json_schema_extra={"aka": ["model_type", "base_model"]})
    name_or_path: str = Field(
        ..., description="A diffusers folder or hub id (e.g. Wan-AI/Wan2.2-T2V-A14B-Diffusers; single-file "
        "transformers are not read yet), or `tiny` (Wan 2.1), `tiny-wan2.2-5b`, `tiny-wan2.2-a14b` for small random "
        "models built offline.", json_schema_extra=aka("path", "pretrained_model_name_or_path", "model_path"))
    max_sequence_length: int = Field(
        512, ge=1, le=512, description="Prompt tokens the text encoder keeps (WanPipeline's `max_sequence_length`; "
        "the transformer always sees them zero-padded to 512, as the pipeline gives them).")
    experts: list[Literal["high_noise", "low_noise"]] | None = Field(
        None, min_length=1, description="Wan 2.2 A14B (two transformers switching at the model's boundary): the "
        "experts that get a LoRA, each trained only on the noise levels of its own range (high_noise: timesteps from "
        "the boundary up, 875 of 1000 for T2V; low_noise: below it), each written to its own file "
        "(<name>_high_noise.safetensors, <name>_low_noise.safetensors). Default: both. Models with one transformer "
        "refuse it.")
    expert_switch_every: int = Field(
        1, ge=1, description="With both experts trained: updates one expert trains before the other takes over "
        "(update n trains experts[(n // N) % 2]).", json_schema_extra=aka("switch_boundary_every"))

    @field_validator("experts")
    @classmethod
    def _each_expert_once(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError(f"name each expert once, got {value}")
        return value

    facts: ClassVar[FamilyFacts] = FACTS

    def problems(self) -> list[Problem]:
        if is_single_file(self.name_or_path):
            return [("name_or_path", "Wan loads from a diffusers folder or hub id (e.g. "
                     "Wan-AI/Wan2.1-T2V-1.3B-Diffusers); single-file transformers are not read")]
        return []
