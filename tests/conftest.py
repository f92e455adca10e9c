"""Shared fixtures. One pytest process imports diffusers/transformers once; tiny models are built once
per session under a private cache so tests never depend on the user's cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("difftune_cache")
    os.environ["DIFFTUNE_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_sd15(tiny_cache) -> Path:
    from toolkit.models.sd15.tiny import ensure_tiny_sd15

    return ensure_tiny_sd15()


@pytest.fixture(scope="session")
def tiny_sdxl(tiny_cache) -> Path:
    from toolkit.models.sdxl.tiny import ensure_tiny_sdxl

    return ensure_tiny_sdxl()


@pytest.fixture(scope="session")
def registry():
    from jobs.registry import build_registry

    return build_registry(REPO / "extensions")


@pytest.fixture(scope="session")
def tiny_wuerstchen(tiny_cache) -> Path:
    from toolkit.models.wuerstchen.tiny import ensure_tiny_wuerstchen

    return ensure_tiny_wuerstchen()


@pytest.fixture(scope="session")
def two_process_launch(tmp_path_factory, tiny_sd15):
    """One two-process launch (a launch costs two interpreters' imports) shared by the schedule and plan checks
    (tests/test_lr_schedule.py), the sharding checks (tests/test_caches.py), the validation loss
    (tests/test_training_quality.py) and the first half of the two-process resume (tests/test_resume.py): their jobs run one after the other
    in the same two processes, each sample's index recorded per rank. Returns (folder, the launch's result)."""
    from helpers import launch
    from test_caches import every_sample_jobs
    from test_lr_schedule import schedule_jobs
    from test_resume import interrupted_jobs
    from test_training_quality import validation_jobs

    tmp = tmp_path_factory.mktemp("two_process_launch")
    (tmp / "seen").mkdir()
    # the interrupted job ends the launch (a stop ends the command), so it comes last
    files = schedule_jobs(tmp) + every_sample_jobs(tmp) + validation_jobs(tmp) + interrupted_jobs(tmp)
    result = launch(Path(files[0]), 2, cwd=tmp, script=REPO / "tests" / "instrumented_run.py",
                    env={"DIFFTUNE_TEST_RECORD_INDICES": str(tmp / "seen"), "DIFFTUNE_TEST_INTERRUPT_AFTER": "5",
                         "DIFFTUNE_TEST_INTERRUPT_JOB": "ddp"}, extra_jobs=files[1:])
    return tmp, result
