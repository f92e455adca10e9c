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


@pytest.mark.parametrize("arch, low_vram, frames", [("wan21", False, 41), ("wan22_14b", False, 41),
                                                      ("wan21", True, 37), ("wan22_5b", False, 37)])
def test_the_wan21_example_gets_the_frames_ai_toolkit_renders(arch, low_vram, frames):
    """ai-toolkit's train_lora_wan21_1b_24gb.yaml asks for 40 sample frames. Wan 2.1 renders them through diffusers'
    WanPipeline and Wan 2.2 14B through its subclass, which round to 41; its Wan 2.2 5B model rounds down to 37, and
    Wan 2.1 with low_vram samples through its own pipeline, whose (40 - 1) // 4 + 1 latent frames decode to 37. The
    job says what is rendered, and the row says why."""
    data = read_raw(FIXTURES / "aitoolkit_example_wan21_1b.yaml")
    data["config"]["process"][0]["model"].update(arch=arch, low_vram=low_vram)
    conversion = import_aitoolkit(data)
    assert process_of(conversion).sample.num_frames == frames
    row = next(r for r in conversion.rows if r.source == "sample.num_frames")
    assert "asks for 40" in row.outcome and f"renders {frames}" in row.outcome
    assert process_of(imported("aitoolkit_example_wan21_1b.yaml")).sample.num_frames == 41  # the file as it is
    from diffusers import WanPipeline
    import inspect

    # the rounding up is the installed pipeline's own
    assert "num_frames // self.vae_scale_factor_temporal * self.vae_scale_factor_temporal + 1" in inspect.getsource(
        WanPipeline.__call__)


def test_a_wan_clip_length_is_the_frames_ai_toolkit_trains_on():
    """ai-toolkit extracts a dataset's num_frames as given; Wan's VAE encodes 1 + (n - 1) // 4 latent frames of them,
    so 40 trains on 37: the job says 37 (difftune takes 4k + 1 only)."""
    data = read_raw(FIXTURES / "aitoolkit_example_wan21_1b.yaml")
    data["config"]["process"][0]["datasets"][0]["num_frames"] = 40
    conversion = import_aitoolkit(data)
    assert process_of(conversion).datasets[0].num_frames == 37
    assert "encodes the first 37" in next(r.outcome for r in conversion.rows if r.source == "datasets[0].num_frames")


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
    # wide targets, as the import's coverage check suggests: they reach the embedders' linear_1 / linear_2
    process["network"]["target_modules"] = ["to_q", "linear_1", "linear_2"]
    out.write_text(json.dumps(job))
    assert run.main([str(out)]) == 0
    assert any("'variant': 'flex.1'" in r.message and "'guidance_in_training': 'bypassed'" in r.message
               for r in caplog.records)
    folder = tmp_path / "output" / job["config"]["name"]
    from safetensors import safe_open

    with safe_open(str(folder / f"{job['config']['name']}.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    # the bypassed guidance embedding takes no part in training: no LoRA there; the timestep embedding has one
    assert [k for k in keys if "guidance_embedder" in k] == [] and [k for k in keys if "timestep_embedder" in k]
    assert [r["step"] for r in read_metrics(folder / "metrics.jsonl") if "loss" in r] == [1, 2]
    assert list((folder / "samples").glob("*.png"))


def test_ai_toolkit_reference_images_become_control_path_and_prompt_references():
    """The Kontext example's control folder and `--ctrl_img` prompts; the Plus models' list of control folders, their
    UI slots (`control_path_1..3`) and sample items' `ctrl_img_1..3` (the first standing for `ctrl_img`)."""
    process = imported("aitoolkit_example_flux_kontext.yaml").process
    assert process["model"]["arch"] == "flux_kontext"
    assert process["datasets"][0]["control_path"] == "/path/to/control/folder"
    assert process["sample"]["prompts"][0] == {"prompt": "make the person smile",
                                               "references": ["/path/to/control/folder/person1.jpg"]}
    data = read_raw(FIXTURES / "aitoolkit_example_flux_kontext.yaml")
    job = data["config"]["process"][0]
    job["datasets"][0]["control_path_1"] = "/more"
    job["sample"] = {"samples": [{"prompt": "both", "ctrl_img": "/a.png", "ctrl_img_1": "/a.png"},
                                 {"prompt": "plain"}]}
    converted = import_aitoolkit(data, name="k").process
    assert converted["datasets"][0]["control_path"] == ["/path/to/control/folder", "/more"]
    assert converted["sample"]["prompts"] == [{"prompt": "both", "references": ["/a.png"]}, "plain"]


def test_reference_images_for_a_family_without_them_are_refused_by_key():
    data = read_raw(FIXTURES / "aitoolkit_example_flux_kontext.yaml")
    data["config"]["process"][0]["model"]["arch"] = "flux"
    with pytest.raises(ImportRefused, match=r"datasets\[0\].control_path: FLUX.1 takes no reference images"):
        import_aitoolkit(data, name="k")


def test_ai_toolkit_qwen_image_edit_archs_become_the_version_and_reference_size_it_trains():
    """`qwen_image_edit` is the first version, its reference sized to the target as ai-toolkit sizes it; the Plus arch
    leaves the version to the model's files (a single file takes the arch's `:2511` tag), its references at the
    pipelines' 1024 x 1024 unless `match_target_res`; its samples' `ctrl_img_1..3` are their references."""
    first = imported("aitoolkit_example_qwen_image_edit.yaml").process
    assert (first["model"]["version"], first["model"]["reference_pixels"]) == ("edit", "target")
    assert first["sample"]["prompts"][0] == {"prompt": "do the thing to it", "references": ["/path/to/control/image.jpg"]}
    plus = imported("aitoolkit_example_qwen_image_edit_2509.yaml").process
    assert "version" not in plus["model"] and "reference_pixels" not in plus["model"]
    assert plus["datasets"][0]["control_path"] == [f"/path/to/control/images/folder{i}" for i in (1, 2, 3)]
    assert plus["sample"]["prompts"][0]["references"] == ["/path/to/image1.png", "/path/to/image2.png"]
    data = read_raw(FIXTURES / "aitoolkit_example_qwen_image_edit_2509.yaml")
    model = data["config"]["process"][0]["model"]
    model.update(arch="qwen_image_edit_plus:2511", name_or_path="/models/edit.safetensors",
                 model_kwargs={"match_target_res": True})
    converted = import_aitoolkit(data, name="q").process["model"]
    assert (converted["version"], converted["reference_pixels"]) == ("2511", "target")


@pytest.mark.slow
@pytest.mark.parametrize("fixture, model", [
    ("aitoolkit_example_flux_kontext.yaml", {"name_or_path": "tiny", "quantize": False, "quantize_te": False}),
    # float quantization and its 3-bit type are for GPUs; the pipelines' 1024 x 1024 references are cut to 64 x 64
    ("aitoolkit_example_qwen_image_edit_2509.yaml", {"name_or_path": "tiny-2509", "qtype": "qint8",
                                                     "reference_pixels": 4096}),
])
def test_the_imported_editing_examples_train_on_pairs_and_render_from_their_references(fixture, model, tmp_path,
                                                                                       registry):
    """ai-toolkit's Kontext and Edit-2509 examples, imported and pointed at the tiny presets, the shipped pairs and this
    machine (one reference folder, steps cut to 2, float32): train on the pairs (2509 with the text embeddings cached
    per instruction and reference) and render the first sample prompt from its reference, kept beside it."""
    from test_flux_kontext_training import shipped_pairs

    out = tmp_path / "imported.yaml"
    assert run.main(["--import-config", str(FIXTURES / fixture), "-o", str(out)]) == 0
    job = yaml.safe_load(out.read_text())
    process = job["config"]["process"][0]
    targets, references = shipped_pairs(tmp_path / "pairs")
    process["model"].update(model, dtype="fp32")
    process["datasets"][0].update(folder_path=str(targets), control_path=str(references), resolution=[64])
    process.update(training_folder=str(tmp_path / "output"), device="cpu")
    process["train"].update(steps=2, optimizer="adamw", dtype="fp32")  # bitsandbytes' 8-bit AdamW runs on a GPU
    first = dict(process["sample"]["prompts"][0], references=[str(references / "00_circle.png")])
    process["sample"].update(width=32, height=32, sample_steps=2, prompts=[first], sample_at_start=False)
    process["save"].update(save_every=2)
    out.write_text(json.dumps(job))
    assert run.main([str(out)]) == 0
    folder = tmp_path / "output" / job["config"]["name"]
    assert [r["step"] for r in read_metrics(folder / "metrics.jsonl") if "loss" in r] == [1, 2]
    assert (folder / "samples" / "step_000000002_0.png").is_file()
    assert (folder / "samples" / "reference_0_0.png").read_bytes() == (references / "00_circle.png").read_bytes()


# ---- kohya sd-scripts ----------------------------------------------------------------------------------------

#: kohya configurations that import (the SDXL one trains the text encoder with cached outputs, which kohya refuses)
KOHYA_JOBS = ["kohya_sd15_lora.toml", "kohya_sd15_dataset_full.toml", "kohya_flux.toml", "kohya_sd15_folders.toml"]


def kohya_fixture(name: str, folder: Path) -> Path:
    """The fixture at `name`, copied into `folder` with what it names (its dataset config, the <repeats>_<name>
    folders of the folder style), so paths resolve as kohya resolves them."""
    import shutil

    from toolkit.config.importers.kohya import flat_arguments

    path = folder / name
    shutil.copy(FIXTURES / name, path)
    data = flat_arguments(read_raw(path))
    if data.get("dataset_config"):
        shutil.copy(FIXTURES / data["dataset_config"], folder / data["dataset_config"])
    if data.get("train_data_dir"):
        (folder / data["train_data_dir"] / "10_shp shape").mkdir(parents=True)
        (folder / data["reg_data_dir"] / "1_shape").mkdir(parents=True)
    return path


@pytest.mark.parametrize("name", KOHYA_JOBS)
def test_every_row_of_a_kohya_import_is_backed(name, tmp_path):
    """As for ai-toolkit: a mapped row's value is in the written job, each mapped argument changes the job when it is
    removed (or kohya's default for it is written in its place, the same), no argument or dataset-config key is left
    without a row, and the job loads."""
    from toolkit.config.importers.kohya import flat_arguments, import_kohya

    path = kohya_fixture(name, tmp_path)
    conversion = convert(path)
    process_of(conversion)
    data = flat_arguments(read_raw(path))  # kohya reads its tables as one namespace
    for row in conversion.rows:
        assert row.kind not in ("unhandled", "same"), f"{name}: {row.source}: {row.outcome}"
        if row.kind == "mapped":
            assert conversion.get(row.target) == row.value, (name, row)
        if row.kind == "mapped" and row.source in data:
            stripped = {k: v for k, v in data.items() if k != row.source}
            try:
                other = import_kohya(stripped, path)
            except ImportRefused:
                continue
            assert other.job != conversion.job or any(
                r.source == "(default)" and r.target == row.target and r.value == row.value for r in other.rows), (
                f"{name}: {row.source} -> {row.target} claims to be imported, but the job is the same without it")
    dataset_file = data.get("dataset_config")
    if dataset_file:  # every key of every table of the dataset config has a row
        tables = read_raw(path.parent / dataset_file)
        sources = {row.source for row in conversion.rows}
        keys = [f"general.{k}" for k in tables.get("general", {})]
        for d, dataset in enumerate(tables["datasets"]):
            keys += [f"datasets[{d}].{k}" for k in dataset if k != "subsets"]
            keys += [f"datasets[{d}].subsets[{i}].{k}" for i, sub in enumerate(dataset["subsets"]) for k in sub]
        assert [k for k in keys if f"dataset config {k}" not in sources] == []


def test_kohya_flux_shift_is_the_sigmoid_draw_with_the_dynamic_shift(tmp_path):
    """kohya's FLUX.1 doc command (timestep_sampling flux_shift): sigmoid draws shifted by the image size's shift
    (1.88 at 512 px, 3.16 at 1024), not a fixed shift of discrete_flow_shift's default 3.0."""
    process = process_of(convert(kohya_fixture("kohya_flux.toml", tmp_path)))
    params = process.train.timestep_params
    assert process.train.timestep_type == "shift" and params.dynamic_shift and params.shift_base == "sigmoid"
    assert params.std == 1.0 and process.train.bypass_guidance_embedding is False
    data = read_raw(tmp_path / "kohya_flux.toml")
    from toolkit.config.importers.kohya import import_kohya

    fixed = import_kohya({**data, "timestep_sampling": "shift", "discrete_flow_shift": 2.5, "sigmoid_scale": 1.2},
                         tmp_path / "kohya_flux.toml").job["config"]["process"][0]["train"]["timestep_params"]
    assert fixed == {"shift_base": "sigmoid", "std": 1.2, "shift": 2.5}


def test_kohya_dataset_config_keys_each_get_a_row(tmp_path):
    """enable_bucket and color_aug in kohya's dataset config (docs/config_README-en.md's example) have rows: the
    bucketing is difftune's own; color_aug is dropped, with a check for the subset that turns it on."""
    conversion = convert(kohya_fixture("kohya_sd15_dataset_full.toml", tmp_path))
    rows = {r.source: r.outcome for r in conversion.rows}
    assert "buckets" in rows["dataset config datasets[0].enable_bucket"]
    assert rows["dataset config datasets[0].subsets[1].color_aug"] == "dropped: no difftune equivalent"
    assert any("color_aug" in c and c.startswith("datasets[1]") for c in conversion.checks)
    (tmp_path / "flux").mkdir()
    flux = {r.source: r.outcome for r in convert(kohya_fixture("kohya_flux.toml", tmp_path / "flux")).rows}
    assert flux["dataset config general.color_aug"] == "dropped: False: off"
    assert not [c for c in conversion.checks if "color_aug" in c and not c.startswith("datasets[1]")]


def test_kohya_refuses_what_kohya_refuses_in_its_own_words(tmp_path):
    """The SDXL docs command trains the text encoder with cached text-encoder outputs: kohya itself refuses that, so
    the import names the source file, its keys and kohya's message (no job written, no difftune key names); the doc's
    fine-tuning dataset (json captions) is refused by name."""
    path = kohya_fixture("kohya_sdxl_te.toml", tmp_path)
    out = tmp_path / "sdxl.yaml"
    with pytest.raises(ImportRefused) as refused:
        convert(path)
    message = str(refused.value)
    assert str(path) in message and "cache_text_encoder_outputs" in message and "network_train_unet_only" in message
    assert "kohya refuses this combination too" in message and "network.train_text_encoder" not in message
    assert run.main(["--import-config", str(path), "-o", str(out)]) == 1 and not out.exists()
    from toolkit.config.importers.kohya import import_kohya

    dataset = {"datasets": [{"resolution": [768, 768], "subsets": [{"image_dir": "piyo",
                                                                    "metadata_file": "piyo/piyo_md.json"}]}]}
    with pytest.raises(ImportRefused, match="metadata_file"):
        import_kohya(read_raw(FIXTURES / "kohya_sd15_dataset_full.toml"), path, datasets=dataset)


def test_a_job_difftune_refuses_is_told_in_the_source_files_keys(tmp_path, caplog):
    """Where the imported job breaks a difftune rule, the error names the source file and the source keys (not a
    job file that was never written); nothing is written."""
    source = tmp_path / "job.yaml"
    source.write_text(yaml.safe_dump({"config": {"name": "m", "process": [{
        "type": "sd_trainer", "network": {"type": "lora", "linear": 8}, "datasets": [{"folder_path": "d"}],
        "model": {"name_or_path": "m", "arch": "sd15"}, "sample": {"sampler": "ddpm"},
        "train": {"steps": 10, "train_text_encoder": True, "cache_text_embeddings": True}}]}}))
    out = tmp_path / "out.yaml"
    assert run.main(["--import-config", str(source), "-o", str(out)]) == 1
    assert not out.exists()
    from toolkit.config.loader import validate_job
    from jobs.registry import build_registry

    conversion = convert(source)
    with pytest.raises(ConfigError) as error:
        validate_job(conversion.job, out, build_registry(Path(run.ROOT) / "extensions"))
    message = conversion.refusal(source, str(error.value).splitlines()[1:])
    assert message.startswith(f"{source}: the ai-toolkit job asks for what difftune refuses (nothing was written)")
    assert "train.train_text_encoder (difftune's network.train_text_encoder)" in message
    assert "train.cache_text_embeddings (your train.cache_text_embeddings)" in message and str(out) not in message
    assert message in caplog.text


@pytest.mark.parametrize("name, dtype", [("kohya_sd15_folders.toml", "fp16"), ("aitoolkit_ui_sd15.json", "bf16")])
def test_an_imported_precision_is_kept_and_said_per_device(name, dtype, tmp_path):
    """kohya's mixed_precision fp16 and ai-toolkit's dtype become model.dtype and train.dtype as they are (fp16 and
    bf16 train on CUDA and on the CPU alike), with a row saying what that is on each device."""
    path = kohya_fixture(name, tmp_path) if name.startswith("kohya") else FIXTURES / name
    conversion = convert(path)
    process = process_of(conversion)
    assert (process.model.dtype, process.train.dtype) == (dtype, dtype)
    said = [r.outcome for r in conversion.rows if r.target in ("train.dtype", "model.dtype") and "CUDA" in r.outcome]
    assert said and all("on the CPU" in text for text in said)


@pytest.mark.slow
def test_the_imported_kohya_folder_job_trains_in_fp16_on_the_tiny_model(tmp_path, registry):
    """kohya's SD 1.5 folder-style command (fp16, cached latents, <repeats>_<class> folders with a regularisation
    folder), imported and pointed at the tiny model and this machine only (model, images, device, output, steps):
    it trains in the fp16 it asked for."""
    import shutil

    path = kohya_fixture("kohya_sd15_folders.toml", tmp_path)
    for folder in ("train_data/10_shp shape", "reg_data/1_shape"):
        for image in sorted(QUICKSTART_DATA.iterdir())[:4]:
            shutil.copy(image, tmp_path / folder / image.name)
    out = tmp_path / "job.yaml"
    assert run.main(["--import-config", str(path), "-o", str(out)]) == 0
    job = yaml.safe_load(out.read_text())
    process = job["config"]["process"][0]
    process["model"]["name_or_path"] = "tiny"
    for dataset in process["datasets"]:
        dataset["resolution"] = [64]
    process.update(training_folder=str(tmp_path / "output"), device="cpu")
    process["train"].update(steps=2, optimizer="adamw")  # bitsandbytes' 8-bit AdamW runs on a GPU
    out.write_text(json.dumps(job))
    assert (process["model"]["dtype"], process["train"]["dtype"]) == ("fp16", "fp16")
    assert run.main([str(out)]) == 0
    records = [r for r in read_metrics(tmp_path / "output" / "sd15_folders_lora" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2]


def test_the_migration_guides_catalogues_leave_no_key_to_no_rule():
    """The jobs behind docs/migrating.md's tables hold every key the importers have a rule for: each gets a row of
    its own rule, never the fallback for keys no rule handled."""
    from toolkit.config.importers import docs

    conversions = [docs.catalogue_import(arch, scheduler) for _, arch, scheduler in docs.TABLES]
    conversions += [docs.kohya_import(flux) for flux in (False, True)]
    assert [(c.trainer, r.source) for c in conversions for r in c.rows if r.kind == "unhandled"] == []


def test_nothing_to_write_holds_for_the_value_as_the_source_reads_it():
    """A default written another way (0.0 for 0, an empty YAML key for "", "" for a missing path) is still the
    default; another value, or a bool for a number, is not taken for it."""
    data = read_raw(FIXTURES / "aitoolkit_ui_sdxl.json")
    process = data["config"]["process"][0]
    process["train"].update(min_denoising_steps=0.0, max_denoising_steps=999.0)
    process["sample"]["neg"] = None
    process["datasets"][0].update(default_caption=None, mask_path="")
    rows = {r.source: r for r in import_aitoolkit(data).rows}
    for key in ("train.min_denoising_steps", "train.max_denoising_steps", "sample.neg",
                "datasets[0].default_caption", "datasets[0].mask_path"):
        assert rows[key].kind == "same", key
    from toolkit.config.importers.conversion import same_value

    assert not same_value(0, False) and not same_value("", 0) and not same_value(999, 998.0)


def test_a_malformed_job_key_gets_the_schemas_message_not_a_traceback(registry, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("job: [extension]\nconfig:\n  name: x\n  process: 3\n")
    with pytest.raises(ConfigError):
        load_config(str(path), registry)
    from toolkit.config.importers.detect import detect

    assert detect({"job": {"a": 1}, "config": {"process": 3}}) is None
    assert detect({"job": "extract", "config": {"process": 3}}).job_kind == "extract"


def test_kohya_rows_for_keys_it_ignores_or_turns_off(tmp_path):
    """A FLUX.1 file's v_parameterization, a weighting_scheme kohya ignores (raw prediction) or applies to the loss
    (sigma_scaled), and dataset-config keys set false or 0 each get a row that says so."""
    from toolkit.config.importers.kohya import import_kohya

    path = kohya_fixture("kohya_flux.toml", tmp_path)
    data = read_raw(path)
    rows = {r.source: r.outcome for r in import_kohya({**data, "v_parameterization": False,
                                                       "weighting_scheme": "cosmap"}, path).rows}
    assert rows["v_parameterization"] == "dropped: kohya ignores it for FLUX.1"
    assert rows["weighting_scheme"] == "dropped: kohya ignores it with timestep_sampling flux_shift"  # raw
    scaled = import_kohya({**data, "model_prediction_type": "sigma_scaled", "weighting_scheme": "cosmap"}, path)
    assert "weights the loss" in {r.source: r.outcome for r in scaled.rows}["weighting_scheme"]
    assert any(c.startswith("weighting_scheme cosmap") for c in scaled.checks)
    flux_rows = {r.source: r.outcome for r in convert(path).rows}
    assert flux_rows["dataset config general.shuffle_caption"] == "dropped: False: off, for each subset that takes it"
