"""Read a job file (YAML or JSON), tell another trainer's file apart, expand `${ENV}` and `[name]`, validate it
against the schema."""

from __future__ import annotations

import copy
import json
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from toolkit.config.base import DEFERRED_CHECKS, Section
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
        if not isinstance(name, str):  # the schema names a name that is not text
            return data
        if "[name]" in name:
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
        loc = _user_loc(model, _key_loc(model, item))
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


def _key_loc(model: type[BaseModel], item: dict) -> tuple:
    """pydantic's loc of an error, ending at the key it is about and the list indices inside its value (not the
    label pydantic gives a member of a union of plain types: `train.resume`, not `train.resume.bool`)."""
    loc = tuple(item["loc"])
    found = None if item["type"] in ("extra_forbidden", "invalid_key", "union_tag_invalid", "union_tag_not_found") else \
        _key_of(model, loc)
    if found is None:
        return loc
    key, section_loc = found
    inside = loc[len(section_loc) + 1:]
    return section_loc + (key,) + tuple(part for part in inside if isinstance(part, int))


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


@dataclass
class CheckedProcess:
    """One process of a job file, checked: its typed config (`typed`: every key parsed; else `partial`: the sections
    and list items that parsed, for the checks that need only those) and every problem found."""

    typed: BaseModel | None
    partial: BaseModel | None
    problems: list[str]


#: rounds of setting bad keys aside and validating again (each round removes every key pydantic reported)
REPAIR_ROUNDS = 4


def check_process(raw: Any, model: type[BaseModel], where: str, path: Path) -> CheckedProcess:
    """Every problem of one process that its text can show, in one list: each key's type or range error (pydantic),
    then the checks across keys (`Section.problems`) of every section, which pydantic would skip once any key of
    theirs failed. So a bad key does not hide the others: the bad key is set aside (an unknown key removed, a bad
    value replaced by its default) and the rest validated again; the checks of a section that had a value replaced
    are skipped (they would judge the default, not the file). A key that cannot be set aside (a required one) leaves
    the sections and dataset entries that parse on their own."""
    data = copy.deepcopy(raw)
    problems: list[str] = []
    replaced: set[tuple] = set()  # the keys (full paths) whose value is now a default
    typed = None
    for _ in range(REPAIR_ROUNDS):
        try:
            typed = model.model_validate(data, context=DEFERRED_CHECKS)
            break
        except ValidationError as err:
            problems += [line for line in explain_errors(err, model, path, prefix=where) if line not in problems]
            repairs = [set_aside(data, model, item) for item in err.errors()]
            replaced |= {repair[1] for repair in repairs if repair is not None and repair[0] == "replaced"}
            if None in repairs:  # what is left parses section by section (`partly_typed`)
                break
    partial = typed if typed is not None else partly_typed(data, model)
    skip = {key[:-1] for key in replaced if key[:-1]}  # a section whose own value is a default is not judged
    if typed is None:
        skip.add(())  # the process's own checks need all of it
    problems += [f"  {format_loc(loc, where)}: {message}" for loc, message in section_problems(partial, (), skip)
                 if not names_any(loc, message, replaced)]
    return CheckedProcess(typed if not problems else None, partial, problems)


def names_any(loc: tuple, message: str, keys: set[tuple]) -> bool:
    """Whether a check's finding is about one of `keys` (it names the key, by its path or its name): a check that
    read a default put in for a bad value would judge the default, not the file."""
    for key in keys:
        names = [part for part in key if isinstance(part, str)]
        if not names:
            continue
        if tuple(loc[:len(key)]) == key or re.search(rf"(?<!\w){re.escape(names[-1])}(?!\w)", message):
            return True
    return False


def set_aside(data: dict, model: type[BaseModel], item: dict) -> tuple[str, tuple] | None:
    """Take the key an error is about out of `data`: ("removed", its path) for an unknown key, ("replaced", its path)
    for a bad value of a key with a default; None when the key cannot go (required, or not a key)."""
    loc = tuple(item["loc"])
    unknown = item["type"] in ("extra_forbidden", "invalid_key")  # a key not known, or not text (YAML's `1:`)
    if unknown:
        key, section_loc = loc[-1], loc[:-1]
    else:
        found = _key_of(model, loc)
        if found is None:
            return None
        key, section_loc = found
        section = _section_at(model, section_loc)
        if section is None or section.model_fields[key].is_required():
            return None
    holder = data
    for part in _user_loc(model, section_loc):
        try:
            holder = holder[part]
        except (KeyError, IndexError, TypeError):
            return None
    if not isinstance(holder, dict):
        return None
    holder.pop(key, None)  # gone already when a key had two errors
    return ("removed" if unknown else "replaced", _user_loc(model, section_loc) + (key,))


def _key_of(model: type[BaseModel], loc: tuple) -> tuple[str, tuple] | None:
    """(the key, the loc of its section) an error at pydantic's `loc` is about: the first key on the way that holds
    a value rather than a section (what follows it is inside the value: list indices, a union member's label), or
    the deepest section-valued key."""
    found = None
    for index, part in enumerate(loc):
        if not isinstance(part, str):
            continue
        section = _section_at(model, loc[:index])
        if section is None or part not in section.model_fields:
            continue
        found = (part, loc[:index])
        inner = _unwrap_model(section.model_fields[part].annotation)
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)) and not _tagged_members(inner):
            break
    return found


def partly_typed(data: Any, model: type[BaseModel]) -> BaseModel | None:
    """`model` holding the top-level keys of `data` that parse on their own (a list of sections item by item, None
    for an item that does not), the other keys' defaults, and nothing for a required key that did not parse. Each
    key is validated by its own annotation and constraints: the model's validators expect all of its keys."""
    if not isinstance(data, dict):
        return None
    instance = model.model_construct()
    for name, field in model.model_fields.items():
        if name not in data:
            continue
        try:
            value = TypeAdapter(Annotated[field.annotation, field]).validate_python(data[name],
                                                                                  context=DEFERRED_CHECKS)
        except ValidationError:
            item_model = _unwrap_model(field.annotation)
            if not (isinstance(data[name], list) and isinstance(item_model, type)
                    and issubclass(item_model, BaseModel)):
                continue
            value = [_parsed(item_model, item) for item in data[name]]
        object.__setattr__(instance, name, value)
    return instance


def _parsed(model: type[BaseModel], value: Any) -> BaseModel | None:
    try:
        return model.model_validate(value, context=DEFERRED_CHECKS)
    except ValidationError:
        return None


def section_problems(section: Any, loc: tuple, skip: set[tuple]) -> list[tuple[tuple, str]]:
    """(where, message) of the checks across keys of `section` and of every section inside it, skipping the
    sections at `skip`."""
    if not isinstance(section, Section):
        return []
    found = []
    for name in type(section).model_fields:
        value = section.__dict__.get(name)
        for index, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            found += section_problems(item, loc + ((name,) if index is None else (name, index)), skip)
    if loc not in skip:
        found += [(loc + tuple(_key_parts(key)), message) for key, message in section.problems()]
    return found


def _key_parts(key: str) -> list[str | int]:
    """`datasets[0].fps` -> ["datasets", 0, "fps"] (what `format_loc` writes back)."""
    return [int(part) if part.isdigit() else part for part in re.findall(r"[^.\[\]]+", key)]


@dataclass
class CheckedJob:
    """A job file checked: the typed job when it has no problem, else every problem, and the processes as far as
    they parsed (for the path checks that join them)."""

    job: JobConfig | None
    problems: list[str]
    processes: list[BaseModel | None]


def check_job(data: dict[str, Any], path: Path, process_models: typing.Mapping[str, type[BaseModel]]) -> CheckedJob:
    """Validate the job and each process against the model registered for its `type`; every problem at once."""
    problems: list[str] = []
    job = None
    try:
        job = JobConfig.model_validate(data)
    except ValidationError as err:
        problems += explain_errors(err, JobConfig, path)
    body = data.get("config")
    raw_processes = body.get("process") if isinstance(body, dict) else None
    typed, processes = [], []
    for index, raw in enumerate(raw_processes if isinstance(raw_processes, list) else []):
        where = f"config.process[{index}]"
        if not isinstance(raw, dict) or "type" not in raw:
            problems.append(f"  {where}: a process is a mapping with a `type`")
            processes.append(None)
            continue
        model = process_models.get(raw["type"]) if isinstance(raw["type"], str) else None
        if model is None:
            explain = getattr(process_models, "explain_unknown", None)
            detail = explain(raw["type"]) if explain else f"known: {', '.join(sorted(process_models))}"
            problems.append(f"  {where}.type: unknown process type '{raw['type']}' ({detail})")
            processes.append(None)
            continue
        checked = check_process(raw, model, where, path)
        problems += checked.problems
        typed.append(checked.typed)
        processes.append(checked.partial)
    if problems or job is None:
        return CheckedJob(None, problems, processes)
    job.config.process = typed
    return CheckedJob(job, [], processes)


def validate_job(data: dict[str, Any], path: Path, process_models: typing.Mapping[str, type[BaseModel]]) -> JobConfig:
    """The typed job, or one error naming every problem of the file's text (`check_job`)."""
    checked = check_job(data, path, process_models)
    if checked.job is None:
        raise ConfigError(f"{path}: invalid config\n" + "\n".join(checked.problems))
    return checked.job


def check_paths(job: JobConfig, path: Path, only: int | None = None, skip_earlier_outputs: bool = False) -> None:
    """The file-system checks of every process (or of process `only`) (toolkit.config.preflight), all problems at
    once, before any model loads; `skip_earlier_outputs` before the job starts (`process_path_problems`)."""
    problems = process_path_problems(job.config.process, only, skip_earlier_outputs, job.config.name)
    if problems:
        raise ConfigError(f"{path}: " + "\n".join(["paths not found"] + problems))


def process_path_problems(processes: list[BaseModel | None], only: int | None = None,
                          skip_earlier_outputs: bool = False, name: Any = None) -> list[str]:
    """Path problems of each process (or of process `only`), as lines; with `skip_earlier_outputs`, not those
    naming a path inside a folder an earlier process writes (its run folder <training_folder>/<name>, its caches),
    which exists only once that process ran."""
    from toolkit.config.preflight import path_problems, written_folders

    lines, written = [], []
    for index, process in enumerate(processes):
        if process is None:
            continue
        if only in (None, index):
            lines += [f"  config.process[{index}].{problem}" for problem in path_problems(process, written)]
        if skip_earlier_outputs:
            written += [folder / name if key == "training_folder" and isinstance(name, str) else folder
                        for key, folder in written_folders(process)]
    return lines


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
    checked = check_job(data, path, process_models)
    if checked.job is None:  # with the path problems: one message names everything to fix
        body = data.get("config")
        name = body.get("name") if isinstance(body, dict) else None
        paths = process_path_problems(checked.processes, skip_earlier_outputs=True, name=name)
        raise ConfigError(f"{path}: invalid config\n" + "\n".join(checked.problems + paths))
    return checked.job, path
