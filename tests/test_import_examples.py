"""Other trainers' own published jobs imported: ai-toolkit's example files and the jobs its web UI writes, kohya
sd-scripts configurations as its `--output_config` writes them from the commands in its docs (tests/fixtures/foreign,
each file's origin in SOURCES.md there). Every row an import prints is held to what it claims: a mapped key is in the
written job and changes it, a "nothing to write" key is in its importer's same-as-difftune table, which is checked
against difftune's own defaults, and no key is left to no rule."""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import QUICKSTART_DATA

import run
from toolkit.config.importers.aitoolkit import LEAVES, SAME_AS_DIFFTUNE, import_aitoolkit
from toolkit.config.importers.conversion import MISSING, Conversion, ImportRefused, flatten, general_key
from toolkit.config.importers.importer import convert
from toolkit.config.loader import ConfigError, load_config, read_raw
from toolkit.config.schema import SDTrainerConfig
from toolkit.run.metrics import read_metrics

FIXTURES = Path(__file__).parent / "fixtures" / "foreign"
#: every ai-toolkit training job among the fixtures
AITOOLKIT_JOBS = sorted(p.name for p in FIXTURES.glob("aitoolkit_*") if "extract" not in p.name
                        and "mod" not in p.name.split("_")[-1])


def imported(name: str) -> Conversion:
    return convert(FIXTURES / name)


def process_of(conversion: Conversion) -> SDTrainerConfig:
    """The written job read back by difftune's schema (a round trip through YAML, as the file is written)."""
    job = yaml.safe_load(yaml.safe_dump(conversion.job, sort_keys=False))
    return SDTrainerConfig.model_validate(job["config"]["process"][0])


# ---- every row's claim --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", AITOOLKIT_JOBS)
def test_every_row_of_an_ai_toolkit_import_is_backed(name):
    """A mapped row's value is what the job holds at its target; each mapped source key changes the written job when
    it is removed (unless ai-toolkit's default, written out in its place, is the same value); a "nothing to write"
    row is in the same-as-difftune table; no key falls to no rule. The job loads in difftune's schema."""
    conversion = imported(name)
    process_of(conversion)
    data = read_raw(FIXTURES / name)
    process = data["config"]["process"][0]
    paths = set(flatten(process, leaves=LEAVES))
    for row in conversion.rows:
        assert row.kind != "unhandled", f"{name}: {row.source} was read by no rule"
        if row.kind == "mapped":
            assert conversion.get(row.target) == row.value, (name, row)
        if row.kind == "same":
            assert SAME_AS_DIFFTUNE[general_key(row.source)][1] == re.sub(r"\[\d+\]", "[]", row.target, count=1)
        if row.kind == "mapped" and row.source in paths:
            assert_load_bearing(name, data, row.source, row.target, row.value, conversion)


def assert_load_bearing(name: str, data: dict, source: str, target: str, value: Any, conversion: Conversion) -> None:
    """Importing `data` without `source` gives another job, a refusal, or ai-toolkit's default for it written out
    as the same value (then the row's claim holds either way)."""
    stripped = copy.deepcopy(data)
    remove(stripped["config"]["process"][0], source)
    try:
        other = import_aitoolkit(stripped, name=Path(name).stem)
    except ImportRefused:
        return
    if other.job != conversion.job:
        return
    assert any(r.source == "(default)" and r.target == target and r.value == value for r in other.rows), (
        f"{name}: {source} -> {target} claims to be imported, but the job is the same without it")


def remove(tree: dict, path: str) -> None:
    """Delete the dotted `path` (`datasets[0].x`, `train.ema_config.use_ema`) from a nested mapping."""
    parts = re.findall(r"\[\d+\]|[^.\[\]]+", path)
    node: Any = tree
    for part in parts[:-1]:
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    del node[parts[-1]]


def default_at(target: str, arch: str) -> Any:
    """difftune's default at `target` (`datasets[].x` for a dataset's) for a job of family `arch`."""
    process = SDTrainerConfig.model_validate({"type": "sd_trainer", "model": {"arch": arch, "name_or_path": "m"},
                                              "datasets": [{"folder_path": "d"}], "train": {"steps": 1}})
    node: Any = process
    for part in target.replace("datasets[]", "datasets.0").split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node.model_dump() if hasattr(node, "model_dump") else node


@pytest.mark.parametrize("key", sorted(SAME_AS_DIFFTUNE))
def test_each_same_as_difftune_entry_is_difftunes_default(key):
    """Each key the ai-toolkit importer says needs nothing written names difftune's default at its target, for every
    family."""
    _, target, value = SAME_AS_DIFFTUNE[key]
    for arch in ("sd15", "sdxl", "flux", "zimage", "qwen_image", "wan"):
        assert default_at(target, arch) == value, (key, arch)


# ---- what trying the examples showed -----------------------------------------------------------------------


def test_the_wan21_example_gets_the_frames_ai_toolkit_renders():
    """ai-toolkit's train_lora_wan21_1b_24gb.yaml asks for 40 sample frames, which WanPipeline renders as 41 (it
    rounds to 4k + 1 below): the job says 41, and the row says why."""
    conversion = imported("aitoolkit_example_wan21_1b.yaml")
    assert process_of(conversion).sample.num_frames == 41
    row = next(r for r in conversion.rows if r.source == "sample.num_frames")
    assert "asks for 40" in row.outcome and "renders 41" in row.outcome
    from diffusers import WanPipeline
    import inspect

    # the rounding is the installed pipeline's own
    assert "num_frames // self.vae_scale_factor_temporal * self.vae_scale_factor_temporal + 1" in inspect.getsource(
        WanPipeline.__call__)


@pytest.mark.parametrize("name, bypass", [("aitoolkit_example_flex.yaml", True), ("aitoolkit_ui_flex1.json", True),
                                          ("aitoolkit_ui_flux.json", False), ("aitoolkit_flux_example.yaml", False)])
def test_flex_jobs_bypass_the_guidance_embedding(name, bypass):
    """ai-toolkit's Flex example and its UI's Flex.1 job bypass the guidance embedding in training, as difftune's
    train.bypass_guidance_embedding does; a FLUX.1 job writes `false` out (ai-toolkit's default whatever the base;
    difftune's default would follow a Flex.1 base)."""
    conversion = imported(name)
    process = process_of(conversion)
    assert process.model.arch == "flux" and process.train.bypass_guidance_embedding is bypass
    assert process.train.guidance_scale is None or not bypass


def test_layer_offloading_shares_are_checked_only_when_offloading_is_on():
    """The UI writes model.layer_offloading_*_percent for Qwen-Image and Wan with layer_offloading false; ai-toolkit
    reads them only with it on."""
    for name in ("aitoolkit_ui_qwen_image.json", "aitoolkit_ui_wan22_14b.json"):
        conversion = imported(name)
        assert not [c for c in conversion.checks if "layer_offloading" in c], name
        rows = {r.source: r.outcome for r in conversion.rows}
        assert "only with model.layer_offloading" in rows["model.layer_offloading_transformer_percent"]
    data = read_raw(FIXTURES / "aitoolkit_ui_qwen_image.json")
    data["config"]["process"][0]["model"]["layer_offloading"] = True
    assert [c for c in import_aitoolkit(data).checks if c.startswith("model.layer_offloading")]


@pytest.mark.parametrize("name, kind, covered", [
    ("aitoolkit_example_extract.yaml", "extract", "no extraction command"),
    ("aitoolkit_example_mod.yaml", "mod", "--convert-lora"),
])
def test_other_ai_toolkit_jobs_are_named_with_what_covers_them(name, kind, covered, registry, tmp_path, caplog):
    """A `job: extract` or `job: mod` file, run or imported, gets one line naming ai-toolkit, the job kind, what it
    does and what difftune has for it: not schema errors, not "no other trainer's job"."""
    caplog.set_level(logging.ERROR, logger="difftune")
    with pytest.raises(ConfigError) as error:
        load_config(str(FIXTURES / name), registry)
    message = str(error.value)
    assert f"ai-toolkit `job: {kind}`" in message and covered in message and "\n" not in message
    with pytest.raises(ImportRefused) as refused:
        convert(FIXTURES / name)
    assert str(refused.value) == message
    assert run.main(["--import-config", str(FIXTURES / name), "-o", str(tmp_path / "x.yaml")]) == 1
    assert not (tmp_path / "x.yaml").exists()


def test_a_job_train_file_of_difftune_is_not_taken_for_ai_toolkits():
    from toolkit.config.importers.detect import detect

    ours = {"job": "train", "config": {"name": "n", "process": [{"type": "sd_trainer"}]}}
    assert detect(ours) is None
    legacy = {"job": "train", "config": {"name": "n", "process": [{"type": "slider"}]}}
    assert detect(legacy).job_kind == "train"


@pytest.mark.slow
def test_the_imported_flex_example_trains_with_the_embedding_bypassed(tmp_path, registry, caplog):
    """ai-toolkit's Flex example, imported, pointed at the tiny Flex.1-shaped model and this machine (model, data,
    device, output, and steps cut to 2), trains with the guidance embedding bypassed, and samples."""
    caplog.set_level(logging.INFO, logger="difftune")
    out = tmp_path / "flex.yaml"
    assert run.main(["--import-config", str(FIXTURES / "aitoolkit_example_flex.yaml"), "-o", str(out)]) == 0
    job = yaml.safe_load(out.read_text())
    process = job["config"]["process"][0]
    process["model"].update(name_or_path="tiny-flex", quantize=False, quantize_te=False)
    process["datasets"][0].update(folder_path=str(QUICKSTART_DATA), resolution=[64])
    process.update(training_folder=str(tmp_path / "output"), device="cpu")
    process["train"].update(steps=2, optimizer="adamw")  # bitsandbytes' 8-bit AdamW runs on a GPU
    process["sample"].update(width=32, height=32, sample_steps=2, prompts=process["sample"]["prompts"][:1])
    process["save"].update(save_every=2)
    out.write_text(json.dumps(job))
    assert run.main([str(out)]) == 0
    assert any("'variant': 'flex.1'" in r.message and "'guidance_in_training': 'bypassed'" in r.message
               for r in caplog.records)
    folder = tmp_path / "output" / job["config"]["name"]
    assert [r["step"] for r in read_metrics(folder / "metrics.jsonl") if "loss" in r] == [1, 2]
    assert list((folder / "samples").glob("*.png"))
