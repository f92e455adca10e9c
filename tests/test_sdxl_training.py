"""SDXL end to end on the tiny preset, through the real job path: two aspect ratios, the LoRA loads in
StableDiffusionXLPipeline in both forms (which agree), v-prediction with zero terminal SNR, every optimizer,
exact resume with both caches (two processes: tests/test_text_encoder_lora.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLPipeline
from helpers import (
    assert_same_training,
    held_out_loss,
    make_image,
    merge_sections,
    straight_and_resumed,
    trainer_process,
    write_job,
)
from instrumented_run import control_after
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import run
from jobs.job import get_job
from toolkit.config.loader import load_config
from toolkit.config.schema import DatasetConfig
from toolkit.data.dataset import build_dataset, load_pixels
from toolkit.run.metrics import read_metrics

UPDATES = 40


def sdxl_data(folder):
    """Four square and four wide images (buckets 64x64 and 96x32 at resolution 64, divisor 32)."""
    if folder.exists():
        return folder
    for i in range(4):
        make_image(folder / f"square_{i}.png", (64, 64), color=(40 + 50 * i, 200 - 40 * i, 90), caption=f"blob {i}")
        make_image(folder / f"wide_{i}.png", (150, 50), color=(200, 30 + 50 * i, 40 * i), caption=f"stripe {i}")
    return folder


def sdxl_process(tmp_path, **overrides) -> dict:
    base = trainer_process(tmp_path, model={"arch": "sdxl", "name_or_path": "tiny"},
                           datasets=[{"folder_path": str(sdxl_data(tmp_path / "data")), "resolution": [64]}])
    return merge_sections(base, overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, registry, tiny_sdxl):
    tmp = tmp_path_factory.mktemp("sdxl")
    process = sdxl_process(
        tmp,
        network={"linear": 4, "linear_alpha": 8, "conv": 2, "conv_alpha": 2},
        train={"steps": UPDATES, "lr": 2e-3, "batch_size": 2, "min_snr_gamma": 5.0,
               "blank_prompt_preservation": True, "blank_prompt_probability": 0.5},
        save={"save_every": 20, "formats": ["diffusers"]},
        sample={"sample_every": 20, "prompts": ["shp, a blob"], "sample_steps": 2, "width": 64, "height": 64,
                "guidance_rescale": 0.5},
    )
    config, path = load_config(str(write_job(tmp / "job.yaml", "sdxl", process)), registry)
    job = get_job(config, path, registry)
    job.run()
    return job.processes[0], tmp / "output" / "sdxl"


def fresh_pipe(folder) -> StableDiffusionXLPipeline:
    pipe = StableDiffusionXLPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render(pipe) -> np.ndarray:
    return pipe("shp, a blob", num_inference_steps=2, width=64, height=64, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


@pytest.mark.slow
def test_two_aspect_ratios_train_with_finite_losses(trained):
    process, run_dir = trained
    assert {item.bucket for item in process.data.dataset.items} == {(64, 64), (96, 32)}
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == UPDATES and all(np.isfinite(r["loss"]) for r in records)
    assert any("loss_bpp" in r for r in records)
    samples = sorted((run_dir / "samples").glob("*.png"))
    assert [p.name for p in samples] == ["step_000000020_0.png", "step_000000040_0.png"]
    text = Image.open(samples[-1]).text
    assert text["pipeline"] == "StableDiffusionXLPipeline" and text["guidance_rescale"] == "0.5"


@pytest.mark.slow
def test_lora_lowers_the_held_out_loss_and_both_forms_load_alike_in_diffusers(trained, tiny_sdxl):
    """The kohya-form file (SGM names) and the diffusers-form file load in StableDiffusionXLPipeline, give the
    same images (1e-5), change them, and reproduce the trained model's predictions."""
    process, run_dir = trained
    adapter = process.adapter
    dataset = build_dataset([DatasetConfig(folder_path=str(run_dir.parents[1] / "data"), resolution=[64])], "shp",
                            adapter.divisor)
    square = [item for item in dataset.items if item.bucket == (64, 64)]
    pixels = torch.stack([load_pixels(item) for item in square])
    captions = [item.record.caption for item in square]

    base = fresh_pipe(tiny_sdxl)
    before_loss, before_image = held_out_loss(adapter, base.unet, pixels, captions), render(base)
    kohya = fresh_pipe(tiny_sdxl)
    kohya.load_lora_weights(str(run_dir), weight_name="sdxl.safetensors")
    ours = fresh_pipe(tiny_sdxl)
    ours.load_lora_weights(str(run_dir), weight_name="sdxl.diffusers.safetensors")
    after_loss = held_out_loss(adapter, kohya.unet, pixels, captions)
    kohya_image, ours_image = render(kohya), render(ours)

    assert after_loss < before_loss * 0.95, (before_loss, after_loss)
    assert abs(kohya_image - before_image).max() > 1e-3
    assert abs(kohya_image - ours_image).max() < 1e-5
    assert held_out_loss(adapter, ours.unet, pixels, captions) == pytest.approx(after_loss, rel=1e-5)
    adapter.unet.eval()
    assert held_out_loss(adapter, adapter.unet, pixels, captions) == pytest.approx(after_loss, rel=1e-5)


@pytest.mark.slow
def test_the_primary_file_is_kohyas_sdxl_form(trained):
    _, run_dir = trained
    with safe_open(str(run_dir / "sdxl.safetensors"), "pt") as handle:
        keys, header = list(handle.keys()), handle.metadata()
    assert all(key.startswith("lora_unet_") for key in keys)
    assert "lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert "lora_unet_output_blocks_0_0_in_layers_2.lora_up.weight" in keys  # LoCon on a resnet conv
    assert not any("down_blocks" in key or "up_blocks" in key for key in keys)
    assert header["ss_base_model_version"] == "sdxl_base_v1-0"
    assert header["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert header["ss_v_parameterization"] == "False" and header["difftune_arch"] == "sdxl"


@pytest.mark.slow
def test_convert_lora_writes_the_kohya_names_from_the_diffusers_file(trained, tiny_sdxl, tmp_path):
    _, run_dir = trained
    target = tmp_path / "converted.safetensors"
    assert run.main(["--convert-lora", str(run_dir / "sdxl.diffusers.safetensors"), str(target), "--to", "comfy",
                     "--model", str(tiny_sdxl)]) == 0
    converted, primary = load_file(str(target)), load_file(str(run_dir / "sdxl.safetensors"))
    assert converted.keys() == primary.keys()
    assert all(torch.allclose(converted[k].float(), primary[k].float(), atol=1e-6) for k in primary)


@pytest.mark.slow
def test_v_prediction_with_zero_terminal_snr_trains_and_samples(tmp_path, registry, tiny_sdxl):
    """Also a sigmoid timestep sampler, differential guidance, and a sample asked for through the control channel
    (`run.py --control RUN sample`, as from another terminal)."""
    process = sdxl_process(
        tmp_path, model={"prediction_type": "v_prediction"},
        train={"steps": 4, "zero_terminal_snr": True, "timestep_range": [0.5, 1.0], "timestep_type": "sigmoid",
               "differential_guidance_scale": 1.5},
        sample={"prompts": ["shp"], "sample_steps": 2, "width": 64, "height": 64, "guidance_rescale": 0.7})
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "vpred", process)), registry)
    job = get_job(config, path, registry)
    with control_after({2: ["sample"]}):
        job.run()
    trainer, run_dir = job.processes[0], tmp_path / "output" / "vpred"
    assert trainer.adapter.noise_schedule.prediction_type == "v_prediction"
    assert trainer.adapter.scheduler.alphas_cumprod[-1].item() == 0.0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert all(np.isfinite(r["loss"]) and "loss_diff_guidance" in r for r in records)
    assert (run_dir / "samples" / "step_000000002_0.png").is_file()  # the control request
    assert (run_dir / "report.html").is_file()
    header = safe_open(str(run_dir / "vpred.safetensors"), "pt").metadata()
    assert header["ss_v_parameterization"] == "True" and header["ss_zero_terminal_snr"] == "True"
    assert header["modelspec.prediction_type"] == "v"
    text = Image.open(run_dir / "samples" / "step_000000004_0.png").text
    scheduler = json.loads(text["scheduler_config"])
    assert scheduler["prediction_type"] == "v_prediction" and scheduler["rescale_betas_zero_snr"]
    assert scheduler["timestep_spacing"] == "trailing" and text["guidance_rescale"] == "0.7"


@pytest.mark.slow
@pytest.mark.parametrize("train", [
    {"optimizer": "adamw8bit", "lr": 3e-3},
    {"optimizer": "lion8bit", "lr": 3e-4},
    {"optimizer": "adafactor", "lr": 0, "optimizer_params": {"max_lr": 3e-3}},
])
def test_other_optimizers_train_sdxl(tmp_path, registry, tiny_sdxl, train):
    process = sdxl_process(tmp_path, train={"steps": 3, **train})
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "opt", process)), registry)
    job = get_job(config, path, registry)
    job.run()
    assert all(np.isfinite(r["loss"]) for r in read_metrics(tmp_path / "output" / "opt" / "metrics.jsonl"))
    weights = load_file(str(tmp_path / "output" / "opt" / "opt.safetensors"))
    assert any(key.endswith("lora_up.weight") and weights[key].abs().max() > 0 for key in weights)


def resume_process(tmp_path) -> dict:
    """Both caches on disk, two aspect ratios, token shuffling, caption dropout and LoRA dropouts."""
    process = sdxl_process(
        tmp_path, network={"linear": 4, "linear_alpha": 4, "dropout": 0.1, "rank_dropout": 0.1},
        train={"steps": 8, "gradient_accumulation": 2, "lr_scheduler": "linear", "cache_text_embeddings": True},
        save={"save_every": 2, "max_step_saves_to_keep": 3})
    process["datasets"][0].update(cache_latents_to_disk=True, cache_dir=str(tmp_path / "cache"),
                                  shuffle_tokens=True, caption_dropout_rate=0.2)
    return process


def per_update(run_dir) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["epoch"]) for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_ctrl_c_and_rerun_continue_exactly_with_both_caches(tmp_path, tiny_sdxl):
    process = resume_process(tmp_path)
    assert_same_training(*straight_and_resumed(tmp_path, process))
    assert any(p.name.endswith(".safetensors") for p in (tmp_path / "cache" / "latents").iterdir())
