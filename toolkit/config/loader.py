"""Read a job file (YAML or JSON), tell another trainer's file apart, expand `${ENV}` and `[name]`, validate it
against the schema."""

from __future__ import annotations

import json
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ValidationError

from toolkit.config.importers.detect import detect
from toolkit.config.schema import JobConfig
from toolkit.errors import UserError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

CONFIG_SUFFIXES = (".yaml", ".yml", ".json", ".toml")
ENV_PATTERN = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")


class ConfigError(UserError):
    """A job file that cannot be used; the message names the file and the key."""


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-4` as a float (YAML 1.1 needs a dot, so PyYAML reads a string)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def resolve_config_path(arg: str, config_root: Path) -> Path:
    """A config argument is a path, or a name looked up under `config_root` (with or without suffix)."""
    candidates = [Path(arg)]
    for base in (config_root, config_root / "examples"):
        candidates.append(base / arg)
        candidates += [base / f"{arg}{suffix}" for suffix in CONFIG_SUFFIXES]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise ConfigError(f"config '{arg}' not found (looked for: {tried})")


def read_raw(path: Path) -> dict[str, Any]:
    """A job file's mapping: YAML (safe, no `!!python` tags), JSON, or TOML (the form other trainers save theirs in,
    read so that such a file is recognised, `toolkit.config.importers.detect`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read it as a UTF-8 text file: {err}") from err
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.load(text, Loader=_YamlLoader)
    except (json.JSONDecodeError, yaml.YAMLError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{path}: cannot parse: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a job file is a mapping with `job`, `config` and `meta` keys")
    return data


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


def expand_env(data: Any, path: Path, environ: typing.Mapping[str, str]) -> Any:
    """Replace `${VAR}` (or `${VAR:-default}`) in every string; a missing variable is an error."""

    def expand(text: str) -> str:
        def one(match: re.Match) -> str:
            name, default = match.group(1), match.group(2)
            if name in environ:
                return environ[name]
            if default is not None:
                return default
            raise ConfigError(f"{path}: environment variable ${{{name}}} is not set")

        return ENV_PATTERN.sub(one, text)

    return _map_strings(data, expand)


def substitute_name(data: dict[str, Any], path: Path, name: str | None) -> dict[str, Any]:
    """Fill `[name]` in every string with `--name`, or with `config.name` when no `--name` is given."""
    body = data.get("config")
    if name is None:
        name = body.get("name") if isinstance(body, dict) else None
        if isinstance(name, str) and "[name]" in name:
            raise ConfigError(f"{path}: config.name is '{name}'; pass --name to fill [name]")
    if name is None:
        return data
    return _map_strings(data, lambda s: s.replace("[name]", name))


def format_loc(loc: tuple, prefix: str = "") -> str:
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _section_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that holds the last key of `loc` (walking fields, list items and, for `model`, the
    family chosen by its `arch`)."""
    current: Any = model
    for part in loc:
        current = _unwrap_model(current)
        if isinstance(part, int):
            continue
        members = _tagged_members(current)
        if part in members:
            current = members[part]
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        current = current.model_fields[part].annotation
    current = _unwrap_model(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _tagged_members(annotation: Any) -> dict[str, type[BaseModel]]:
    """A tagged union's members by tag (e.g. `model`: arch -> the family's config class): a union of sections that
    all have one key typed as a Literal. Empty for anything else."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return {}
    members = typing.get_args(annotation)
    if not all(isinstance(m, type) and issubclass(m, BaseModel) for m in members):
        return {}
    tags = [name for name in members[0].model_fields
            if all(typing.get_origin(m.model_fields[name].annotation) is typing.Literal
                   for m in members if name in m.model_fields) and all(name in m.model_fields for m in members)]
    if not tags:
        return {}
    return {value: member for member in members for value in typing.get_args(member.model_fields[tags[0]].annotation)}


def _field_annotation(model: type[BaseModel], loc: tuple) -> Any:
    """The annotation of the field at a user-level `loc` (list indices skipped)."""
    current: Any = model
    for part in loc:
        current = _unwrap_model(current)
        if isinstance(part, int):
            continue
        current = current.model_fields[part].annotation
    return current


def _user_loc(model: type[BaseModel], loc: tuple) -> tuple:
    """`loc` as the user wrote it: pydantic puts the chosen tag of a discriminated union (`model.zimage.qtype`)
    into the path; the job file has no such level."""
    out, current = [], model
    for part in loc:
        current = _unwrap_model(current)
        if isinstance(part, int):
            out.append(part)
            continue
        members = _tagged_members(current)
        if part in members:
            current = members[part]
            continue
        out.append(part)
        fields = getattr(current, "model_fields", {}) if isinstance(current, type) else {}
        current = fields[part].annotation if part in fields else None
    return tuple(out)


def _unwrap_model(annotation: Any) -> Any:
    """list[X] -> X, X | None -> X; anything else unchanged."""
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        return _unwrap_model(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else annotation
    return annotation


#: other trainers' names for a difftune setting kept in another section: (the section they put it in, their
#: name) -> the difftune key. Only settings that mean the same (tests/test_importers.py checks each one against the
#: importers' rules); a name of another meaning gets no hint.
ELSEWHERE: dict[tuple[str, str], str] = {
    ("model", "compile"): "train.compile",
    ("model", "gradient_checkpointing"): "train.gradient_checkpointing",
    ("train", "network_dim"): "network.linear",
    ("train", "network_alpha"): "network.linear_alpha",
    ("train", "train_text_encoder"): "network.train_text_encoder",
    ("train", "trigger_word"): "trigger_word",
    ("train", "save_every"): "save.save_every",
    ("train", "save_every_n_steps"): "save.save_every",
    ("train", "sample_every"): "sample.sample_every",
    ("train", "sample_every_n_steps"): "sample.sample_every",
    ("train", "cache_latents"): "datasets[].cache_latents",
    ("train", "cache_latents_to_disk"): "datasets[].cache_latents_to_disk",
    ("train", "caption_extension"): "datasets[].caption_ext",
    ("train", "shuffle_caption"): "datasets[].shuffle_tokens",
    ("train", "keep_tokens"): "datasets[].keep_tokens",
    ("train", "caption_dropout_rate"): "datasets[].caption_dropout_rate",
    ("train", "output_dir"): "training_folder",
}


def suggest_key(section: type[BaseModel] | None, key: str) -> str | None:
    """The known key of `section` that `key` is a typo of (or a typo of another trainer's name for it, from the
    fields' `aka`): the nearest name within `typo_allowance` edits, and only when every name that near means the
    same key. Names that merely look alike (`noise_scheduler` and `lr_scheduler`) are not typos of each other, and
    a hint toward a key of another meaning would run another training."""
    if section is None:
        return None
    names: dict[str, str] = {}
    for field_name, field in section.model_fields.items():
        names[field_name] = field_name
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        for other in extra.get("aka", []):
            names.setdefault(other, field_name)
    distances = {name: edit_distance(key.lower(), name.lower()) for name in names}
    nearest = min(distances.values(), default=None)
    if nearest is None or nearest > typo_allowance(key):
        return None
    meant = {names[name] for name, distance in distances.items() if distance == nearest}
    return meant.pop() if len(meant) == 1 else None


def typo_allowance(key: str) -> int:
    """How many edits a typo of `key` may hold: 1 for short keys, 2 up to 12 characters, 3 beyond."""
    return 1 if len(key) <= 4 else 2 if len(key) <= 12 else 3


def edit_distance(a: str, b: str) -> int:
    """Edits (insertions, deletions, substitutions, swaps of neighbours) that turn `a` into `b`: the optimal string
    alignment distance. difflib's ratio, the standard library's only measure, rates `samples` and `sample_steps`
    alike, so the typo test needs this one."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, char_b in enumerate(b, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b))
            if i > 1 and j > 1 and char_a == b[j - 2] and a[i - 2] == char_b:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[len(b)]


def explain_errors(err: ValidationError, model: type[BaseModel], path: Path, prefix: str = "") -> list[str]:
    lines = []
    for item in err.errors():
        loc = _user_loc(model, tuple(item["loc"]))
        where = format_loc(loc, prefix) or prefix or "(top level)"
        if item["type"] == "extra_forbidden":
            msg = _unknown_key(_section_at(model, tuple(item["loc"])[:-1]), str(loc[-1]), _section_name(loc))
        elif item["type"] == "missing":
            msg = "required key is missing"
        elif item["type"] in ("union_tag_invalid", "union_tag_not_found"):
            tag = item["ctx"]["discriminator"].strip("'")
            where = format_loc(loc + (tag,), prefix)
            given = item["ctx"].get("tag")
            expected = ", ".join(_tagged_members(_field_annotation(model, loc)))
            msg = (f"unknown {tag} '{given}' (known: {expected})" if item["type"] == "union_tag_invalid"
                   else f"required key is missing (one of: {expected})")
        else:
            msg = item["msg"]
        lines.append(f"  {where}: {msg}")
    return lines


def _section_name(loc: tuple) -> str:
    """The name of the section an unknown key stands in (`train`, `model`, ...; '' at the process level)."""
    names = [part for part in loc[:-1] if isinstance(part, str)]
    return names[-1] if names and names[-1] not in ("config", "process") else ""


def _unknown_key(section: type[BaseModel] | None, key: str, section_name: str = "") -> str:
    """The message for a key `section` does not have: a close name of the same section (or the same setting in another
    section, `ELSEWHERE`), or, in a family's `model` section, which families do have it."""
    elsewhere = ELSEWHERE.get((section_name, key))
    if elsewhere is not None:
        return f"unknown key here (did you mean '{elsewhere}'? it is set there in difftune)"
    hint = suggest_key(section, key)
    others = getattr(section, "facts", None) is not None and _families_with_key(key)
    if others:
        arch = typing.get_args(section.model_fields["arch"].annotation)
        return f"not a key of arch {arch[0] if arch else '?'} (only of: {', '.join(others)})"
    return "unknown key" + (f" (did you mean '{hint}'?)" if hint else "")


def _families_with_key(key: str) -> list[str]:
    from toolkit.models.registry import available_archs, config_class

    return [arch for arch in available_archs() if key in config_class(arch).model_fields]


def validate_job(data: dict[str, Any], path: Path, process_models: typing.Mapping[str, type[BaseModel]]) -> JobConfig:
    """Validate the job and each process against the model registered for its `type`; all errors at once."""
    problems: list[str] = []
    try:
        job = JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{path}: invalid config\n" + "\n".join(explain_errors(err, JobConfig, path))) from None
    typed = []
    for index, raw in enumerate(job.config.process):
        where = f"config.process[{index}]"
        if not isinstance(raw, dict) or "type" not in raw:
            problems.append(f"  {where}: a process is a mapping with a `type`")
            continue
        model = process_models.get(raw["type"])
        if model is None:
            explain = getattr(process_models, "explain_unknown", None)
            detail = explain(raw["type"]) if explain else f"known: {', '.join(sorted(process_models))}"
            problems.append(f"  {where}.type: unknown process type '{raw['type']}' ({detail})")
            continue
        try:
            typed.append(model.model_validate(raw))
        except ValidationError as err:
            problems += explain_errors(err, model, path, prefix=where)
    if problems:
        raise ConfigError(f"{path}: invalid config\n" + "\n".join(problems))
    job.config.process = typed
    return job


def check_paths(job: JobConfig, path: Path, only: int | None = None) -> None:
    """The file-system checks of every process (or of process `only`) (toolkit.config.preflight), all problems at
    once, before any model loads."""
    from toolkit.config.preflight import path_problems

    problems = [f"  config.process[{index}].{problem}" for index, process in enumerate(job.config.process)
                if only in (None, index) for problem in path_problems(process)]
    if problems:
        raise ConfigError(f"{path}: " + "\n".join(["paths not found"] + problems))


def load_config(
    arg: str,
    process_models: typing.Mapping[str, type[BaseModel]],
    name: str | None = None,
    config_root: Path = Path("config"),
    environ: typing.Mapping[str, str] | None = None,
) -> tuple[JobConfig, Path]:
    """Load, expand and validate one job file. Returns the config and the file it came from."""
    path = resolve_config_path(arg, config_root)
    data = read_raw(path)
    foreign = detect(data, frozenset(process_models))
    if foreign is not None:  # one message for the whole file: its keys would each be "unknown"
        raise ConfigError(foreign.message(str(path)))
    data = expand_env(data, path, os.environ if environ is None else environ)
    data = substitute_name(data, path, name)
    return validate_job(data, path, process_models), path
