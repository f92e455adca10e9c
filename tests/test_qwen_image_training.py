"""Qwen-Image end to end on the tiny preset, through the real job path: a qint8 base read block by block with a
quantized text encoder and both caches, whose LoRA loads in QwenImagePipeline in both file forms; exact resume with
both caches (two processes on a quantized base: tests/test_family_launches.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from helpers import (
    assert_same_training,
    held_out_loss,
    held_out_without_and_with_lora,
    merge_sections,
    pipelines_with_lora,
    run_job,
    square_batch,
    straight_and_resumed,
    trainer_process,
    two_bucket_data,
)
from optimum.quanto import QModuleMixin
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from toolkit.run.metrics import read_metrics


def qwen_process(tmp_path, **overrides) -> dict:
    base = trainer_process(tmp_path, model={"arch": "qwen_image", "name_or_path": "tiny"},
                           datasets=[{"folder_path": str(two_bucket_data(tmp_path / "data", lambda i: "blob " + "very " * i + "round")), "resolution": [64]}],
                           train={"batch_size": 2, "steps": 4, "lr": 1e-3, "dtype": "fp32", "seed": 42,
                                  "timestep_type": "shift", "timestep_params": {"dynamic_shift": True}})
    return merge_sections(base, overrides)


def render(pipe) -> np.ndarray:
    return pipe("shp, a blob", num_inference_steps=2, true_cfg_scale=1.0, width=64, height=64, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


@pytest.mark.slow
def test_quantized_base_and_text_encoder_with_both_caches_and_its_lora_in_the_pipeline(tmp_path, registry, tiny_cache,
                                                                                     caplog):
    """24 GB settings in miniature (layer-by-layer qint8 transformer, qint8 text encoder, both caches, gradient
    checkpointing, low_vram, samples with true CFG, memory per phase): finite losses, the held-out loss falls, and
    the LoRA loads in QwenImagePipeline in both forms alike (1e-5), changing its output and lowering its held-out
    loss."""
    process = qwen_process(tmp_path, model={"quantize": True, "qtype": "qint8", "quantize_te": True,
                                            "qtype_te": "qint8", "low_vram": True}, logging={"debug_memory": True},
                           network={"linear": 4, "linear_alpha": 8},
                           train={"steps": 30, "lr": 3e-3, "cache_text_embeddings": True,
                                  "gradient_checkpointing": True},
                           save={"formats": ["diffusers"]},
                           sample={"prompts": ["shp, a blob"], "neg": "blurry", "width": 64, "height": 64,
                                   "sample_steps": 2})
    process["datasets"][0]["cache_latents"] = True
    with caplog.at_level(logging.INFO, logger="difftune"):
        trainer, run_dir = run_job(tmp_path, registry, "q", process)
    phases = [r.memory["label"] for r in caplog.records if hasattr(r, "memory")]
    assert phases[:2] == ["transformer load and quantization", "text encoder, VAE load"], phases
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == 30 and all(np.isfinite(r["loss"]) for r in records)
    adapter = trainer.adapter
    assert isinstance(adapter.transformer.get_submodule("transformer_blocks.0.attn.to_q").base_layer, QModuleMixin)
    assert any(isinstance(m, QModuleMixin) for m in adapter.text_encoder.modules())
    pixels, captions = square_batch(tmp_path / "data", adapter.divisor)
    before, after = held_out_without_and_with_lora(adapter, adapter.transformer, pixels, captions)
    assert after < before * 0.97, (before, after)
    text = Image.open(run_dir / "samples" / "step_000000030_0.png").text
    assert (text["pipeline"], text["true_cfg_scale"], text["negative_prompt"]) == ("QwenImagePipeline", "4.0", "blurry")
    assert "guidance_scale" not in text and text["max_sequence_length"] == "1024"

    with safe_open(str(run_dir / "q.safetensors"), "pt") as handle:
        keys, header = list(handle.keys()), handle.metadata()
    assert "diffusion_model.transformer_blocks.0.attn.add_q_proj.lora_down.weight" in keys
    assert "diffusion_model.transformer_blocks.0.txt_mlp.net.2.alpha" in keys
    assert all(k.startswith("diffusion_model.") for k in keys)
    assert header["modelspec.architecture"] == "qwen-image/lora" and header["ss_base_model_version"] == "qwen_image"
    pipes = pipelines_with_lora(QwenImagePipeline, adapter.source, run_dir, (None, "q.safetensors", "q.diffusers.safetensors"))
    base, primary, diffusers_form = (render(p) for p in pipes.values())
    assert abs(primary - base).max() > 1e-3 and abs(primary - diffusers_form).max() < 1e-5
    full_before = held_out_loss(adapter, pipes[None].transformer, pixels, captions)
    full_after = held_out_loss(adapter, pipes["q.safetensors"].transformer, pixels, captions)
    assert full_after < full_before * 0.97, (full_before, full_after)


@pytest.mark.slow
def test_ctrl_c_and_rerun_continue_exactly_with_both_caches(tmp_path, tiny_cache):
    """Cached text entries hold each caption's own tokens; batches of captions of different lengths are padded
    when put together, identically before and after the resume."""
    process = qwen_process(tmp_path, network={"linear": 4, "linear_alpha": 4, "dropout": 0.1},
                           train={"steps": 6, "gradient_accumulation": 2, "lr_scheduler": "linear",
                                  "cache_text_embeddings": True},
                           save={"save_every": 2, "max_step_saves_to_keep": 3})
    process["datasets"][0].update(cache_latents_to_disk=True, cache_dir=str(tmp_path / "cache"),
                                  caption_dropout_rate=0.2)
    assert_same_training(*straight_and_resumed(tmp_path, process))
    entry_lengths = {load_file(str(p))["embeds"].shape[0] for p in (tmp_path / "cache").rglob("*.safetensors")
                     if "embeds" in load_file(str(p))}
    assert len(entry_lengths) > 1  # entries keep their captions' own lengths
