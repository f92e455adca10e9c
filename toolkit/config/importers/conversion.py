"""What an import produces, whatever the source trainer: the difftune job, one row per source key (what it became,
or why it was dropped), the defaults the source trainer applies that had to be written out, and the "check these"
list of keys whose meaning differs. Torch-free."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.errors import UserError

#: a missing value, told apart from None (which a job file can hold)
MISSING = object()


class ImportRefused(UserError, ValueError):
    """A file the importer cannot turn into a difftune job that means the same training (the message says why)."""


@dataclass(frozen=True)
class Row:
    """One line of the import table: a source key (or `(default)` for a value the source trainer assumes) and what
    it became: `-> difftune.key = value`, or `dropped: reason`. `kind` says what the row claims, for the tests that
    hold each claim to the written job: `mapped` (`target` was written as `value`), `same` (difftune's default at
    `target` means what the source value means: only keys of the importer's SAME_AS_DIFFTUNE table), `dropped`,
    `unhandled` (read by no rule: an importer gap, reported as dropped), or "" (a note)."""

    source: str
    outcome: str
    kind: str = ""
    target: str | None = None
    value: Any = None


def flatten(value: Any, prefix: str = "", leaves: tuple[str, ...] = ()) -> dict[str, Any]:
    """Dotted leaf paths of a nested mapping (`datasets[0].folder_path`); a key whose path ends with one of `leaves`
    (a mapping or list kept whole, e.g. `optimizer_params`) is one leaf."""
    if isinstance(value, dict) and not any(prefix == leaf or prefix.endswith("." + leaf) for leaf in leaves):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key), leaves))
        return out or {prefix: value}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value) and \
            not any(prefix.endswith(leaf) for leaf in leaves):
        out = {}
        for index, item in enumerate(value):
            out.update(flatten(item, f"{prefix}[{index}]", leaves))
        return out
    return {prefix: value}


class Source:
    """A source process as dotted leaf paths; every path an importer reads is marked, so that what no rule read is
    reported too (never silently lost)."""

    def __init__(self, data: dict[str, Any], leaves: tuple[str, ...] = ()):
        self.values = flatten(data, leaves=leaves)
        self.read: set[str] = set()
        #: the path read last (an error converting its value names it)
        self.last = ""

    def has(self, path: str) -> bool:
        return path in self.values

    def take(self, path: str, default: Any = MISSING) -> Any:
        """The value at `path` (marked as read), or `default`."""
        if path in self.values:
            self.read.add(path)
            self.last = path
            return self.values[path]
        return default

    def under(self, prefix: str) -> list[str]:
        """The paths under `prefix` (e.g. every key of `datasets[0]`)."""
        return [p for p in self.values if p == prefix or p.startswith((prefix + ".", prefix + "["))]

    def unread(self) -> list[str]:
        return [p for p in self.values if p not in self.read]


@dataclass
class Conversion:
    """The job being written and the report of how."""

    trainer: str
    job: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    @property
    def process(self) -> dict[str, Any]:
        return self.job["config"]["process"][0]

    def put(self, target: str, value: Any) -> None:
        """Set `target` (dotted, relative to the process; `datasets[1].x` addresses a dataset the importer made) in
        the job."""
        node: Any = self.process
        parts = re.findall(r"\[\d+\]|[^.\[\]]+", target)
        for part in parts[:-1]:
            node = node[int(part[1:-1])] if part.startswith("[") else node.setdefault(part, {})
        last = parts[-1]
        node[int(last[1:-1]) if last.startswith("[") else last] = value

    def get(self, target: str) -> Any:
        """The value written at `target` (MISSING where nothing is)."""
        node: Any = self.process
        for part in re.findall(r"\[\d+\]|[^.\[\]]+", target):
            index = int(part[1:-1]) if part.startswith("[") else part
            try:
                node = node[index]
            except (KeyError, IndexError, TypeError):
                return MISSING
        return node

    def mapped(self, source: str, target: str, value: Any, note: str = "") -> None:
        self.put(target, value)
        self.wrote(source, target, note)

    def wrote(self, source: str, target: str, note: str = "") -> None:
        """The row of a value already put at `target` (one source key setting several targets, or one target
        from several keys)."""
        value = self.get(target)
        self.rows.append(Row(source, f"-> {target} = {show(value)}" + (f"  ({note})" if note else ""), "mapped",
                             target, value))

    def assumed(self, target: str, value: Any, why: str) -> None:
        """A value the source trainer assumes where its file says nothing, written out because difftune's default
        differs."""
        self.put(target, value)
        self.rows.append(Row("(default)", f"-> {target} = {show(value)}  ({why})", "mapped", target, value))

    def dropped(self, source: str, reason: str) -> None:
        self.rows.append(Row(source, f"dropped: {reason}", "dropped"))

    def same(self, source: str, target: str, value: Any) -> None:
        """Nothing to write: difftune's default at `target` (`value`) means what the source's value means."""
        self.rows.append(Row(source, f"-> nothing to write: difftune's {target} is {show(value)} by default too",
                             "same", target, value))

    def sources_of(self, target: str) -> list[str]:
        """The source keys whose rows wrote `target` (or a key under it, or the mapping it is in)."""
        found = [row.source for row in self.rows if row.kind == "mapped" and row.target and (
            row.target == target or row.target.startswith(target + ".") or target.startswith(row.target + "."))]
        return list(dict.fromkeys(found))

    def refusal(self, source: Path, problems: list[str]) -> str:
        """Why difftune refuses the job imported from `source`, each problem (`config.process[0].key: why`) told by
        the source keys that made its difftune key."""
        lines = [f"{source}: the {self.trainer} job asks for what difftune refuses (nothing was written):"]
        for problem in problems:
            key, _, why = problem.strip().partition(": ")
            target = re.sub(r"^config\.process\[0\]\.", "", key)
            sources = self.sources_of(target)
            said = ", ".join(s for s in sources if s != "(default)") or (
                f"{self.trainer}'s default" if sources else "the import")
            lines.append(f"  {said} (difftune's {target}): {self.with_sources(why)}")
        return "\n".join(lines)

    def with_sources(self, text: str) -> str:
        """`text` with each difftune key in it followed by the source keys that made it."""
        def named(match: re.Match) -> str:
            sources = [s for s in self.sources_of(match.group(0)) if s != "(default)"]
            return f"{match.group(0)} (your {', '.join(sources)})" if sources else match.group(0)

        return re.sub(r"\b(?:model|network|train|sample|save|datasets\[\d+\])\.[a-z_]+\b", named, text)

    def check(self, text: str) -> None:
        if text not in self.checks:
            self.checks.append(text)

    def table(self) -> str:
        """The report printed after an import: the rows, then the "check these" list."""
        width = min(44, max((len(r.source) for r in self.rows), default=10))
        lines = [f"{self.trainer} key".ljust(width) + "  difftune", "-" * (width + 10)]
        lines += [f"{r.source.ljust(width)}  {r.outcome}" for r in self.rows]
        if self.checks:
            lines += ["", "Check these (the meaning differs, or nothing in difftune matches exactly):"]
            lines += [f"  - {text}" for text in self.checks]
        return "\n".join(lines)


#: what a job's precision (model.dtype and train.dtype both set to it) does on each device, for the import rows
#: (docs/architecture.md "Precision": fp16 and bf16 train on CUDA and on the CPU alike)
PRECISION_ON_DEVICES = {
    "fp32": "float32 throughout, on CUDA and on the CPU",
    "bf16": "bf16 base weights and bf16 autocast, on CUDA and on the CPU alike; the LoRA, its gradients and its "
            "optimizer state stay float32",
    "fp16": "fp16 base weights and fp16 autocast with a dynamic loss scale (a GradScaler), on CUDA and on the CPU "
            "alike; the LoRA, its gradients and its optimizer state stay float32",
}


def show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Rules:
    """What each trainer's rules share: reading the source (`take`), a value or the trainer's own default written
    out (`value_or_default`, through the subclass's `same`), and rows for keys a rule read but wrote nothing for."""

    def __init__(self, source: Source, out: Conversion):
        self.src, self.out = source, out

    def take(self, key: str, default: Any = MISSING) -> Any:
        return self.src.take(key, default)

    def named(self, key: str) -> str:
        """A row's source: the key, or `(default)` where the file leaves it to the source trainer's default."""
        return key if self.src.has(key) else "(default)"

    def same(self, key: str, target: str, convert=None) -> Any:
        raise NotImplementedError

    def value_or_default(self, key: str, target: str, default: Any, convert=None) -> Any:
        """`key` to `target`; where the file is silent, the source trainer's `default` written out (it differs from
        difftune's)."""
        value = self.same(key, target, convert)
        if value is MISSING:
            value = convert(default) if convert else default
            self.out.assumed(target, value, f"{self.out.trainer}'s default for {key}")
        return value

    #: source keys (a dataset's as `datasets[].key`) whose value means what difftune's default does: key ->
    #: (the source value, difftune's key, its default there). Only these rows say "nothing to write";
    #: tests/test_import_examples.py checks every entry against difftune's schema.
    same_as_difftune: dict[str, tuple[Any, str, Any]] = {}

    def read_without_rows(self) -> None:
        """A row for every key a rule read without writing one (keys whose entries have rows of their own,
        `network_args conv_dim`, `network_kwargs.x`, are covered by those): "nothing to write" where the
        same_as_difftune table says difftune's default means the same, otherwise dropped, with a check (no rule
        handled it: an importer gap, which the tests look for)."""
        named = {row.source for row in self.out.rows}
        for key in sorted(self.src.read - named):
            if any(source.startswith((key + " ", key + ".")) for source in named):
                continue
            value = self.src.values[key]
            entry = self.same_as_difftune.get(general_key(key))
            if entry is not None and same_value(entry[0], value):
                index = key.split("]")[0] + "]" if key.startswith("datasets[") else ""
                self.out.same(key, entry[1].replace("datasets[]", index), entry[2])
            else:
                self.out.rows.append(Row(key, "dropped: no difftune equivalent", "unhandled"))
                self.out.check(f"{key} = {value!r}: no difftune equivalent; it is dropped")


def same_value(expected: Any, value: Any) -> bool:
    """Whether a file's `value` is the table's `expected` one as the source tool reads it: a number by value (never
    a bool for a number), a text with None and "" alike (an empty YAML key is null), anything else equal."""
    if isinstance(expected, bool) or isinstance(value, bool):
        return expected is value
    if isinstance(expected, (int, float)):
        return isinstance(value, (int, float)) and expected == value
    if isinstance(expected, str) or expected is None:
        return (value is None or isinstance(value, str)) and (expected or "") == (value or "")
    return expected == value


def general_key(path: str) -> str:
    """`datasets[2].folder_path` -> `datasets[].folder_path` (a key of every dataset)."""
    return re.sub(r"\[\d+\]", "[]", path, count=1) if path.startswith("datasets[") else path
