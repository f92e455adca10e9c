"""Qwen-Image-Edit end to end on the tiny presets and the shipped edit pairs, through the real job path: the held-out
pairs' loss falls (2509, both caches: text embeddings per instruction and reference as trained), a sample is rendered
from its reference, the LoRA loads in QwenImageEditPlusPipeline and changes its output for the same reference; the
first version trains too (QwenImageEditPipeline); caches on and off train alike; Ctrl-C and a rerun continue exactly
(two processes: tests/test_family_launches.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from helpers import assert_same_training, merge_sections, pipelines_with_lora, run_job, straight_and_resumed
from PIL import Image
from safetensors import safe_open
from test_flux_kontext_training import PAIRS, pairs_process

from toolkit.run.metrics import read_metrics


def edit_process(tmp_path: Path, name: str = "tiny-2509", **overrides) -> dict:
    """References of 64 x 64 pixels (the pipelines' 1024 x 1024 would be most of a CPU step)."""
    return pairs_process(tmp_path, {"arch": "qwen_image_edit", "name_or_path": name, "reference_pixels": 64 * 64},
                         **overrides)


def render(pipe, reference: Image.Image) -> np.ndarray:
    return pipe(image=[reference], prompt="make the circle red", width=64, height=64, num_inference_steps=2,
                true_cfg_scale=1.0, output_type="np", generator=torch.Generator().manual_seed(0)).images


@pytest.mark.slow
def test_edit_plus_pairs_train_render_from_their_reference_and_load_in_the_pipeline(tmp_path, registry, tiny_cache):
    """Held-out pairs lose loss with both caches (the text entries keyed by each instruction's references, mirrored
    as drawn); the sample is rendered from its reference through QwenImageEditPlusPipeline with true CFG; the LoRA,
    in Qwen-Image's form, loads in that pipeline and changes its output for the same reference."""
    reference = PAIRS / "references" / "00_circle.png"
    process = edit_process(tmp_path, network={"linear": 4, "linear_alpha": 8},
                           train={"steps": 24, "lr": 3e-3, "cache_text_embeddings": True},
                           validation={"split": 0.25, "every": 24, "timesteps": 4},
                           sample={"prompts": [{"prompt": "make the circle red", "references": [str(reference)]}],
                                   "width": 64, "height": 64, "sample_steps": 2})
    process["datasets"][0].update(cache_latents=True, flip_x=True, cache_dir=str(tmp_path / "cache"))
    trainer, run_dir = run_job(tmp_path, registry, "q", process)
    losses = [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    assert len(losses) == 2 and losses[-1] < losses[0] * 0.97, losses
    text_entries = list((tmp_path / "cache" / "text").glob("*.safetensors"))
    assert len(text_entries) == 2 * 6  # 6 training pairs, each unmirrored and mirrored
    sample = Image.open(run_dir / "samples" / "step_000000024_0.png")
    assert sample.text["pipeline"] == "QwenImageEditPlusPipeline" and sample.text["true_cfg_scale"] == "4.0"
    assert sample.text["negative_prompt"] == " " and json.loads(sample.text["references"]) == [str(reference)]
    with safe_open(str(run_dir / "q.safetensors"), "pt") as handle:
        keys, header = list(handle.keys()), handle.metadata()
    assert "diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight" in keys
    assert header["modelspec.architecture"] == "qwen-image-edit/lora"
    pipes = pipelines_with_lora(QwenImageEditPlusPipeline, trainer.adapter.source, run_dir, (None, "q.safetensors"))
    picture = Image.open(reference).convert("RGB")
    base, trained = (render(pipe, picture) for pipe in pipes.values())
    assert abs(trained - base).max() > 1e-3
    assert abs(render(pipes["q.safetensors"], Image.new("RGB", (96, 96))) - trained).max() > 1e-3


@pytest.mark.slow
def test_the_first_version_trains_on_pairs_and_its_lora_loads_in_its_pipeline(tmp_path, registry, tiny_cache):
    process = edit_process(tmp_path, "tiny", train={"steps": 3})
    trainer, run_dir = run_job(tmp_path, registry, "v1", process)
    assert trainer.adapter.version.name == "edit"
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3]
    pipe = pipelines_with_lora(QwenImageEditPipeline, trainer.adapter.source, run_dir, ("v1.safetensors",))
    image = pipe["v1.safetensors"](image=Image.open(PAIRS / "references" / "01_square.png").convert("RGB"),
                                   prompt="make the square green", width=32, height=32, num_inference_steps=2,
                                   true_cfg_scale=1.0, output_type="np").images
    assert np.isfinite(image).all()


@pytest.mark.slow
def test_cached_pairs_and_instructions_train_as_live_ones(tmp_path, registry, tiny_cache):
    """Latents and text embeddings from the caches (per variant, flips drawn; caption dropout's blank prompt read
    with each sample's references) give the losses live encoding gives."""
    process = edit_process(tmp_path, train={"steps": 4})
    process["datasets"][0].update(flip_x=True, caption_dropout_rate=0.3)
    _, live = run_job(tmp_path, registry, "live", process)
    cached = merge_sections(process, {"train": {"cache_text_embeddings": True}})
    cached["datasets"] = [dict(process["datasets"][0], cache_latents_to_disk=True)]
    _, again = run_job(tmp_path, registry, "cached", cached)
    first, second = read_metrics(live / "metrics.jsonl"), read_metrics(again / "metrics.jsonl")
    assert [r["loss"] for r in second] == pytest.approx([r["loss"] for r in first], rel=1e-4)


@pytest.mark.slow
def test_ctrl_c_and_rerun_continue_exactly_with_both_caches(tmp_path, tiny_cache):
    process = edit_process(tmp_path, "tiny-2511", network={"linear": 4, "linear_alpha": 4},
                           train={"steps": 6, "gradient_accumulation": 2, "lr_scheduler": "linear",
                                  "cache_text_embeddings": True, "ema": {"decay": 0.9}},
                           save={"save_every": 2, "max_step_saves_to_keep": 3},
                           validation={"split": 0.25, "every": 2, "timesteps": 2})
    process["datasets"][0].update(cache_latents_to_disk=True, flip_x=True, cache_dir=str(tmp_path / "cache"))
    assert_same_training(*straight_and_resumed(tmp_path, process))
