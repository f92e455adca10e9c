"""What every config section shares: unknown keys are errors, defaults are validated, other trainers' names are
known. Imports nothing but pydantic, so that a family's config module can build on it without loops."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

DType = Literal["float32", "float16", "bfloat16", "fp32", "fp16", "bf16"]
QType = Literal["qfloat8", "qint8", "qint4"]
#: the half precisions by each of their config names: `model.dtype` and `train.dtype` must not name two different ones
HALF_PRECISIONS = {"fp16": "fp16", "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


def aka(*names: str) -> dict[str, Any]:
    """Field metadata: other trainers' names for this key (used for "did you mean" hints)."""
    return {"aka": list(names)}


#: a check's finding: (the key it is about, relative to the section; "" for the section as a whole, message)
Problem = tuple[str, str]

#: validation context under which sections leave their checks across keys (`Section.problems`) to the caller: the
#: job loader collects every problem of a file, type errors and checks together (toolkit.config.loader)
DEFERRED_CHECKS = {"checks": "deferred"}


class Section(BaseModel):
    """A config section: unknown keys are errors; defaults validated like user values. Checks across several keys
    are `problems()`: run after the keys parse, raised as one error, except under `DEFERRED_CHECKS`."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    def problems(self) -> list[Problem]:
        """What is wrong with this section's keys taken together (each key's own type and range is the schema's)."""
        return []

    @model_validator(mode="after")
    def _checked(self, info: ValidationInfo) -> Section:
        if isinstance(info.context, dict) and info.context.get("checks") == DEFERRED_CHECKS["checks"]:
            return self
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(f"{key}: {message}" if key else message for key, message in problems))
        return self

    def section(self, cls: type[SectionT]) -> SectionT:
        """The keys of `cls` that this (larger) section also holds, as a `cls` of their own: what a consumer that
        takes only that group (e.g. the optimizer factory) receives."""
        return cls.model_validate({name: getattr(self, name) for name in cls.model_fields})


from typing import TypeVar  # noqa: E402  (after Section, which it names)

SectionT = TypeVar("SectionT", bound=Section)
