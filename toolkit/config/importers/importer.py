"""`python run.py --import-config FILE [-o OUT.yaml]`: a foreign job file read, recognised (`detect`), converted by
its trainer's importer, checked against difftune's schema, and written with the import table beside it."""

from __future__ import annotations

from pathlib import Path

import yaml

from toolkit.config.importers.aitoolkit import TRAINING_TYPES, import_aitoolkit
from toolkit.config.importers.conversion import Conversion, ImportRefused
from toolkit.config.importers.detect import detect
from toolkit.config.importers.kohya import import_kohya


def convert(path: Path, family: str | None = None) -> Conversion:
    """The difftune job (and report) for the foreign job file at `path`; `family` where a kohya configuration cannot
    tell SD 1.x from SDXL."""
    from toolkit.config.loader import read_raw

    data = read_raw(path)
    found = detect(data)
    config = data.get("config") if isinstance(data.get("config"), dict) else {}
    processes = config.get("process") if isinstance(config.get("process"), list) else []
    if found is None and any(isinstance(p, dict) and p.get("type") in TRAINING_TYPES for p in processes):
        # the shape both tools share, and none of ai-toolkit's own keys: asked to import, it is read as ai-toolkit's
        conversion = import_aitoolkit(data, name=path.stem)
        conversion.check("the file has no key only ai-toolkit uses: it was read as an ai-toolkit job because you "
                         "asked to import it (a difftune job runs as it is)")
        return conversion
    if found is None:
        raise ImportRefused(f"{path}: no other trainer's job found in it")
    if found.job_kind is not None:  # an ai-toolkit job that trains nothing
        raise ImportRefused(found.message(str(path)))
    if found.trainer == "ai-toolkit job":
        return import_aitoolkit(data, name=path.stem)
    if found.trainer == "kohya sd-scripts configuration":
        return import_kohya(data, path, family)
    if found.trainer == "kohya sd-scripts dataset config":
        raise ImportRefused(f"{path} is a kohya dataset config: import the training configuration that names it "
                            "(its dataset_config), which reads this file too")
    raise ImportRefused(found.message(str(path)))


def output_problem(source: Path, out: Path, force: bool) -> str | None:
    """Why the import must not write `out` (None: it may)."""
    if out.suffix not in (".yaml", ".yml"):
        return f"-o {out}: the imported job is YAML; give a .yaml file"
    if out.exists() and out.resolve() == source.resolve():
        return f"-o {out} is the file being imported; give another name"
    if out.is_dir():
        return f"-o {out} is a folder; give a .yaml file"
    if out.exists() and not force:
        return f"{out} exists; give another -o, or --force to replace it"
    return None


def write_job(conversion: Conversion, out: Path) -> None:
    """The imported job as YAML, headed by where it came from; the report goes to the log, not the file."""
    from toolkit.files import write_text_atomic

    header = ("# imported by `python run.py --import-config`; read the import table it printed, and the keys to\n"
              "# check, before training\n")
    write_text_atomic(out, header + yaml.safe_dump(conversion.job, sort_keys=False, allow_unicode=True))


def default_output(source: Path) -> Path:
    return source.with_name(f"{source.stem}.difftune.yaml")
