"""Job files: parsing, substitution, validation errors that name file, path and a suggestion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import QUICKSTART_DATA, REPO, trainer_process, write_job

from toolkit.config import docs as config_docs
from toolkit.config.loader import ConfigError, check_paths, load_config
from toolkit.config.schema import SDTrainerConfig


def job_dict(process: dict, name: str = "my_lora") -> dict:
    return {"job": "extension", "config": {"name": name, "process": [process]}, "meta": {"name": "[name]"}}


def test_issue_example_shape_loads(tmp_path, registry):
    text = """
job: extension
config:
  name: my_lora
  process:
    - type: sd_trainer
      training_folder: output
      device: cpu
      trigger_word: null
      network: {type: lora, linear: 4, linear_alpha: 4}
      save: {dtype: float16, save_every: 250, max_step_saves_to_keep: 4}
      datasets:
        - {folder_path: data/imgs, caption_ext: txt, default_caption: "", resolution: [512], num_repeats: 1}
      train: {batch_size: 1, steps: 1000, gradient_accumulation: 1, lr: 1e-4, optimizer: adamw,
              lr_scheduler: constant, max_grad_norm: 1.0, dtype: bf16, seed: 42, gradient_checkpointing: false}
      model: {arch: sd15, name_or_path: runwayml/stable-diffusion-v1-5}
      sample: {sample_every: 250, prompts: ["a photo of [trigger]"], sample_steps: 20, guidance_scale: 7.0,
               width: 512, height: 512, seed: 42}
meta: {name: "[name]", version: "1.0"}
"""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    config, _ = load_config(str(path), registry)
    process = config.config.process[0]
    assert isinstance(process, SDTrainerConfig)
    assert isinstance(process.train.lr, float) and process.train.lr == 1e-4
    assert config.meta["name"] == "my_lora"


@pytest.mark.parametrize(
    "mutate, path_text, hint",
    [
        (lambda p: p.update(trian=p.pop("train")), "config.process[0].trian", "did you mean 'train'?"),
        (lambda p: p["train"].update(lerning_rate=1e-4), "config.process[0].train.lerning_rate",
         "did you mean 'lr'?"),
        (lambda p: p["datasets"][0].update(folder_pth="x"), "config.process[0].datasets[0].folder_pth",
         "did you mean 'folder_path'?"),
        (lambda p: p["train"].update(gradient_accumulation_steps=2),
         "config.process[0].train.gradient_accumulation_steps", "did you mean 'gradient_accumulation'?"),
    ],
)
def test_unknown_key_names_file_path_and_suggestion(tmp_path, registry, mutate, path_text, hint):
    process = trainer_process(tmp_path)
    mutate(process)
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(job_dict(process)))
    with pytest.raises(ConfigError) as err:
        load_config(str(path), registry)
    message = str(err.value)
    assert str(path) in message
    assert f"{path_text}: unknown key ({hint})" in message


def test_typos_are_within_a_few_edits_and_unambiguous():
    from toolkit.config.loader import edit_distance, suggest_key
    from toolkit.config.sections import TrainConfig

    assert [edit_distance(a, b) for a, b in (("trian", "train"), ("lr", "lr"), ("samples", "sample_steps"),
                                             ("", "abc"), ("divsor", "divisor"))] == [1, 0, 5, 3, 1]
    assert suggest_key(TrainConfig, "gradient_acumulation") == "gradient_accumulation"
    assert suggest_key(TrainConfig, "lerning_rate") == "lr"  # a typo of another trainer's name for it
    assert suggest_key(TrainConfig, "noise_scheduler") is None


def test_all_errors_are_reported_together(tmp_path, registry):
    process = trainer_process(tmp_path)
    process["train"]["lerning_rate"] = 1
    process["network"]["linear"] = 0
    path = write_job(tmp_path / "two.yaml", "x", process)
    with pytest.raises(ConfigError) as err:
        load_config(str(path), registry)
    assert "train.lerning_rate" in str(err.value) and "network.linear" in str(err.value)


def test_unknown_process_type_lists_known_ones(tmp_path, registry):
    path = write_job(tmp_path / "job.yaml", "x", {"type": "sd_trainr"})
    with pytest.raises(ConfigError, match=r"config.process\[0\].type: unknown process type 'sd_trainr'.*sd_trainer"):
        load_config(str(path), registry)


def test_name_substitution_from_config_and_from_cli(tmp_path, registry):
    process = trainer_process(tmp_path, training_folder=str(tmp_path / "[name]_runs"))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_dict(process, name="[name]")))
    with pytest.raises(ConfigError, match="pass --name"):
        load_config(str(path), registry)
    config, _ = load_config(str(path), registry, name="cat")
    assert config.config.name == "cat"
    assert config.config.process[0].training_folder == str(tmp_path / "cat_runs")
    assert config.meta["name"] == "cat"

    path.write_text(yaml.safe_dump(job_dict(process, name="dog")))
    config, _ = load_config(str(path), registry)
    assert config.config.process[0].training_folder == str(tmp_path / "dog_runs")


def test_env_expansion_and_missing_variable(tmp_path, registry):
    process = trainer_process(tmp_path, trigger_word="${TRIGGER}",
                              training_folder="${OUT_ROOT:-" + str(tmp_path) + "}/runs")
    path = write_job(tmp_path / "job.yaml", "x", process)
    config, _ = load_config(str(path), registry, environ={"TRIGGER": "sks"})
    assert config.config.process[0].trigger_word == "sks"
    assert config.config.process[0].training_folder == f"{tmp_path}/runs"
    with pytest.raises(ConfigError) as err:
        load_config(str(path), registry, environ={})
    assert str(path) in str(err.value) and "${TRIGGER}" in str(err.value)


def test_json_and_yaml_give_the_same_config(tmp_path, registry):
    data = job_dict(trainer_process(tmp_path))
    (tmp_path / "job.json").write_text(json.dumps(data))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    from_json, _ = load_config(str(tmp_path / "job.json"), registry)
    from_yaml, _ = load_config(str(tmp_path / "job.yaml"), registry)
    assert from_json.model_dump() == from_yaml.model_dump()


def test_config_name_is_looked_up_under_config_root(tmp_path, registry):
    root = tmp_path / "config"
    write_job(root / "examples" / "mine.yaml", "mine", trainer_process(tmp_path))
    _, path = load_config("mine", registry, config_root=root)
    assert path == root / "examples" / "mine.yaml"
    with pytest.raises(ConfigError, match="config 'nope' not found"):
        load_config("nope", registry, config_root=root)


def test_cross_field_checks(tmp_path, registry):
    process = trainer_process(tmp_path, train={"steps": None, "lr_warmup_steps": 2, "lr_warmup_ratio": 0.1})
    path = write_job(tmp_path / "job.yaml", "x", process)
    with pytest.raises(ConfigError) as err:
        load_config(str(path), registry)
    assert "give `steps`" in str(err.value) and "not both" in str(err.value)


def test_unknown_arch_and_device_are_config_errors(tmp_path, registry):
    process = trainer_process(tmp_path, device="gpu", model={"arch": "sdxxl"})
    path = write_job(tmp_path / "job.yaml", "x", process)
    with pytest.raises(ConfigError) as err:
        load_config(str(path), registry)
    assert "config.process[0].model.arch:" in str(err.value) and "known: flux, flux_kontext, qwen_image, qwen_image_edit, sd15" in str(err.value)
    assert "config.process[0].device: Value error, 'gpu' is not one of" in str(err.value)


def test_optimizer_params_and_polynomial_end_are_checked_with_the_config(tmp_path, registry):
    process = trainer_process(tmp_path, train={"optimizer_params": {"weight_dcay": 0.1}, "lr_scheduler": "polynomial",
                                               "lr_scheduler_params": {"lr_end": 1.0}})
    with pytest.raises(ConfigError) as err:
        load_config(str(write_job(tmp_path / "job.yaml", "x", process)), registry)
    assert "weight_dcay not accepted by adamw (valid: " in str(err.value) and "weight_decay" in str(err.value)
    assert "`lr_scheduler_params.lr_end` (1.0) must be below `lr`" in str(err.value)


@pytest.mark.parametrize("path", sorted((REPO / "config").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path, registry):
    load_config(str(path), registry, name="check")


def test_config_reference_matches_schema():
    documented = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert documented == config_docs.render(), "regenerate: python -m toolkit.config.docs > docs/config.md"


def _error(tmp_path, registry, **overrides) -> str:
    path = write_job(tmp_path / "job.yaml", "x", trainer_process(tmp_path, **overrides))
    with pytest.raises(ConfigError) as err:
        load_config(str(path), registry)
    return str(err.value)


def test_model_keys_are_those_of_the_chosen_family(tmp_path, registry):
    """`model` is the family's own section: a key another family has names that family; a typo gets a hint."""
    text = _error(tmp_path, registry, model={"arch": "sd15", "name_or_path": "tiny", "quantize": True,
                                             "single_file_confg": "x"})
    assert "config.process[0].model.quantize: not a key of arch sd15 (only of: flux, flux_kontext, qwen_image, qwen_image_edit, wan, zimage)" in text
    assert "config.process[0].model.single_file_confg: unknown key (did you mean 'single_file_config'?)" in text
    assert "model.sd15" not in text  # pydantic's union tag is not a level of the user's file


def test_unknown_and_missing_arch_name_the_known_families(tmp_path, registry):
    assert "model.arch: unknown arch 'sdxxl' (known: flux, flux_kontext, qwen_image, qwen_image_edit, sd15, sdxl, wan, wuerstchen, zimage)" in _error(
        tmp_path, registry, model={"arch": "sdxxl", "name_or_path": "x"})
    process = trainer_process(tmp_path)
    process["model"] = {"name_or_path": "tiny"}
    path = write_job(tmp_path / "job2.yaml", "y", process)
    with pytest.raises(ConfigError, match=r"model.arch: required key is missing \(one of: flux, flux_kontext, qwen_image, qwen_image_edit, sd15, sdxl, wan, wuerstchen, zimage\)"):
        load_config(str(path), registry)


def test_conv_rank_on_a_family_without_conv_layers_is_a_config_error(tmp_path, registry):
    """An ai-toolkit Z-Image config with `network.conv: 16` is refused when the file is read, naming the key."""
    text = _error(tmp_path, registry, model={"arch": "zimage", "name_or_path": "tiny"},
                  network={"type": "lora", "linear": 4, "linear_alpha": 4, "conv": 16})
    assert "network.conv: the zimage family (Z-Image) has no conv layers to adapt" in text
    ok = trainer_process(tmp_path, network={"type": "lora", "linear": 4, "conv": 4})  # sd15 has conv layers
    load_config(str(write_job(tmp_path / "ok.yaml", "ok", ok)), registry)


def test_train_keys_reach_each_consumer_as_its_own_group(tmp_path, registry):
    """The job file keeps `train` flat; each factory receives only its group, typed."""
    from toolkit.config.sections import LRScheduleSection, ObjectiveSection, OptimizerSection, RuntimeSection

    process = trainer_process(tmp_path, train={"lr": 2e-4, "optimizer": "adamw", "optimizer_params": {"eps": 1e-7},
                                               "lr_scheduler": "cosine", "lr_warmup_steps": 1, "min_snr_gamma": 5,
                                               "num_workers": 1})
    train = load_config(str(write_job(tmp_path / "job.yaml", "x", process)), registry)[0].config.process[0].train
    assert isinstance(train.optimization, OptimizerSection)
    assert train.optimization.model_dump() == {"optimizer": "adamw", "lr": 2e-4, "text_encoder_lr": None, "optimizer_params": {"eps": 1e-7},
                                               "max_grad_norm": 1.0}
    assert isinstance(train.lr_schedule, LRScheduleSection) and train.lr_schedule.lr_warmup_steps == 1
    assert isinstance(train.objective, ObjectiveSection) and train.objective.min_snr_gamma == 5
    assert isinstance(train.runtime, RuntimeSection) and train.runtime.num_workers == 1
    assert not set(OptimizerSection.model_fields) & set(LRScheduleSection.model_fields)


def test_checking_a_job_file_imports_no_training_library():
    """The modules `run.py` needs to read and check a job file (and for --status, --control, --report) import
    neither torch, diffusers, transformers, accelerate nor peft at module level, directly or through others."""
    import ast

    heavy = ("torch", "diffusers", "transformers", "accelerate", "peft", "safetensors", "optimum", "bitsandbytes")
    seen, todo, offenders = set(), ["toolkit.config.loader", "jobs.registry", "toolkit.run.control",
                                    "toolkit.run.report", "toolkit.config.docs", "extensions.example"], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = REPO / (name.replace(".", "/") + ".py")
        if not path.is_file():
            path = REPO / name.replace(".", "/") / "__init__.py"
        for node in ast.parse(path.read_text()).body:  # module level only: function-level imports run on demand
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for module in names:
                if module.split(".")[0] in heavy:
                    offenders.append(f"{name} imports {module}")
                elif module.split(".")[0] in ("toolkit", "jobs"):
                    todo.append(module)
    assert offenders == []
    from toolkit.models.registry import available_archs, config_class

    assert all(config_class(arch).__module__.endswith(".config") for arch in available_archs())


def test_paths_are_checked_before_any_model_loads(tmp_path, registry):
    """Every missing or empty dataset folder and every local-looking path that does not exist, each named by its
    key, all at once; hub ids and tiny presets are not paths."""
    from helpers import make_images


    (tmp_path / "empty").mkdir()
    images = make_images(tmp_path / "images", 1)
    process = trainer_process(
        tmp_path,
        model={"arch": "zimage", "name_or_path": "Tongyi-MAI/Z-Image-Turbo", "single_file_config": "./nowhere",
               "sampling": {"name_or_path": str(tmp_path / "absent.safetensors")}},
        network={"linear": 4, "pretrained_lora_path": str(tmp_path / "missing_lora.safetensors")},
        datasets=[{"folder_path": str(tmp_path / "absent")}, {"folder_path": str(tmp_path / "empty")},
                  {"folder_path": str(images)}])
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "x", process)), registry)
    with pytest.raises(ConfigError) as err:
        check_paths(config, path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"{path}: paths not found"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "config.process[0].datasets[0].folder_path", "config.process[0].datasets[1].folder_path",
        "config.process[0].model.single_file_config", "config.process[0].model.sampling.name_or_path",
        "config.process[0].network.pretrained_lora_path"]
    assert "no images (.png, .jpg, .jpeg, .webp)" in lines[2]
    fine = trainer_process(tmp_path, datasets=[{"folder_path": str(images)}])
    config, path = load_config(str(write_job(tmp_path / "ok.yaml", "ok", fine)), registry)
    check_paths(config, path)  # tiny preset, a folder with an image: nothing to say


def test_dataset_folders_expand_the_home_folder_once_for_the_check_and_the_loader():
    from toolkit.config.sections import DatasetConfig

    assert DatasetConfig(folder_path="~/imgs").folder_path == str(Path.home() / "imgs")
    assert DatasetConfig(folder_path="x", cache_dir="~/c").cache_dir == str(Path.home() / "c")


def test_a_job_file_that_is_not_text_is_a_config_error(tmp_path, registry):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="cannot read it as a UTF-8 text file"):
        load_config(str(path), registry)


@pytest.mark.parametrize("example", sorted((REPO / "config" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_passes_the_schema(example, registry):
    """What a user copies must be valid as shipped (paths are checked when a job runs, not here)."""
    config, _ = load_config(str(example), registry)
    assert config.config.process


def problem_keys(error: ConfigError) -> list[str]:
    """The keys an error's lines name (`  config.process[0].train.lr: ...` -> `train.lr`), in order."""
    lines = str(error).splitlines()[1:]
    return [line.strip().split(": ")[0].removeprefix("config.process[0].").removeprefix("config.process[0]")
            for line in lines]


def test_every_problem_a_file_shows_is_reported_at_once(tmp_path, registry):
    """Type errors, unknown keys, checks across keys (in a section and across sections: family capabilities,
    exclusive keys) and missing paths come out in one message: a bad key no longer hides the checks pydantic
    skips once any key of a section fails, nor the paths checked after the schema."""
    process = trainer_process(
        tmp_path,
        network={"linear": "four", "train_text_encoder": True},  # type error: replaced, network's checks skipped
        datasets=[{"folder_path": str(tmp_path / "missing_images"), "resolution": [4]},  # range error + path
                  {"folder_path": str(QUICKSTART_DATA), "mask_path": str(QUICKSTART_DATA)}],  # check within a dataset
        train={"steps": 10, "lr_warmup_steps": 50, "lrr": 1e-4,  # warmup check (lrr only removed: checks still run)
               "cache_text_embeddings": True,  # exclusive with network.train_text_encoder
               "guidance_scale": 3.5},  # a capability SD 1.5 lacks
        model={"arch": "sd15", "name_or_path": str(tmp_path / "missing_model")},
        sample={"use_ema": True},  # across sections: no train.ema
        validation={"every": 5},  # neither folder_path nor split
    )
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "job.yaml", "all", process)), registry)
    keys = problem_keys(error.value)
    assert str(error.value).startswith(f"{tmp_path / 'job.yaml'}: invalid config")
    assert sorted(keys) == sorted([
        "network.linear", "datasets[0].resolution", "train.lrr", "datasets[1].mask_path", "train",
        "validation", "train.guidance_scale", "sample.use_ema", "network.train_text_encoder",
        "datasets[0].folder_path", "model.name_or_path"]), str(error.value)
    text = str(error.value)
    assert "did you mean 'lr'" in text and "must be shorter than `steps`" in text
    assert "cannot go with train.cache_text_embeddings" in text and "give `folder_path`" in text
    assert text.count("network.linear") == 1  # the replaced value's own error only


def test_a_required_key_that_does_not_parse_leaves_the_sections_that_do(tmp_path, registry):
    """Without `model.name_or_path` (required: it cannot be set aside) the process does not parse; the sections and
    dataset entries that do still get their checks and paths, and the checks across sections wait for the fix."""
    process = trainer_process(
        tmp_path, datasets=[{"resolution": [64]}, {"folder_path": str(tmp_path / "missing_images")}],
        train={"steps": 10, "lr_warmup_steps": 50, "guidance_scale": 3.5},
    )
    process["model"] = {"arch": "sd15"}
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "job.yaml", "partial", process)), registry)
    assert sorted(problem_keys(error.value)) == sorted([
        "model.name_or_path", "datasets[0].folder_path", "train", "datasets[1].folder_path"]), str(error.value)
    assert "required key is missing" in str(error.value) and "folder not found" in str(error.value)


def test_a_later_process_may_read_what_an_earlier_one_writes_even_in_an_error_report(tmp_path, registry):
    """The paths joined to a report of other problems leave out those inside an earlier process's training folder
    (they exist only once it ran); `check_paths` of that process, when it starts, still checks them."""
    first = trainer_process(tmp_path, train={"steps": 2, "lrr": 1})
    lora = tmp_path / "output" / "one" / "one.safetensors"
    second = trainer_process(tmp_path, network={"pretrained_lora_path": str(lora)},
                             datasets=[{"folder_path": str(tmp_path / "missing_images")}])
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "job.yaml", "one", first, second)), registry)
    text = str(error.value)
    assert "config.process[0].train.lrr" in text and "config.process[1].datasets[0].folder_path" in text
    assert "pretrained_lora_path" not in text


def test_part_files_are_named_by_key_when_they_are_not_there(tmp_path, registry):
    """A single-file base with its VAE and text encoders as files (configs shipped: no single_file_config needed):
    every missing file is named by its key, each text encoder by its place in the list."""
    process = trainer_process(tmp_path)
    process["model"] = {"arch": "sdxl", "name_or_path": str(tmp_path / "base.safetensors"),
                        "vae_name_or_path": str(tmp_path / "vae.safetensors"),
                        "text_encoder_path": [str(tmp_path / "clip_l.safetensors"), str(tmp_path / "clip_g.safetensors")]}
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "sdxl", process)), registry)
    with pytest.raises(ConfigError) as error:
        check_paths(config, path)
    assert problem_keys(error.value) == ["model.name_or_path", "model.vae_name_or_path", "model.text_encoder_path[0]",
                                         "model.text_encoder_path[1]"]


@pytest.mark.parametrize("overrides, absent", [
    ({"train": {"ema": 0.999}, "sample": {"use_ema": True}}, "sample.use_ema"),
    ({"network": {"train_text_encoder": "yes please"}, "train": {"text_encoder_lr": 1e-5}}, "train.text_encoder_lr"),
    ({"train": {"timestep_type": "fixed_cycle", "timestep_params": {"cycle": 0.5}}}, "train:"),
])
def test_a_check_never_judges_the_default_put_in_for_a_bad_value(tmp_path, registry, overrides, absent):
    """A bad value is reported once; checks that read the default the loader put in for it stay quiet (the EMA the
    file asks for is there, only written wrongly)."""
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "job.yaml", "d", trainer_process(tmp_path, **overrides))), registry)
    assert len(str(error.value).splitlines()) == 2 and absent not in str(error.value).splitlines()[1], str(error.value)


def test_a_key_with_several_errors_still_leaves_the_other_checks(tmp_path, registry):
    """Two bad items of one list are two errors about one key: set aside once, the other sections still checked;
    a union of plain types is named by its key, not by pydantic's label of a member."""
    process = trainer_process(tmp_path, datasets=[{"folder_path": str(QUICKSTART_DATA), "resolution": ["a", "b"]}],
                              train={"guidance_scale": 3.5, "resume": 5.5})
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "job.yaml", "k", process)), registry)
    keys = problem_keys(error.value)
    assert "train.guidance_scale" in keys and "datasets[0].resolution[0]" in keys and "datasets[0].resolution[1]" in keys
    assert set(keys) <= {"train.guidance_scale", "datasets[0].resolution[0]", "datasets[0].resolution[1]",
                         "train.resume"}, keys


def test_a_non_text_key_is_an_unknown_key_of_its_section_only(tmp_path, registry):
    """A YAML key such as `1:` is an unknown key of `network`; the rest of `network` is still checked."""
    process = trainer_process(tmp_path, network={1: "x", "pretrained_lora_path": str(tmp_path / "no.safetensors")})
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "job.yaml", "n", process)), registry)
    assert problem_keys(error.value) == ["network[1]", "network.pretrained_lora_path"], str(error.value)


def test_before_a_job_starts_only_its_earlier_processes_run_folders_are_left_unchecked(tmp_path, registry):
    """run.py checks every process's paths before the first one starts, except what an earlier process writes: its
    run folder <training_folder>/<name>, not the whole training folder (a typo elsewhere in it is still found)."""
    first = trainer_process(tmp_path, train={"steps": 2})
    made = tmp_path / "output" / "two" / "two.safetensors"
    second = trainer_process(tmp_path, network={"pretrained_lora_path": str(made)})
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "two", first, second)), registry)
    check_paths(config, path, skip_earlier_outputs=True)
    with pytest.raises(ConfigError, match="pretrained_lora_path"):
        check_paths(config, path)  # when the second process starts, the file must be there
    second["network"]["pretrained_lora_path"] = str(tmp_path / "output" / "tow" / "two.safetensors")
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "two", first, second)), registry)
    with pytest.raises(ConfigError, match=r"config.process\[1\].network.pretrained_lora_path"):
        check_paths(config, path, skip_earlier_outputs=True)


def test_a_family_that_does_not_parse_holds_no_clip_against_a_folder(tmp_path, registry):
    """Without a parsed `model` it is not known whether clips are samples: a folder of clips is not called empty."""
    from helpers import write_mp4

    write_mp4(tmp_path / "clips" / "a.mp4", frames=2)
    process = trainer_process(tmp_path, datasets=[{"folder_path": str(tmp_path / "clips")}])
    process["model"] = {"arch": "wan"}
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "job.yaml", "w", process)), registry)
    assert problem_keys(error.value) == ["model.name_or_path"], str(error.value)


def test_malformed_values_where_text_is_expected_are_config_errors(tmp_path, registry):
    """A process type or a job name that is not text is named, not a traceback."""
    for body in ({"name": "x", "process": [{"type": ["a"]}]}, {"name": 5, "process": [trainer_process(tmp_path)]}):
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump({"job": "extension", "config": body}))
        with pytest.raises(ConfigError):
            load_config(str(path), registry)


def test_an_extension_process_with_its_own_checks_is_reported_not_crashed(tmp_path):
    """A registered process model may be a plain pydantic model with its own validators: the loader's partial view
    of it never runs them on missing keys."""
    from pydantic import BaseModel, model_validator

    class Plain(BaseModel):
        type: str
        a: int
        b: int = 0

        @model_validator(mode="after")
        def _b_below_a(self):
            if self.b > self.a:
                raise ValueError("b must not exceed a")
            return self

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"config": {"name": "x", "process": [{"type": "plain", "a": "one", "b": 2}]}}))
    with pytest.raises(ConfigError, match=r"config.process\[0\].a"):
        load_config(str(path), {"plain": Plain})
    path.write_text(yaml.safe_dump({"config": {"name": "x", "process": [{"type": "plain", "a": 1, "b": 2}]}}))
    with pytest.raises(ConfigError, match="b must not exceed a"):
        load_config(str(path), {"plain": Plain})


def test_a_single_file_wan_transformer_is_refused_by_the_config(tmp_path, registry):
    process = trainer_process(tmp_path)
    process["model"] = {"arch": "wan", "name_or_path": "/models/wan2.1_t2v_1.3B.safetensors"}
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "job.yaml", "w", process)), registry)
    assert problem_keys(error.value)[0] == "model.name_or_path" and "single-file transformers are not read" in str(
        error.value)
