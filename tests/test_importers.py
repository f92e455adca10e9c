"""Other trainers' job files: recognised when run directly (one message, before any model loads), imported by
`run.py --import-config` into difftune jobs that mean the same training (the fixtures are in the shapes ai-toolkit's
examples and web UI write), and never mistaken for a difftune job."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from helpers import QUICKSTART_DATA

import run
from toolkit.config.importers.aitoolkit import import_aitoolkit
from toolkit.config.importers.conversion import ImportRefused
from toolkit.config.importers.detect import AITOOLKIT_KEYS, detect
from toolkit.config.loader import ConfigError, load_config, read_raw
from toolkit.config.schema import SDTrainerConfig
from toolkit.run.metrics import read_metrics

FIXTURES = Path(__file__).parent / "fixtures" / "foreign"
AITOOLKIT = ["aitoolkit_ui_sd15.json", "aitoolkit_ui_zimage.json", "aitoolkit_flux_example.yaml"]


def source_process(name: str) -> dict:
    return read_raw(FIXTURES / name)["config"]["process"][0]


@pytest.mark.parametrize("name", AITOOLKIT)
def test_an_aitoolkit_job_run_directly_gets_one_message_before_any_model_loads(name, registry, capsys, caplog):
    caplog.set_level(logging.ERROR, logger="difftune")
    with pytest.raises(ConfigError) as error:
        load_config(str(FIXTURES / name), registry)
    message = str(error.value)
    assert "ai-toolkit job" in message and "--import-config" in message and "\n" not in message
    assert run.main([str(FIXTURES / name)]) == 1
    assert sum("--import-config" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("name", AITOOLKIT)
def test_each_aitoolkit_fixture_imports_and_the_job_it_writes_loads(name, tmp_path, registry, capsys):
    out = tmp_path / "imported.yaml"
    assert run.main(["--import-config", str(FIXTURES / name), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    config, _ = load_config(str(out), registry)
    assert isinstance(config.config.process[0], SDTrainerConfig)
    # every key of the source has a line in the table
    conversion = import_aitoolkit(read_raw(FIXTURES / name))
    sources = {row.source for row in conversion.rows}
    for path in conversion_source_paths(name):  # a mapping's entries may have a row each instead
        assert path in sources or any(source.startswith(path + ".") for source in sources), path
    assert "Check these" in printed


def conversion_source_paths(name: str) -> list[str]:
    from toolkit.config.importers.aitoolkit import LEAVES
    from toolkit.config.importers.conversion import flatten

    return list(flatten(source_process(name), leaves=LEAVES))


def test_mapped_keys_keep_their_meaning(tmp_path):
    """LR, steps, batch size, rank/alpha, schedule, warmup, resolution, caption extension, repeats and trigger word
    of the imported job are the source's, as ai-toolkit applies them."""
    source = source_process("aitoolkit_ui_sd15.json")
    job = import_aitoolkit(read_raw(FIXTURES / "aitoolkit_ui_sd15.json")).job["config"]["process"][0]
    process = SDTrainerConfig.model_validate(job)
    train, network, data = process.train, process.network, process.datasets[0]
    assert (train.lr, train.steps, train.batch_size) == (source["train"]["lr"], source["train"]["steps"], 1)
    assert (network.linear, network.linear_alpha) == (32, 32.0)
    assert train.lr_scheduler == "constant" and train.lr_warmup_steps == 0
    assert data.resolution == [512] and data.caption_ext == "txt" and data.num_repeats == 1
    assert process.trigger_word == "shp" and process.model.arch == "sd15"
    assert train.timestep_type == "uniform"  # ai-toolkit's `sigmoid` does nothing on SD 1.5
    # a transformer family: alpha = rank whatever the file says; its shift where timestep_type is inert
    flux = SDTrainerConfig.model_validate(
        import_aitoolkit(read_raw(FIXTURES / "aitoolkit_flux_example.yaml")).job["config"]["process"][0])
    assert (flux.network.linear, flux.network.linear_alpha) == (16, 16.0) and flux.train.ema.decay == 0.99
    assert flux.sample.use_ema and flux.model.quantize and flux.model.quantize_te
    # what a silent file means in ai-toolkit is written out
    silent = {"config": {"name": "s", "process": [{"type": "sd_trainer", "network": {"type": "lora"},
                                                   "datasets": [{"folder_path": "d"}],
                                                   "model": {"name_or_path": "m", "arch": "sdxl"}}]}}
    written = import_aitoolkit(silent).job["config"]["process"][0]
    assert written["train"]["lr"] == 1e-6 and written["train"]["steps"] == 1000
    assert written["network"]["linear"] == 4 and written["network"]["linear_alpha"] == 1.0
    assert written["model"]["dtype"] == "fp32" and written["sample"]["sample_at_start"] is True
    assert written["sample"]["guidance_scale"] == 7.0 and written["sample"]["seed"] == 0


def test_legacy_accumulation_counts_steps_in_micro_batches():
    data = {"config": {"name": "s", "process": [{"type": "sd_trainer", "network": {"linear": 8},
                                                 "datasets": [{"folder_path": "d"}], "model": {"name_or_path": "m"},
                                                 "train": {"steps": 1000, "gradient_accumulation_steps": 4},
                                                 "save": {"save_every": 250}}]}}
    conversion = import_aitoolkit(data)
    job = conversion.job["config"]["process"][0]
    assert job["train"]["gradient_accumulation"] == 4 and job["train"]["steps"] == 250
    assert job["save"]["save_every"] == 63 and any("micro-batches" in c for c in conversion.checks)


@pytest.mark.parametrize("model, message", [
    ({"arch": "chroma"}, "model.arch 'chroma' (Chroma) has no difftune family"),
    ({"is_v3": True}, "model.arch 'sd3'"),
    ({"arch": "sd15", "name_or_path": "m"}, None),
])
def test_a_family_difftune_lacks_is_refused_by_name(model, message):
    data = {"config": {"name": "s", "process": [{"type": "sd_trainer", "network": {}, "model": model,
                                                 "datasets": [{"folder_path": "d"}]}]}}
    if message is None:
        assert import_aitoolkit(data).job["config"]["process"][0]["model"]["arch"] == "sd15"
        return
    with pytest.raises(ImportRefused, match=message.replace("(", r"\(").replace(")", r"\)")):
        import_aitoolkit(data)


def test_keys_that_mean_something_else_are_not_carried_over():
    """ai-toolkit's `noise_scheduler` is its training noise schedule, not the LR schedule; its
    `diff_output_preservation` is not difftune's blank-prompt preservation; its `linear` LR schedule ramps up."""
    data = {"config": {"name": "s", "process": [{
        "type": "sd_trainer", "network": {}, "model": {"name_or_path": "m", "arch": "flux"},
        "datasets": [{"folder_path": "d"}],
        "train": {"noise_scheduler": "flowmatch", "diff_output_preservation": True, "lr_scheduler": "cosine"}}]}}
    conversion = import_aitoolkit(data)
    train = conversion.job["config"]["process"][0]["train"]
    assert "blank_prompt_preservation" not in train and train["lr_scheduler"] == "cosine"
    assert any("diff_output_preservation" in c for c in conversion.checks)
    data["config"]["process"][0]["train"]["lr_scheduler"] = "linear"
    with pytest.raises(ImportRefused, match="ramps the LR up"):
        import_aitoolkit(data)


def test_an_ai_toolkit_key_is_never_a_difftune_key():
    """The keys that mark a file as ai-toolkit's are none of difftune's (so a difftune job is never taken for one)."""
    from toolkit.config.sections import NetworkConfig, SampleConfig, SaveConfig, TrainConfig
    from toolkit.models.registry import available_archs, config_class

    ours = {"": set(SDTrainerConfig.model_fields), "network": set(NetworkConfig.model_fields),
            "train": set(TrainConfig.model_fields), "sample": set(SampleConfig.model_fields),
            "save": set(SaveConfig.model_fields),
            "model": {k for arch in available_archs() for k in config_class(arch).model_fields}}
    for section, keys in AITOOLKIT_KEYS.items():
        assert not keys & ours[section], (section, keys & ours[section])
    example = yaml.safe_load((Path(__file__).parents[1] / "config" / "examples" / "quickstart.yaml").read_text())
    assert detect(example) is None


@pytest.mark.slow
def test_the_imported_ui_sd15_job_trains_on_the_tiny_model(tmp_path, registry):
    """The UI's SD 1.5 job, imported, with only the model and dataset paths pointed at local folders, trains 3
    updates."""
    out = tmp_path / "imported.yaml"
    assert run.main(["--import-config", str(FIXTURES / "aitoolkit_ui_sd15.json"), "-o", str(out)]) == 0
    job = yaml.safe_load(out.read_text())
    process = job["config"]["process"][0]
    process["model"]["name_or_path"] = "tiny"
    process["datasets"][0]["folder_path"] = str(QUICKSTART_DATA)
    process["datasets"][0]["resolution"] = [64]
    process["training_folder"] = str(tmp_path / "output")
    process["device"] = "cpu"
    process["train"].update(steps=3, optimizer="adamw")  # bitsandbytes' 8-bit AdamW needs a GPU; bf16 as imported
    process["sample"].update(width=64, height=64, sample_steps=2, sample_at_start=False)
    out.write_text(json.dumps(job))
    assert run.main([str(out)]) == 0
    records = [r for r in read_metrics(tmp_path / "output" / job["config"]["name"] / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]


def test_a_kohya_configuration_run_directly_is_recognised(tmp_path, registry):
    with pytest.raises(ConfigError, match="kohya sd-scripts configuration file .* --import-config"):
        load_config(str(FIXTURES / "kohya_sd15_lora.toml"), registry)
    dataset = tmp_path / "dataset.toml"
    dataset.write_text('[general]\nshuffle_caption = true\n[[datasets]]\nresolution = 512\n'
                       '[[datasets.subsets]]\nimage_dir = "img"\n')
    with pytest.raises(ConfigError, match="kohya sd-scripts dataset config"):
        load_config(str(dataset), registry)


#: other trainers' names that look like a difftune key but mean something else: none may get a "did you mean"
TRAPS = {
    ("train", "noise_scheduler"): "ai-toolkit's training noise schedule, not the LR schedule",
    ("train", "diff_output_preservation"): "class-word preservation, not blank-prompt preservation",
    ("network", "network_dropout"): "kohya's dropout of the LoRA's hidden units, not of its inputs",
    ("save", "save_last_n_steps"): "kohya keeps the saves of the last N steps, not N saves",
    ("datasets", "alpha_mask"): "kohya's switch to use the image's alpha channel, not a mask folder",
    ("sample", "samples"): "ai-toolkit's per-prompt list, not the step count",
    ("train", "train_unet"): "whether the UNet trains at all",
    ("train", "timestep_bias_strategy"): "diffusers' timestep bias, not a timestep sampler",
}


def hints_for(section: str, key: str, registry) -> list[str]:
    """The "did you mean" targets a difftune job gets for `key` put in `section`."""
    import re

    from toolkit.config.loader import validate_job

    process = {"type": "sd_trainer", "model": {"arch": "sd15", "name_or_path": "tiny"},
               "datasets": [{"folder_path": "d"}], "train": {"steps": 1}}
    block = process if not section else (process["datasets"][0] if section == "datasets" else
                                         process.setdefault(section, {}))
    block[key] = 1
    try:
        validate_job({"config": {"name": "x", "process": [process]}}, Path("x.yaml"), registry)
    except ConfigError as err:
        lines = [line for line in str(err).splitlines() if line.strip().split(":")[0].endswith(f".{key}")]
        return [m for line in lines for m in re.findall(r"did you mean '([^']+)'", line)]
    return []


@pytest.mark.parametrize("section, key", sorted(TRAPS))
def test_no_hint_crosses_to_a_key_of_another_meaning(section, key, registry):
    assert hints_for(section, key, registry) == [], TRAPS[(section, key)]


def test_every_hint_for_a_fixture_key_is_what_the_importer_makes_of_it(registry):
    """Every key of the shipped foreign fixtures, put into a difftune job where the source had it: a hint, if any,
    names the key the importer maps it to (the same setting), never another."""
    from toolkit.config.importers.aitoolkit import LEAVES
    from toolkit.config.importers.conversion import flatten
    from toolkit.config.loader import ELSEWHERE

    for name in AITOOLKIT:
        conversion = import_aitoolkit(read_raw(FIXTURES / name))
        targets = {row.source: row.outcome.split(" = ")[0][3:] for row in conversion.rows if row.outcome.startswith("->")}
        for path in flatten(source_process(name), leaves=LEAVES):
            parts = path.replace("datasets[0]", "datasets").split(".")
            section, key = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
            if section not in ("", "model", "network", "datasets", "train", "save", "sample", "logging"):
                continue
            for hint in hints_for(section, key, registry):
                mapped = targets.get(path, "").replace("datasets[0]", "datasets[]")
                assert hint in (mapped, mapped.split(".", 1)[-1]), (name, path, hint, mapped)
    for (section, key), target in ELSEWHERE.items():
        assert hints_for(section, key, registry) == [target]
    # kohya's arguments, where a user would put them in a difftune job: at the process level and under `train`
    from toolkit.config.importers.kohya import flat_arguments, import_kohya

    data = read_raw(KOHYA)
    conversion = import_kohya(data, KOHYA)
    targets = {row.source: row.outcome.split(" = ")[0][3:] for row in conversion.rows if row.outcome.startswith("->")}
    for key in flat_arguments(data):
        for section in ("", "train"):
            for hint in hints_for(section, key, registry):
                mapped = targets.get(key, "")
                assert mapped and (hint == mapped or mapped.endswith("." + hint)), (key, section, hint, mapped)


def test_the_migration_guide_shows_what_the_importer_does():
    from toolkit.config.importers.docs import generated, generated_kohya

    page = (Path(__file__).parents[1] / "docs" / "migrating.md").read_text(encoding="utf-8")
    for block in (generated(), generated_kohya()):
        assert block in page, "regenerate docs/migrating.md's tables: python -m toolkit.config.importers.docs --write"


def minimal(**train) -> dict:
    """An ai-toolkit job in its examples' form with nothing but the shared keys."""
    return {"config": {"name": "m", "process": [{
        "type": "sd_trainer", "network": {"type": "lora", "linear": 8, "linear_alpha": 8},
        "datasets": [{"folder_path": "d"}], "model": {"name_or_path": "m", "arch": "zimage"},
        "train": {"steps": 1000, **train}}]}}


def test_ai_toolkits_timestep_indices_count_from_pure_noise():
    """ai-toolkit's tables run from pure noise down: indices 0..499 are the noisy half, u from 0.5 to 1."""
    job = import_aitoolkit(minimal(min_denoising_steps=0, max_denoising_steps=499, noise_scheduler="flowmatch",
                                   timestep_type="linear")).job["config"]["process"][0]
    assert job["train"]["timestep_range"] == [0.5, 1.0]


def test_accumulation_of_the_ui_and_the_legacy_key_together():
    """Every UI job carries `gradient_accumulation: 1`; with the legacy key above 1, ai-toolkit counts micro-batches."""
    conversion = import_aitoolkit(minimal(gradient_accumulation=1, gradient_accumulation_steps=4))
    train = conversion.job["config"]["process"][0]["train"]
    assert train["gradient_accumulation"] == 4 and train["steps"] == 250
    with pytest.raises(ImportRefused, match="both above 1"):
        import_aitoolkit(minimal(gradient_accumulation=2, gradient_accumulation_steps=4))


def test_adafactor_is_never_clipped_as_in_ai_toolkit():
    train = import_aitoolkit(minimal(optimizer="adafactor", max_grad_norm=1.0, lr=1e-4)).job["config"]["process"][0][
        "train"]
    assert train["max_grad_norm"] == 0.0 and train["optimizer_params"]["relative_step"] is False


def test_a_wrong_value_is_named_not_a_traceback():
    with pytest.raises(ImportRefused, match=r"train\.steps: None is not a value"):
        import_aitoolkit(minimal(steps=None))
    with pytest.raises(ImportRefused, match="warms up over 1000 updates of 500"):
        import_aitoolkit(minimal(steps=500, lr_scheduler="constant_with_warmup"))


def test_the_import_never_overwrites_the_source_or_an_earlier_import(tmp_path, capsys):
    source = tmp_path / "job.yaml"
    source.write_text(yaml.safe_dump(minimal()))
    before = source.read_text()
    assert run.main(["--import-config", str(source), "-o", str(source)]) == 1
    assert source.read_text() == before
    out = tmp_path / "mine.yaml"
    assert run.main(["--import-config", str(source), "-o", str(out)]) == 0
    first = out.read_text()
    assert run.main(["--import-config", str(source), "-o", str(out)]) == 1 and out.read_text() == first
    assert run.main(["--import-config", str(source), "-o", str(out), "--force"]) == 0
    assert run.main(["--import-config", str(source), "-o", str(tmp_path / "mine.json")]) == 1


def test_what_tells_an_ai_toolkit_job_apart(tmp_path):
    """Its arch names and process types alone; its other keys only together (one stray key in a difftune job gets the
    schema's own message); a registered extension's process type is never another trainer's; kohya's sectioned toml."""
    assert detect(minimal()) is None  # the shared keys only
    with_arch = minimal()
    with_arch["config"]["process"][0]["model"]["arch"] = "wan21:1b"
    assert detect(with_arch) is not None
    stray = minimal()
    stray["config"]["process"][0]["save"] = {"push_to_hub": False}
    assert detect(stray) is None
    stray["config"]["process"][0]["sample"] = {"sampler": "flowmatch"}
    assert detect(stray) is not None
    extension = {"config": {"name": "e", "process": [{"type": "generate", "log_dir": "x", "sqlite_db_path": "y"}]}}
    assert detect(extension) is not None and detect(extension, frozenset({"sd_trainer", "generate"})) is None
    sectioned = {"model_arguments": {"pretrained_model_name_or_path": "m"}, "training_arguments": {"learning_rate": 1}}
    assert detect(sectioned).trainer == "kohya sd-scripts configuration"
    # asked explicitly, a file of the shared keys is read as ai-toolkit's, and says so
    from toolkit.config.importers.importer import convert

    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump(minimal()))
    assert any("read as an ai-toolkit job" in c for c in convert(path).checks)


KOHYA = FIXTURES / "kohya_sd15_lora.toml"


def test_a_kohya_configuration_imports_with_its_dataset_and_prompts(tmp_path, registry, capsys):
    """The training toml (in kohya's tables) with the dataset toml and prompt file it names: what kohya applies is
    what the job says (LR, steps, batch, rank/alpha, schedule, warmup, resolution, caption extension, repeats, the
    text encoder trained by default, the caption of uncaptioned images)."""
    out = tmp_path / "imported.yaml"
    assert run.main(["--import-config", str(KOHYA), "-o", str(out)]) == 0
    config, _ = load_config(str(out), registry)
    process = config.config.process[0]
    train, network, data = process.train, process.network, process.datasets[0]
    assert process.model.arch == "sd15" and config.config.name == "shapes_lora"
    assert (train.lr, train.text_encoder_lr, train.steps, train.batch_size) == (1e-4, 5e-5, 400, 2)
    assert (network.linear, network.linear_alpha, network.conv, network.conv_alpha) == (16, 8.0, 4, 1.0)
    assert network.train_text_encoder  # kohya trains it unless network_train_unet_only
    assert (train.lr_scheduler, train.lr_warmup_steps, train.lr_scheduler_params.num_cycles) == (
        "cosine_with_restarts", 50, 3)
    assert train.optimizer == "adamw8bit" and train.optimizer_params == {"weight_decay": 0.01, "betas": [0.9, 0.99]}
    assert (data.resolution, data.caption_ext, data.num_repeats, data.keep_tokens) == ([512], "txt", 10, 1)
    assert data.shuffle_tokens and data.default_caption == "shp shape" and data.cache_latents
    assert process.sample.prompts == ["shp, a red circle", "shp, a blue square"] and process.sample.seed == 1
    assert (process.save.save_every, process.save.max_step_saves_to_keep, process.save.dtype) == (100, 4, "float16")
    conversion_rows = capsys.readouterr().out
    for key in ("xformers", "seed", "min_snr_gamma", "network_args conv_dim", "subset 0 image_dir"):
        assert f"\n{key} " in conversion_rows, key


def test_kohya_defaults_and_families(tmp_path):
    from toolkit.config.importers.kohya import import_kohya

    path = tmp_path / "args.toml"
    data = {"pretrained_model_name_or_path": "/models/model.safetensors", "network_module": "networks.lora",
            "train_data_dir": str(tmp_path / "train")}
    (tmp_path / "train" / "5_ohwx dog").mkdir(parents=True)
    with pytest.raises(ImportRefused, match="--family sd15 or --family sdxl"):
        import_kohya(data, path)
    job = import_kohya(data, path, family="sdxl").job["config"]["process"][0]
    assert job["train"]["lr"] == 2e-6 and job["train"]["steps"] == 1600
    assert job["network"]["linear"] == 4 and job["network"]["linear_alpha"] == 1.0
    assert job["datasets"][0]["caption_ext"] == "caption" and job["datasets"][0]["num_repeats"] == 5
    assert job["datasets"][0]["default_caption"] == "ohwx dog" and job["save"]["dtype"] == "float32"
    flux = import_kohya({**data, "network_module": "networks.lora_flux"}, path).job["config"]["process"][0]
    assert flux["model"]["arch"] == "flux" and flux["train"]["guidance_scale"] == 3.5
    assert flux["train"]["timestep_type"] == "shift" and flux["train"]["timestep_params"] == {"shift": 3.0}
    with pytest.raises(ImportRefused, match="Stable Diffusion 3"):
        import_kohya({**data, "network_module": "networks.lora_sd3"}, path)


@pytest.mark.slow
def test_the_imported_kohya_job_trains_on_the_tiny_model(tmp_path, registry):
    out = tmp_path / "imported.yaml"
    assert run.main(["--import-config", str(KOHYA), "-o", str(out)]) == 0
    job = yaml.safe_load(out.read_text())
    process = job["config"]["process"][0]
    process["model"]["name_or_path"] = "tiny"
    process["datasets"][0].update(folder_path=str(QUICKSTART_DATA), resolution=[64], num_repeats=1)
    process["training_folder"] = str(tmp_path / "output")
    process["device"] = "cpu"
    process["train"].update(steps=3, optimizer="adamw", lr_warmup_steps=1)  # in the bf16 it asks for
    process["sample"].update(width=64, height=64, sample_steps=2)
    out.write_text(json.dumps(job))
    assert run.main([str(out)]) == 0
    records = [r for r in read_metrics(tmp_path / "output" / "shapes_lora" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]


def test_kohya_review_cases(tmp_path):
    """--family never overrides what the arguments say; the text encoders keep learning_rate when unet_lr is set;
    conv_alpha defaults to 1; reg_data_dir's folders are regularisation datasets; Lion is refused; FLUX samples take
    --g; spaced network_args are ignored as kohya ignores them."""
    from toolkit.config.importers.kohya import import_kohya

    (tmp_path / "train" / "10_shp").mkdir(parents=True)
    (tmp_path / "reg" / "1_person").mkdir(parents=True)
    base = {"pretrained_model_name_or_path": "sd-v1-5.safetensors", "network_module": "networks.lora",
            "train_data_dir": str(tmp_path / "train"), "reg_data_dir": str(tmp_path / "reg")}
    path = tmp_path / "a.toml"
    with pytest.raises(ImportRefused, match="--family sdxl, but the arguments are flux"):
        import_kohya({**base, "network_module": "networks.lora_flux"}, path, family="sdxl")
    job = import_kohya({**base, "unet_lr": 1e-4, "learning_rate": 1e-5,
                        "network_args": ["conv_dim=8", "rank_dropout = 0.1"]}, path).job["config"]["process"][0]
    assert job["train"]["lr"] == 1e-4 and job["train"]["text_encoder_lr"] == 1e-5
    assert job["network"]["conv"] == 8 and job["network"]["conv_alpha"] == 1.0 and "rank_dropout" not in job["network"]
    assert [d.get("is_reg", False) for d in job["datasets"]] == [False, True]
    assert job["datasets"][1]["default_caption"] == "person"
    with pytest.raises(ImportRefused, match="optimizer_type Lion"):
        import_kohya({**base, "use_lion_optimizer": True}, path)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat --g 3.5 --l 1.0\n")
    flux = import_kohya({**base, "network_module": "networks.lora_flux", "sample_prompts": str(prompts)}, path)
    assert flux.job["config"]["process"][0]["sample"]["guidance_scale"] == 3.5
