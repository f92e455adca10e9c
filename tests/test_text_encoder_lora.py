"""LoRA on the text encoders too (`network.train_text_encoder`): its own LR in the same schedule, files that
diffusers and kohya-style loaders apply to the text encoders, exact resume, gradients averaged over processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from helpers import assert_same_training, straight_and_resumed, trainer_process, write_job
from safetensors import safe_open
from safetensors.torch import load_file
from test_sdxl_training import sdxl_process

import run
from jobs.job import get_job
from toolkit.config.loader import ConfigError, load_config
from toolkit.run.metrics import read_metrics

PROMPT = "shp, a blob"


@pytest.fixture(scope="module")
def te_trained(tmp_path_factory, registry, tiny_sdxl):
    tmp = tmp_path_factory.mktemp("sdxl_te")
    process = sdxl_process(
        tmp, network={"linear": 4, "linear_alpha": 8, "train_text_encoder": True},
        train={"steps": 12, "lr": 2e-3, "text_encoder_lr": 5e-4, "lr_scheduler": "cosine", "batch_size": 2},
        save={"save_every": 6, "formats": ["diffusers"]},
        sample={"sample_every": 6, "prompts": [PROMPT], "sample_steps": 2, "width": 64, "height": 64})
    process["datasets"][0]["caption_dropout_rate"] = 0.2
    config, path = load_config(str(write_job(tmp / "job.yaml", "te", process)), registry)
    job = get_job(config, path, registry)
    job.run()
    return job.processes[0], tmp / "output" / "te"


@pytest.mark.slow
def test_the_text_encoder_lr_follows_the_same_schedule(te_trained):
    _, run_dir = te_trained
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == 12 and all(np.isfinite(r["loss"]) for r in records)
    assert all(r["lr_text_encoder"] == pytest.approx(r["lr"] * 0.25, rel=1e-9) for r in records)
    assert records[-1]["lr"] < records[0]["lr"]  # cosine


@pytest.mark.slow
def test_both_files_carry_the_text_encoders_and_load_alike(te_trained, tiny_sdxl):
    """kohya names (`lora_te1_text_model_encoder_...`, `lora_te2_...`) and diffusers' (`text_encoder.`,
    `text_encoder_2.`): StableDiffusionXLPipeline applies both to its text encoders, with the same result as the
    trained model's own encoders."""
    trainer, run_dir = te_trained
    with safe_open(str(run_dir / "te.safetensors"), "pt") as handle:
        keys, header = list(handle.keys()), handle.metadata()
    assert "lora_te1_text_model_encoder_layers_0_self_attn_out_proj.lora_down.weight" in keys
    assert "lora_te2_text_model_encoder_layers_2_mlp_fc2.alpha" in keys
    assert any(k.startswith("lora_unet_input_blocks_") for k in keys)
    assert header["ss_text_encoder_lr"] == "0.0005" and header["ss_unet_lr"] == "0.002"
    diffusers_keys = load_file(str(run_dir / "te.diffusers.safetensors")).keys()
    # diffusers' names keep CLIP's `text_model.` level (transformers 5's CLIPTextModel lacks it; the loader strips it)
    assert "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_linear_layer.down.weight" in diffusers_keys
    assert any(k.startswith("text_encoder_2.text_model.encoder.layers.") for k in diffusers_keys)

    def embeds(pipe):
        embeds, _, pooled, _ = pipe.encode_prompt(PROMPT, device="cpu", do_classifier_free_guidance=False)
        return embeds, pooled

    pipes = {}
    for name in (None, "te.safetensors", "te.diffusers.safetensors"):
        pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
        if name:
            pipe.load_lora_weights(str(run_dir), weight_name=name)
        pipes[name] = pipe
    base, kohya, ours = (embeds(pipes[name]) for name in pipes)
    for module in (trainer.adapter.text_encoder, trainer.adapter.text_encoder_2):
        module.eval()
    with torch.no_grad():
        trained = trainer.adapter.encode_prompts([PROMPT])
    assert (kohya[0] - base[0]).abs().max() > 1e-3 and (kohya[1] - base[1]).abs().max() > 1e-3
    assert torch.allclose(kohya[0], ours[0], atol=1e-5) and torch.allclose(kohya[1], ours[1], atol=1e-5)
    assert torch.allclose(trained.embeds, kohya[0], atol=1e-5) and torch.allclose(trained.pooled, kohya[1], atol=1e-5)


@pytest.mark.slow
def test_convert_lora_keeps_the_text_encoders_both_ways(te_trained, tiny_sdxl, tmp_path):
    """diffusers -> kohya gives the trained kohya file; kohya -> diffusers (alphas folded) gives the same text
    embeddings in the pipeline; a peft folder, which holds one model, is refused by name."""
    _, run_dir = te_trained
    comfy, back = tmp_path / "comfy.safetensors", tmp_path / "back.safetensors"
    assert run.main(["--convert-lora", str(run_dir / "te.diffusers.safetensors"), str(comfy), "--to", "comfy",
                     "--model", str(tiny_sdxl)]) == 0
    converted, primary = load_file(str(comfy)), load_file(str(run_dir / "te.safetensors"))
    assert converted.keys() == primary.keys()
    assert all(torch.allclose(converted[k].float(), primary[k].float(), atol=1e-6) for k in primary)
    assert run.main(["--convert-lora", str(comfy), str(back), "--to", "diffusers", "--model", str(tiny_sdxl)]) == 0
    assert any(k.startswith("text_encoder_2.") for k in load_file(str(back)))

    def embeds(weight_name):
        pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl)
        folder = tmp_path if weight_name == back.name else run_dir
        pipe.load_lora_weights(str(folder), weight_name=weight_name)
        return pipe.encode_prompt(PROMPT, device="cpu", do_classifier_free_guidance=False)[2]

    assert torch.allclose(embeds(back.name), embeds("te.safetensors"), atol=1e-5)
    assert run.main(["--convert-lora", str(comfy), str(tmp_path / "peft"), "--to", "peft",
                     "--model", str(tiny_sdxl)]) == 2


@pytest.mark.slow
def test_ctrl_c_and_rerun_continue_exactly_with_the_text_encoders(tmp_path, tiny_sdxl):
    process = sdxl_process(
        tmp_path, network={"linear": 4, "linear_alpha": 4, "dropout": 0.1, "train_text_encoder": True},
        train={"steps": 6, "gradient_accumulation": 2, "lr_scheduler": "linear", "text_encoder_lr": 1e-3},
        save={"save_every": 2, "max_step_saves_to_keep": 3})
    process["datasets"][0].update(cache_latents_to_disk=True, cache_dir=str(tmp_path / "cache"),
                                  caption_dropout_rate=0.2, shuffle_tokens=True)
    straight, resumed = straight_and_resumed(tmp_path, process)
    assert_same_training(straight, resumed)
    assert any(k.startswith("lora_te2_") for k in load_file(str(straight / "straight.safetensors")))


def cosine_factor(step: int, warmup: int, total: int) -> float:
    """diffusers' cosine schedule with warmup at update `step` (what one process gives)."""
    from diffusers.optimization import get_cosine_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total)
    for _ in range(step):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


@pytest.mark.slow
def test_sd15_text_encoder_lora_loads_in_diffusers(tmp_path, registry, tiny_sd15):
    """SD 1.x: kohya's `lora_te_text_model_encoder_...` names, applied by StableDiffusionPipeline."""
    process = trainer_process(tmp_path, network={"linear": 4, "linear_alpha": 4, "train_text_encoder": True},
                              train={"steps": 4, "lr": 5e-3})
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "sd15te", process)), registry)
    get_job(config, path, registry).run()
    run_dir = tmp_path / "output" / "sd15te"
    keys = load_file(str(run_dir / "sd15te.safetensors")).keys()
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight" in keys

    def embeds(weight_name):
        pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15, safety_checker=None, requires_safety_checker=False)
        if weight_name:
            pipe.load_lora_weights(str(run_dir), weight_name=weight_name)
        return pipe.encode_prompt("shp", "cpu", 1, False)[0]

    assert (embeds("sd15te.safetensors") - embeds(None)).abs().max() > 1e-4


@pytest.mark.parametrize("network, train, save, message", [
    ({"train_text_encoder": True}, {"cache_text_embeddings": True}, {},
     "network.train_text_encoder: cannot go with train.cache_text_embeddings"),
    ({"train_text_encoder": True}, {"blank_prompt_preservation": True}, {},
     "network.train_text_encoder: cannot go with train.blank_prompt_preservation"),
    ({"train_text_encoder": True}, {}, {"formats": ["peft"]}, r"network.train_text_encoder: cannot go with save.formats: \[peft\]"),
    ({}, {"text_encoder_lr": 1e-5}, {}, "train.text_encoder_lr: applies only with network.train_text_encoder"),
    ({"train_text_encoder": True}, {"optimizer": "adafactor", "lr": 0, "text_encoder_lr": 1e-4}, {},
     "for the text encoders too, so `text_encoder_lr` would not apply"),
])
def test_combinations_a_trained_text_encoder_cannot_run_are_refused(tmp_path, registry, network, train, save,
                                                                    message):
    process = sdxl_process(tmp_path, network=network, train=train, save=save)
    with pytest.raises(ConfigError, match=message):
        load_config(str(write_job(tmp_path / "job.yaml", "x", process)), registry)


def test_families_without_text_encoder_lora_refuse_it(tmp_path, registry):
    process = trainer_process(tmp_path, model={"arch": "zimage", "name_or_path": "tiny"},
                              network={"train_text_encoder": True})
    with pytest.raises(ConfigError, match="network.train_text_encoder: the zimage family"):
        load_config(str(write_job(tmp_path / "job.yaml", "x", process)), registry)


def test_a_components_file_of_the_denoiser_alone_is_the_single_module_file(tmp_path):
    """Checkpoints written before text encoders could train hold `write_lora_file`'s output; with one component
    `write_components_file` writes exactly that (keys, tensors and header), so those checkpoints still resume."""
    from diffusers import UNet2DConditionModel

    from toolkit.config.sections import NetworkConfig
    from toolkit.models.base import LoraComponent
    from toolkit.network.lora import (
        add_lora,
        lora_state_dict,
        read_components_file,
        write_components_file,
        write_lora_file,
    )

    unet = UNet2DConditionModel(block_out_channels=(16, 32), norm_num_groups=8, cross_attention_dim=8,
                                attention_head_dim=4, layers_per_block=1, sample_size=8,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    add_lora(unet, NetworkConfig(linear=2, linear_alpha=4), ["to_q", "to_v"])
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    write_lora_file(old, lora_state_dict(unet, "unet", torch.float32), {"k": "v"}, unet, "unet")
    write_components_file(new, [LoraComponent(unet, "unet", "lora_unet")], torch.float32, {"k": "v"})
    ours, theirs = load_file(str(new)), load_file(str(old))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert safe_open(str(new), "pt").metadata() == safe_open(str(old), "pt").metadata()
    assert read_components_file(old, [LoraComponent(unet, "unet", "lora_unet")]).keys() == theirs.keys()
