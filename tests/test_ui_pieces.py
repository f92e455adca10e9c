"""The dashboard's pieces without a server: reading metrics as they grow, run names, config errors by key."""

from __future__ import annotations

import os

import pytest

from toolkit.config.loader import ConfigError
from toolkit.ui.jobs import problems_of
from toolkit.ui.runs import MetricsTail, UnknownRun, find_runs, run_folder


def test_metrics_are_read_incrementally_and_again_after_a_rewrite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail()
    assert tail.read(path) == []
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')  # a line being written is not read yet
    assert [r["step"] for r in tail.read(path)] == [1, 2]
    with path.open("a") as handle:
        handle.write('ep": 3}\n')
    assert [r["step"] for r in tail.read(path)] == [1, 2, 3]
    replacement = tmp_path / "new.jsonl"
    replacement.write_text('{"step": 1}\n')
    os.replace(replacement, path)  # a resume cuts the file back atomically
    assert [r["step"] for r in tail.read(path)] == [1]


def test_run_names_never_leave_the_training_folder(tmp_path):
    (tmp_path / "out" / "a").mkdir(parents=True)
    (tmp_path / "out" / "a" / "status.json").write_text("{}")
    (tmp_path / "out" / "nested" / "b").mkdir(parents=True)
    (tmp_path / "out" / "nested" / "b" / "config.yaml").write_text("")
    (tmp_path / "out" / ".queue").mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "config.yaml").write_text("")
    root = tmp_path / "out"
    assert find_runs(root) == ["a", "nested/b"]
    assert run_folder(root, "nested/b") == (root / "nested" / "b").resolve()
    for name in ("../secret", "/etc", "a/..", ".queue", "nested", "a\x00"):
        with pytest.raises(UnknownRun):
            run_folder(root, name)


def test_config_errors_become_problems_by_key(tmp_path):
    shown = tmp_path / ".incoming-1.yaml"
    error = ConfigError(f"{shown}: invalid config\n  config.process[0].train.lrr: unknown key (did you mean 'lr'?)\n"
                        "  config.process[0].datasets: required key is missing")
    assert problems_of(error, shown, "job.yaml") == [
        {"key": "config.process[0].train.lrr", "message": "unknown key (did you mean 'lr'?)"},
        {"key": "config.process[0].datasets", "message": "required key is missing"}]
    assert problems_of(ConfigError(f"{shown}: cannot parse: bad"), shown, "job.yaml") == [
        {"key": "", "message": "job.yaml: cannot parse: bad"}]
