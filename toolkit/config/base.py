"""What every config section shares: unknown keys are errors, defaults are validated, other trainers' names are
known. Imports nothing but pydantic, so that a family's config module can build on it without loops."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

DType = Literal["float32", "float16", "bfloat16", "fp32", "fp16", "bf16"]
QType = Literal["qfloat8", "qint8", "qint4"]


def aka(*names: str) -> dict[str, Any]:
    """Field metadata: other trainers' names for this key (used for "did you mean" hints)."""
    return {"aka": list(names)}


class Section(BaseModel):
    """A config section: unknown keys are errors; defaults validated like user values."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    def section(self, cls: type[SectionT]) -> SectionT:
        """The keys of `cls` that this (larger) section also holds, as a `cls` of their own: what a consumer that
        takes only that group (e.g. the optimizer factory) receives."""
        return cls.model_validate({name: getattr(self, name) for name in cls.model_fields})


from typing import TypeVar  # noqa: E402  (after Section, which it names)

SectionT = TypeVar("SectionT", bound=Section)
