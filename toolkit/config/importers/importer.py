"""`python run.py --import-config FILE [-o OUT.yaml]`: a foreign job file read, recognised (`detect`), converted by
its trainer's importer, checked against difftune's schema, and written with the import table beside it."""

from __future__ import annotations

from pathlib import Path

import yaml

from toolkit.config.importers.aitoolkit import import_aitoolkit
from toolkit.config.importers.conversion import Conversion, ImportRefused
from toolkit.config.importers.detect import detect


def convert(path: Path) -> Conversion:
    """The difftune job (and report) for the foreign job file at `path`."""
    from toolkit.config.loader import read_raw

    data = read_raw(path)
    found = detect(data)
    if found is None:
        raise ImportRefused(f"{path}: no other trainer's keys found; if it is a difftune job, run it as it is")
    if found.trainer == "ai-toolkit job":
        return import_aitoolkit(data, name=path.stem)
    raise ImportRefused(found.message(str(path)))


def write_job(conversion: Conversion, out: Path) -> None:
    """The imported job as YAML, headed by where it came from; the report goes to the log, not the file."""
    from toolkit.files import write_text_atomic

    header = ("# imported by `python run.py --import-config`; read the import table it printed, and the keys to\n"
              "# check, before training\n")
    write_text_atomic(out, header + yaml.safe_dump(conversion.job, sort_keys=False, allow_unicode=True))


def default_output(source: Path) -> Path:
    return source.with_name(f"{source.stem}.difftune.yaml")
