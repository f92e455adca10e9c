"""Model paths: local paths, hub ids and preset names told apart before anything loads."""

from __future__ import annotations

import pytest

from toolkit.paths import normalize_path


def test_existing_paths_are_expanded_and_trimmed(tmp_path, monkeypatch):
    folder = tmp_path / "my model"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MODELS", str(tmp_path))
    assert normalize_path("  ~/my model \n") == str(folder)
    assert normalize_path("$MODELS/my model") == str(folder)
    assert normalize_path(f"{folder}/") == str(folder)


@pytest.mark.parametrize("value", ["Tongyi-MAI/Z-Image-Turbo", " warp-ai/wuerstchen-prior ", "tiny", "tiny-turbo"])
def test_hub_ids_and_preset_names_pass_through(value):
    assert normalize_path(value) == value.strip()


@pytest.mark.parametrize("value", ["/models/absent", "./absent", "../absent/model", "~/absent", "absent.safetensors",
                                   "models/z-image/absent", "C:\\models\\absent"])
def test_local_looking_paths_that_do_not_exist_are_errors_not_hub_lookups(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.sampling.name_or_path: .* looks like a local path"):
        normalize_path(value, "model.sampling.name_or_path")
