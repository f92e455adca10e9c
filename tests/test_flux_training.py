"""FLUX.1 end to end on the tiny presets, through the real job path: [dev] on a qint8 base with a quantized T5 and
both caches, [schnell] whose LoRA loads in FluxPipeline in both forms, exact resume (two processes:
tests/test_family_launches.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
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


def flux_process(tmp_path, name: str = "tiny", **overrides) -> dict:
    base = trainer_process(tmp_path, model={"arch": "flux", "name_or_path": name},
                           datasets=[{"folder_path": str(two_bucket_data(tmp_path / "data", lambda i: f"blob {i}")), "resolution": [64]}],
                           train={"batch_size": 2, "steps": 4, "lr": 1e-3, "dtype": "fp32", "seed": 42,
                                  "timestep_type": "shift", "timestep_params": {"dynamic_shift": name == "tiny"}})
    return merge_sections(base, overrides)


@pytest.mark.slow
def test_dev_on_a_qint8_base_with_quantized_t5_and_both_caches(tmp_path, registry, tiny_cache):
    """[dev] at 24 GB settings in miniature (gradient checkpointing and min-SNR too): the LoRA on the quantized
    transformer lowers the held-out loss."""
    process = flux_process(tmp_path, model={"quantize": True, "qtype": "qint8", "quantize_te": True,
                                            "qtype_te": "qint8"},
                           network={"linear": 4, "linear_alpha": 8},
                           train={"steps": 30, "lr": 3e-3, "cache_text_embeddings": True, "guidance_scale": 2.0,
                                  "gradient_checkpointing": True, "min_snr_gamma": 5.0},
                           sample={"prompts": ["shp, a blob"], "width": 64, "height": 64, "sample_steps": 2})
    process["datasets"][0]["cache_latents"] = True
    trainer, run_dir = run_job(tmp_path, registry, "dev", process)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == 30 and all(np.isfinite(r["loss"]) for r in records)
    adapter = trainer.adapter
    assert adapter.train_guidance_scale == 2.0  # train.guidance_scale reached the guidance embedding's input
    assert isinstance(adapter.transformer.get_submodule("transformer_blocks.0.attn.to_q").base_layer, QModuleMixin)
    assert any(isinstance(m, QModuleMixin) for m in adapter.text_encoder_2.modules())
    pixels, captions = square_batch(tmp_path / "data", adapter.divisor)
    before, after = held_out_without_and_with_lora(adapter, adapter.transformer, pixels, captions)
    assert after < before * 0.97, (before, after)
    text = Image.open(run_dir / "samples" / "step_000000030_0.png").text
    assert text["pipeline"] == "FluxPipeline" and text["guidance_scale"] == "3.5"


@pytest.fixture(scope="module")
def schnell_trained(tmp_path_factory, registry, tiny_cache):
    tmp = tmp_path_factory.mktemp("schnell")
    process = flux_process(tmp, "tiny-schnell", network={"linear": 4, "linear_alpha": 8},
                           train={"steps": 24, "lr": 3e-3}, save={"formats": ["diffusers"]},
                           sample={"prompts": ["shp, a blob"], "width": 64, "height": 64})
    return run_job(tmp, registry, "schnell", process)


def render(pipe) -> np.ndarray:
    return pipe("shp, a blob", num_inference_steps=2, guidance_scale=0.0, width=64, height=64, output_type="np",
                max_sequence_length=256, generator=torch.Generator().manual_seed(0)).images


@pytest.mark.slow
def test_schnell_lora_loads_in_flux_pipeline_in_both_forms(schnell_trained):
    """The primary file (`transformer.<path>.lora_A/B` + `.alpha`, no peft header) and the diffusers form load in
    FluxPipeline alike (1e-5), change its output, lower its held-out loss and reproduce the trained model."""
    trainer, run_dir = schnell_trained
    with safe_open(str(run_dir / "schnell.safetensors"), "pt") as handle:
        keys, header = list(handle.keys()), handle.metadata()
    assert "transformer.transformer_blocks.0.attn.add_q_proj.lora_A.weight" in keys
    assert "transformer.single_transformer_blocks.1.proj_out.alpha" in keys
    assert all(k.startswith("transformer.") for k in keys) and "lora_adapter_metadata" not in header
    assert header["modelspec.architecture"] == "flux-1-schnell/lora" and header["ss_base_model_version"] == "flux1"
    assert load_file(str(run_dir / "schnell.safetensors"))["transformer.transformer_blocks.0.attn.to_q.alpha"].dtype \
        == torch.float32

    adapter = trainer.adapter
    folder = adapter.source
    pixels, captions = square_batch(run_dir.parents[1] / "data", adapter.divisor)
    pipes = pipelines_with_lora(FluxPipeline, folder, run_dir, (None, "schnell.safetensors", "schnell.diffusers.safetensors"))
    base, primary, diffusers_form = (render(p) for p in pipes.values())
    assert abs(primary - base).max() > 1e-3 and abs(primary - diffusers_form).max() < 1e-5
    before = held_out_loss(adapter, pipes[None].transformer, pixels, captions)
    after = held_out_loss(adapter, pipes["schnell.safetensors"].transformer, pixels, captions)
    assert after < before * 0.97, (before, after)
    adapter.transformer.eval()
    assert held_out_loss(adapter, adapter.transformer, pixels, captions) == pytest.approx(after, rel=1e-5)
    text = Image.open(run_dir / "samples" / "step_000000024_0.png").text
    assert (text["num_inference_steps"], text["guidance_scale"]) == ("4", "0.0")  # [schnell]'s defaults
    assert text["max_sequence_length"] == "256"  # T5 runs unmasked: rendering again needs the same length


@pytest.mark.slow
def test_ctrl_c_and_rerun_continue_exactly_with_both_caches(tmp_path, tiny_cache):
    process = flux_process(tmp_path, network={"linear": 4, "linear_alpha": 4, "dropout": 0.1},
                           train={"steps": 6, "gradient_accumulation": 2, "lr_scheduler": "linear",
                                  "cache_text_embeddings": True},
                           save={"save_every": 2, "max_step_saves_to_keep": 3})
    process["datasets"][0].update(cache_latents_to_disk=True, cache_dir=str(tmp_path / "cache"),
                                  caption_dropout_rate=0.2)
    assert_same_training(*straight_and_resumed(tmp_path, process))
