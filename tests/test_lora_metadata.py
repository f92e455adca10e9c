"""What finished LoRA files say about themselves: kohya's ss_* keys and hashes, the model spec, difftune's own
keys, no private paths by default, and the run folder's file permissions."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from io import BytesIO
from pathlib import Path

import pytest
import torch
from helpers import make_image, trainer_process, write_job
from safetensors import safe_open
from safetensors.torch import save

import run
from toolkit.files import new_file_mode, write_text_atomic
from toolkit.network.lora import write_safetensors
from toolkit.network.metadata import (
    TrainingFacts,
    kohya_hashes,
    lora_metadata,
    private_config,
    reduce_path,
    tag_frequency,
)


def facts(**overrides) -> TrainingFacts:
    values = dict(name="mine", arch="sd15", base_model="/home/someone/models/sd15.safetensors", network_type="lora",
                  rank=4, alpha=8.0, conv_rank=None, conv_alpha=None, use_dora=False, kohya_base_model="sd_v1",
                  modelspec_architecture="stable-diffusion-v1/lora", prediction_type="epsilon", resolution=512,
                  num_train_images=12, num_reg_images=0, num_epochs=3, epoch=3, steps=30, learning_rate=1e-4,
                  tag_frequency={"imgs": {"cat": 2}}, started_at=1700000000.5, finished_at=1700000100.25,
                  trigger_word="shp", config={"datasets": [{"folder_path": "/home/someone/data/imgs"}],
                                              "model": {"name_or_path": "org/model"}})
    return TrainingFacts(**{**values, **overrides})


# ---- kohya keys, model spec, levels ----------------------------------------------------------------------


def test_kohya_keys_and_modelspec_are_strings_as_kohya_writes_them():
    meta = lora_metadata(facts(conv_rank=2, conv_alpha=1.0))
    assert all(isinstance(v, str) for v in meta.values())
    assert (meta["ss_output_name"], meta["ss_network_module"], meta["ss_network_dim"], meta["ss_network_alpha"]) == (
        "mine", "networks.lora", "4", "8.0")
    assert json.loads(meta["ss_network_args"]) == {"conv_dim": "2", "conv_alpha": "1.0"}
    assert (meta["ss_base_model_version"], meta["ss_resolution"], meta["ss_num_train_images"]) == (
        "sd_v1", "(512, 512)", "12")
    assert (meta["ss_num_epochs"], meta["ss_epoch"], meta["ss_steps"], meta["ss_learning_rate"]) == (
        "3", "3", "30", "0.0001")
    assert json.loads(meta["ss_tag_frequency"]) == {"imgs": {"cat": 2}}
    assert float(meta["ss_training_started_at"]) == 1700000000.5
    assert float(meta["ss_training_finished_at"]) == 1700000100.25
    assert meta["modelspec.sai_model_spec"] == "1.0.1"
    assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert (meta["modelspec.title"], meta["modelspec.resolution"], meta["modelspec.trigger_phrase"]) == (
        "mine", "512x512", "shp")
    assert meta["modelspec.date"].startswith("2023-11-1") and "+" not in meta["modelspec.date"]
    assert meta["difftune_arch"] == "sd15" and meta["difftune_step"] == "30"
    lokr = lora_metadata(facts(network_type="lokr", use_dora=False))
    assert lokr["ss_network_module"] == "lycoris.kohya" and json.loads(lokr["ss_network_args"]) == {"algo": "lokr"}


def test_levels_private_full_and_minimal():
    private, full = lora_metadata(facts(), "private"), lora_metadata(facts(), "full")
    assert "/home/someone" not in json.dumps(private) and private["difftune_base_model"] == "sd15.safetensors"
    assert json.loads(private["difftune_config"])["datasets"][0]["folder_path"] == "imgs"
    assert json.loads(private["difftune_config"])["model"]["name_or_path"] == "org/model"  # a hub id stays
    assert json.loads(full["difftune_config"])["datasets"][0]["folder_path"] == "/home/someone/data/imgs"
    assert full["ss_sd_model_name"] == private["ss_sd_model_name"] == "sd15.safetensors"  # kohya: the file name
    assert lora_metadata(facts(), "minimal") == {}
    with pytest.raises(ValueError, match="save.metadata"):
        lora_metadata(facts(), "secret")


def test_paths_are_reduced_to_their_last_component_and_hub_ids_stay(tmp_path):
    home = str(Path.home())
    assert reduce_path(f"{home}/data/cats") == "cats"
    assert reduce_path("./relative/folder/") == "folder"
    assert reduce_path("C:\\Users\\me\\lora.safetensors") == "lora.safetensors"
    assert reduce_path("stable-diffusion-v1-5/stable-diffusion-v1-5") == "stable-diffusion-v1-5/stable-diffusion-v1-5"
    assert reduce_path("tiny") == "tiny" and reduce_path("a photo of shp") == "a photo of shp"
    assert home not in reduce_path(f"saved under {home}/x") and home not in reduce_path(f"{home}")
    config = {"datasets": [{"folder_path": str(tmp_path / "d"), "cache_dir": None}], "steps": 3,
              "sample": {"prompts": ["shp, 1/2 body shot, 3/4 view", f"see {home}/notes"]}}
    assert private_config(config) == {"datasets": [{"folder_path": "d", "cache_dir": None}], "steps": 3,
                                      "sample": {"prompts": ["shp, 1/2 body shot, 3/4 view", "see notes"]}}


def test_tag_frequency_counts_comma_tags_per_dataset_folder_once_per_caption():
    counts = tag_frequency([("10_cats", ["shp, a Cat, sitting", "shp,a cat", " , "]), ("dogs", ["shp, dog"])])
    assert counts == {"10_cats": {"shp": 2, "a cat": 2, "sitting": 1}, "dogs": {"shp": 1, "dog": 1}}


# ---- hashes ----------------------------------------------------------------------------------------------


def kohya_reference(state: dict, metadata: dict) -> tuple[str, str]:
    """kohya sd-scripts' precalculate_safetensors_hashes, written out from its algorithm."""
    b = BytesIO(save(state, {k: v for k, v in metadata.items() if k.startswith("ss_")}))
    n = int.from_bytes(b.read(8), "little")
    b.seek(8 + n)
    model = hashlib.sha256(b.read()).hexdigest()
    b.seek(0x100000)
    legacy = hashlib.sha256(b.read(0x10000)).hexdigest()[:8]
    return model, legacy


def test_hashes_are_kohyas_and_the_model_hash_ignores_metadata(tmp_path):
    state = {"lora_unet_x.lora_down.weight": torch.randn(4, 300000), "lora_unet_x.alpha": torch.tensor(4.0)}
    meta = {"ss_output_name": "a", "modelspec.title": "a"}
    hashes = kohya_hashes(state, meta)
    assert (hashes["sshs_model_hash"], hashes["sshs_legacy_hash"]) == kohya_reference(state, meta)
    assert kohya_hashes(state, {**meta, "ss_output_name": "renamed", "other": "x"})["sshs_model_hash"] == \
        hashes["sshs_model_hash"]
    write_safetensors(tmp_path / "a.safetensors", state, meta, kohya_hashes=True)
    data = (tmp_path / "a.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert hashlib.sha256(data[8 + n:]).hexdigest() == hashes["sshs_model_hash"]  # the file's own tensor bytes
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as handle:
        assert handle.metadata()["sshs_model_hash"] == hashes["sshs_model_hash"]


def test_files_get_the_permissions_of_the_run_folder(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"x": torch.zeros(1)}, {})
    write_text_atomic(tmp_path / "b.txt", "b")
    modes = {stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in ("a.safetensors", "b.txt")}
    assert modes == {new_file_mode()} and new_file_mode() & 0o044  # readable by others under the usual umask


# ---- a finished run --------------------------------------------------------------------------------------


def headers(run_dir: Path) -> dict[str, dict[str, str]]:
    out = {}
    for path in run_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            out[path.name] = handle.metadata()
    return out


@pytest.mark.slow
def test_a_finished_run_describes_itself_without_private_paths(tmp_path):
    data = tmp_path / "home_like" / "my_images"
    for i, caption in enumerate(["a cat, sitting", "a cat, sleeping", "a dog, sitting"]):
        make_image(data / f"{i}.png", (64, 64), caption=caption)
    process = trainer_process(tmp_path, datasets=[{"folder_path": str(data), "resolution": [64], "num_repeats": 2}],
                              train={"steps": 3, "batch_size": 2}, save={"formats": ["diffusers", "comfy"]})
    assert run.main([str(write_job(tmp_path / "job.yaml", "described", process))]) == 0
    run_dir = tmp_path / "output" / "described"
    found = headers(run_dir)
    assert set(found) == {"described.safetensors", "described.diffusers.safetensors"}
    for name, meta in found.items():
        assert meta["ss_output_name"] == "described" and meta["ss_steps"] == "3"
        assert meta["ss_resolution"] == "(64, 64)" and meta["ss_num_train_images"] == "6"
        assert json.loads(meta["ss_tag_frequency"]) == {"my_images": {"shp": 3, "a cat": 2, "sitting": 2,
                                                                      "sleeping": 1, "a dog": 1}}
        assert meta["ss_base_model_version"] == "sd_v1" and meta["modelspec.architecture"] == \
            "stable-diffusion-v1/lora"
        assert meta["modelspec.trigger_phrase"] == "shp" and len(meta["sshs_model_hash"]) == 64
        text = json.dumps(meta)
        assert str(tmp_path) not in text and str(Path.home()) not in text, name
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == new_file_mode()
    # the checkpoint is the run's own memory: its LoRA keeps the full config
    checkpoint = next((run_dir / "checkpoints").iterdir()) / "lora.safetensors"
    with safe_open(str(checkpoint), "pt") as handle:
        assert str(data) in handle.metadata()["difftune_config"]

    full = trainer_process(tmp_path, datasets=[{"folder_path": str(data), "resolution": [64]}],
                           train={"steps": 1}, save={"metadata": "full", "formats": ["peft"]})
    assert run.main([str(write_job(tmp_path / "full.yaml", "full", full))]) == 0
    assert all(str(data) in meta["difftune_config"] for meta in headers(tmp_path / "output" / "full").values())
    peft_folder = tmp_path / "output" / "full" / "full_peft"
    assert sorted(p.name for p in peft_folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.slow
def test_the_readme_loading_snippet_runs_as_written(tmp_path, monkeypatch, tiny_sd15):
    """The README's diffusers snippet, unchanged, on a short quickstart run in the working directory."""
    import re

    import yaml
    from helpers import QUICKSTART_DATA, REPO

    job = yaml.safe_load((REPO / "config" / "examples" / "quickstart.yaml").read_text())
    process = job["config"]["process"][0]
    process["datasets"][0]["folder_path"] = str(QUICKSTART_DATA)
    process["train"]["steps"] = 2
    process["sample"]["prompts"] = []
    (tmp_path / "quickstart.yaml").write_text(yaml.safe_dump(job))
    monkeypatch.chdir(tmp_path)
    assert run.main([str(tmp_path / "quickstart.yaml")]) == 0
    snippets = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    loading = [code for code in snippets if "load_lora_weights" in code]
    assert len(loading) == 1
    exec(compile(loading[0], "README.md", "exec"), {})
    assert (tmp_path / "quickstart_lora.png").is_file()


@pytest.mark.slow
def test_a_training_sample_is_reproduced_in_diffusers_from_its_png_text(tmp_path, tiny_sd15):
    """The PNG text names the pipeline, scheduler (and its config), steps, guidance, size and seed: with them and
    the run's LoRA file, diffusers renders the same image."""
    import diffusers
    import numpy as np
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    process = trainer_process(tmp_path, train={"steps": 2}, save={"dtype": "float32"},
                              sample={"prompts": ["[trigger], a red circle"], "sample_steps": 3, "width": 64,
                                      "height": 64, "guidance_scale": 5.0, "seed": 7})
    assert run.main([str(write_job(tmp_path / "job.yaml", "repro", process))]) == 0
    run_dir = tmp_path / "output" / "repro"
    png = Image.open(run_dir / "samples" / "step_000000002_0.png")
    info = png.text
    assert (info["pipeline"], info["scheduler"], info["num_inference_steps"], info["guidance_scale"]) == (
        "StableDiffusionPipeline", "EulerDiscreteScheduler", "3", "5.0")

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15, safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = getattr(diffusers, info["scheduler"]).from_config(json.loads(info["scheduler_config"]))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(run_dir), weight_name="repro.safetensors")
    again = pipe(info["prompt"], negative_prompt=info["negative_prompt"] or None,
                 num_inference_steps=int(info["num_inference_steps"]), guidance_scale=float(info["guidance_scale"]),
                 width=int(info["width"]), height=int(info["height"]),
                 generator=torch.Generator("cpu").manual_seed(int(info["seed"]))).images[0]
    difference = np.abs(np.asarray(again, dtype=np.int16) - np.asarray(png.convert("RGB"), dtype=np.int16))
    assert difference.max() <= 1, (difference.mean(), difference.max())  # measured: identical on the CPU


def test_a_folder_is_never_written_over_a_file(tmp_path):
    from toolkit.errors import UserError
    from toolkit.files import write_folder_atomic

    target = tmp_path / "out.safetensors"
    target.write_text("keep me")
    with pytest.raises(UserError, match="is a file"):
        write_folder_atomic(target, lambda tmp: (tmp / "x").write_text("x"))
    assert target.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]
    folder = tmp_path / "peft"
    write_folder_atomic(folder, lambda tmp: (tmp / "a").write_text("1"))
    write_folder_atomic(folder, lambda tmp: (tmp / "b").write_text("2"))  # replaces the older folder whole
    assert sorted(p.name for p in folder.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "peft"]


@pytest.mark.slow
def test_a_dora_run_says_which_tools_apply_its_file_and_writes_the_diffusers_form_too(tmp_path, caplog):
    import logging

    process = trainer_process(tmp_path, network={"type": "lora", "linear": 4, "linear_alpha": 4, "use_dora": True},
                              train={"steps": 1})
    with caplog.at_level(logging.WARNING, logger="difftune"):
        assert run.main([str(write_job(tmp_path / "job.yaml", "dora", process))]) == 0
    assert "DoRA: dora.safetensors (ComfyUI/kohya form" in caplog.text
    run_dir = tmp_path / "output" / "dora"
    assert sorted(p.name for p in run_dir.glob("*.safetensors")) == ["dora.diffusers.safetensors", "dora.safetensors"]
    with safe_open(str(run_dir / "dora.safetensors"), "pt") as handle:
        meta = handle.metadata()
        assert any(key.endswith(".dora_scale") for key in handle.keys())
    assert meta["ss_network_module"] == "lycoris.kohya"
    assert json.loads(meta["ss_network_args"]) == {"algo": "lora", "dora_wd": "True"}
