"""Extensions: discovered at start, register process types; a broken one is named and stops nothing else."""

from __future__ import annotations

import json
import logging

import pytest
from helpers import QUICKSTART_DATA, trainer_process, write_job

import run
from jobs.job import get_job
from jobs.registry import build_registry
from toolkit.config.loader import ConfigError, load_config


@pytest.mark.slow
def test_example_extension_writes_a_dataset_report(tmp_path):
    process = {"type": "dataset_report", "training_folder": str(tmp_path), "divisor": 16,
               "datasets": [{"folder_path": str(QUICKSTART_DATA), "resolution": [64]}]}
    assert run.main([str(write_job(tmp_path / "job.yaml", "report", process))]) == 0
    (report,) = json.loads((tmp_path / "report" / "dataset_report.json").read_text())
    assert report["images"] == 8 and report["items_per_epoch"] == 8
    assert sum(report["buckets"].values()) == 8


def test_extension_config_is_validated_like_built_ins(tmp_path, registry):
    process = {"type": "dataset_report", "datasets": [{"folder_path": "x"}], "divsor": 8}
    with pytest.raises(ConfigError, match=r"config.process\[0\].divsor: unknown key \(did you mean 'divisor'\?\)"):
        load_config(str(write_job(tmp_path / "job.yaml", "r", process)), registry)


@pytest.mark.slow
def test_broken_extension_is_named_and_other_jobs_still_run(tmp_path, caplog):
    extensions = tmp_path / "extensions"
    (extensions / "broken_one").mkdir(parents=True)
    (extensions / "broken_one" / "__init__.py").write_text("import no_such_module_here\n")
    (extensions / "fine_one").mkdir()
    (extensions / "fine_one" / "__init__.py").write_text(
        "from pydantic import Field\n"
        "from typing import Literal\n"
        "from toolkit.config.schema import Section\n"
        "from jobs.process.base_process import BaseProcess\n"
        "class HelloConfig(Section):\n"
        "    type: Literal['hello'] = Field('hello', description='Process type.')\n"
        "    out: str = Field(..., description='File to write.')\n"
        "class Hello(BaseProcess):\n"
        "    def run(self):\n"
        "        open(self.config.out, 'w').write('hi')\n"
        "def register(registry):\n"
        "    registry.register('hello', Hello, HelloConfig, source='fine_one')\n"
    )
    with caplog.at_level(logging.WARNING, logger="difftune"):
        registry = build_registry(extensions)
    assert "broken_one" in caplog.text and "no_such_module_here" in caplog.text
    assert set(registry) == {"sd_trainer", "hello"}

    out = tmp_path / "hello.txt"
    config, path = load_config(str(write_job(tmp_path / "hello.yaml", "h", {"type": "hello", "out": str(out)})),
                               registry)
    get_job(config, path, registry).run()
    assert out.read_text() == "hi"
    load_config(str(write_job(tmp_path / "train.yaml", "t", trainer_process(tmp_path))), registry)

    with pytest.raises(ConfigError, match="extensions that failed to load: broken_one: ModuleNotFoundError"):
        load_config(str(write_job(tmp_path / "other.yaml", "o", {"type": "broken_type"})), registry)
