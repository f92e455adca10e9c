"""Process types by name, and discovery of user extensions that add more."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from toolkit.config.schema import SDTrainerConfig

log = logging.getLogger("difftune")


@dataclass(frozen=True)
class ProcessType:
    name: str
    #: the class, or "module:Class" imported when a job of this type is built (so that reading and checking a
    #: config never imports the trainer's libraries)
    process_class: type | str
    config_model: type[BaseModel]
    source: str

    def load_class(self) -> type:
        if isinstance(self.process_class, str):
            module, name = self.process_class.split(":")
            return getattr(importlib.import_module(module), name)
        return self.process_class


class ProcessRegistry(Mapping[str, type[BaseModel]]):
    """Maps a process `type` to its config model (what the config loader needs) and its class."""

    def __init__(self) -> None:
        self._types: dict[str, ProcessType] = {}
        self.broken_extensions: dict[str, str] = {}

    def register(self, name: str, process_class: type | str, config_model: type[BaseModel], source: str = "built-in") -> None:
        if name in self._types:
            raise ValueError(f"process type '{name}' from {source} is already registered by {self._types[name].source}")
        self._types[name] = ProcessType(name, process_class, config_model, source)

    def process_class(self, name: str) -> type:
        return self._types[name].load_class()

    def explain_unknown(self, name: str) -> str:
        text = f"known: {', '.join(sorted(self._types))}"
        if self.broken_extensions:
            failed = "; ".join(f"{ext}: {err}" for ext, err in sorted(self.broken_extensions.items()))
            text += f"; extensions that failed to load: {failed}"
        return text

    def __getitem__(self, name: str) -> type[BaseModel]:
        return self._types[name].config_model

    def __iter__(self) -> Iterator[str]:
        return iter(self._types)

    def __len__(self) -> int:
        return len(self._types)


def discover_extensions(registry: ProcessRegistry, folder: Path) -> None:
    """Import each package in `folder` and call its `register(registry)`.

    A broken extension is logged with its name and remembered; jobs that don't use it still run.
    """
    if not folder.is_dir():
        return
    for package in sorted(p for p in folder.iterdir() if (p / "__init__.py").is_file()):
        name = package.name
        try:
            module = _import_package(package, f"difftune_extensions.{name}")
            register = getattr(module, "register", None)
            if register is None:
                raise AttributeError("the package has no register(registry) function")
            register(registry)
        except Exception as err:
            registry.broken_extensions[name] = f"{type(err).__name__}: {err}"
            log.warning("extension '%s' (%s) failed to load: %s: %s", name, package, type(err).__name__, err)
            log.debug("%s", traceback.format_exc())


def _import_package(package: Path, module_name: str):
    spec = importlib.util.spec_from_file_location(
        module_name, package / "__init__.py", submodule_search_locations=[str(package)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def build_registry(extensions_folder: Path | None) -> ProcessRegistry:
    """Built-in process types plus those of the extensions found in `extensions_folder`."""
    registry = ProcessRegistry()
    registry.register("sd_trainer", "jobs.process.base_sd_train_process:BaseSDTrainProcess", SDTrainerConfig)
    if extensions_folder is not None:
        discover_extensions(registry, extensions_folder)
    return registry
