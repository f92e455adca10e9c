"""Generate docs/config.md from the schema, so the reference cannot drift from the code.

    python -m toolkit.config.docs > docs/config.md
"""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from toolkit.config.loader import _tagged_members, _unwrap_model
from toolkit.config.schema import JobBody, JobConfig, SDTrainerConfig

INTRO = """# Config reference

Generated from `toolkit/config/schema.py` by `python -m toolkit.config.docs > docs/config.md`;
a test fails when this file and the schema disagree.

A job file is YAML or JSON. Strings may use `${ENV_VAR}` (or `${ENV_VAR:-default}`) and `[name]`
(filled by `--name`, or by `config.name`). Unknown keys are errors that name the file and the dotted
path and suggest a key only where it means the same (a close spelling in the same section, or another
trainer's name for the setting). Every problem a file shows is reported at once, before any model loads:
wrong types and ranges, unknown keys, keys that do not go together or that the model family cannot use,
and missing folders and files. Relative paths are relative to the directory you run from.
"""


def _type_name(annotation) -> str:
    if _tagged_members(annotation):
        return "section of the `arch` family"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(arg) for arg in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if isinstance(value, BaseModel) or value is PydanticUndefined:
        return "see section"
    return f"`{value!r}`" if value is not None else "`None`"


def section(title: str, model: type[BaseModel], seen: set, prefix: str | None = None) -> list[str]:
    """A table of the model's keys, then a section per nested model (`prefix.key`)."""
    prefix = prefix or title
    lines = [f"## {title}", "", (model.__doc__ or "").strip(), "", "| key | type | default | description |",
             "| --- | --- | --- | --- |"]
    children = []
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
        for tag, member in _tagged_members(field.annotation).items():
            if member not in seen:
                seen.add(member)
                children.append((f"`{prefix}.{name}` (`{field.discriminator}: {tag}`)", f"{prefix}.{name}", member))
        inner = _unwrap_model(field.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in seen:
            seen.add(inner)
            children.append((f"`{prefix}.{name}`", f"{prefix}.{name}", inner))
    lines.append("")
    for child_title, child_prefix, child in children:
        lines += section(child_title, child, seen, prefix=child_prefix)
    return lines


def render() -> str:
    seen: set = {JobConfig, JobBody, SDTrainerConfig}
    lines = [INTRO]
    lines += section("job file", JobConfig, seen)
    lines += section("`config`", JobBody, seen, prefix="config")
    lines += section("process type `sd_trainer`", SDTrainerConfig, seen, prefix="process")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
