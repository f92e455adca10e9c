"""FLUX.1 Kontext end to end on the tiny preset and the shipped edit pairs (a shape in one colour as the reference,
the same shape recoloured as the target), through the real job path: the held-out pairs' loss falls, a sample is
rendered from its reference (kept beside it for the report), the LoRA loads in FluxKontextPipeline and changes its
output for the same reference; caches on and off train alike; Ctrl-C and a rerun continue exactly (two processes:
tests/test_family_launches.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from helpers import REPO, assert_same_training, merge_sections, pipelines_with_lora, run_job, straight_and_resumed, \
    trainer_process
from PIL import Image
from safetensors import safe_open

from toolkit.run.metrics import read_metrics

PAIRS = REPO / "config" / "examples" / "edit_pairs"


def shipped_pairs(folder: Path) -> tuple[Path, Path]:
    """A copy of the shipped pairs (caches are written beside a dataset): the targets' and the references' folders."""
    shutil.copytree(PAIRS, folder, dirs_exist_ok=True)
    return folder / "targets", folder / "references"


def pairs_process(tmp_path: Path, model: dict, **overrides) -> dict:
    """An editing family's test job on a copy of the shipped pairs (64 px, batch 2, 4 updates, the dynamic shift)."""
    targets, references = shipped_pairs(tmp_path / "pairs")
    base = trainer_process(tmp_path, model=model,
                           datasets=[{"folder_path": str(targets), "control_path": str(references),
                                      "resolution": [64]}],
                           train={"batch_size": 2, "steps": 4, "lr": 1e-3, "dtype": "fp32", "seed": 42,
                                  "timestep_type": "shift", "timestep_params": {"dynamic_shift": True}})
    base["trigger_word"] = None
    return merge_sections(base, overrides)


def kontext_process(tmp_path: Path, **overrides) -> dict:
    return pairs_process(tmp_path, {"arch": "flux_kontext", "name_or_path": "tiny"}, **overrides)


def render(pipe, reference: Image.Image) -> np.ndarray:
    return pipe(prompt="make the circle red", image=reference, _auto_resize=False, max_area=64 * 64, width=64, height=64,
                num_inference_steps=2, guidance_scale=2.5, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


@pytest.mark.slow
def test_edit_pairs_train_render_from_their_reference_and_load_in_the_pipeline(tmp_path, registry, tiny_cache):
    """Held-out pairs (a split) lose loss; the sample at the end is rendered from its reference, which is kept in
    samples/ and recorded in the PNG; the LoRA, in FLUX.1's form under the Kontext model spec, loads in
    FluxKontextPipeline and changes its output for the same reference."""
    reference = PAIRS / "references" / "00_circle.png"
    process = kontext_process(tmp_path, network={"linear": 4, "linear_alpha": 8},
                              train={"steps": 24, "lr": 3e-3, "cache_text_embeddings": True},
                              validation={"split": 0.25, "every": 24, "timesteps": 4},
                              sample={"prompts": [{"prompt": "make the circle red", "references": [str(reference)]}],
                                      "width": 64, "height": 64, "sample_steps": 2})
    process["datasets"][0].update(cache_latents=True, flip_x=True)
    trainer, run_dir = run_job(tmp_path, registry, "k", process)
    losses = [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    assert len(losses) == 2 and losses[-1] < losses[0] * 0.97, losses
    sample = Image.open(run_dir / "samples" / "step_000000024_0.png")
    assert sample.size == (64, 64) and sample.text["pipeline"] == "FluxKontextPipeline"
    assert json.loads(sample.text["references"]) == [str(reference)] and sample.text["max_area"] == "4096"
    assert (run_dir / "samples" / "reference_0_0.png").read_bytes() == reference.read_bytes()
    with safe_open(str(run_dir / "k.safetensors"), "pt") as handle:
        keys, header = list(handle.keys()), handle.metadata()
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in keys
    assert header["modelspec.architecture"] == "flux-1-kontext-dev/lora"
    pipes = pipelines_with_lora(FluxKontextPipeline, trainer.adapter.source, run_dir, (None, "k.safetensors"))
    picture = Image.open(reference).convert("RGB").resize((64, 64))
    base, trained = (render(pipe, picture) for pipe in pipes.values())
    assert abs(trained - base).max() > 1e-3
    other = render(pipes["k.safetensors"], Image.new("RGB", (64, 64), (0, 0, 0)))
    assert abs(other - trained).max() > 1e-3  # the output follows the reference


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_cached_pairs_train_as_live_ones(tmp_path, registry, tiny_cache, cache):
    """The reference latents from the cache (kept in memory, or on disk per variant, flips drawn) give the losses
    live encoding gives."""
    process = kontext_process(tmp_path, train={"steps": 4})
    process["datasets"][0]["flip_x"] = True
    _, live = run_job(tmp_path, registry, "live", process)
    cached = merge_sections(process, {})
    cached["datasets"] = [dict(process["datasets"][0], **({"cache_latents": True} if cache == "memory" else
                                                          {"cache_latents_to_disk": True}))]
    _, again = run_job(tmp_path, registry, "cached", cached)
    first, second = read_metrics(live / "metrics.jsonl"), read_metrics(again / "metrics.jsonl")
    assert [r["loss"] for r in second] == pytest.approx([r["loss"] for r in first], rel=1e-4)
    if cache == "disk":
        entries = list((tmp_path / "pairs" / "targets" / "_difftune_cache" / "latents").glob("*.safetensors"))
        assert entries and all("reference_0" in safe_open(str(e), "pt").keys() for e in entries)


@pytest.mark.slow
def test_ctrl_c_and_rerun_continue_exactly_with_pairs_cached_per_variant(tmp_path, tiny_cache):
    process = kontext_process(tmp_path, network={"linear": 4, "linear_alpha": 4},
                              train={"steps": 6, "gradient_accumulation": 2, "lr_scheduler": "linear"},
                              save={"save_every": 2, "max_step_saves_to_keep": 3},
                              validation={"split": 0.25, "every": 2, "timesteps": 2})
    process["datasets"][0].update(cache_latents_to_disk=True, flip_x=True, random_crop=True)
    assert_same_training(*straight_and_resumed(tmp_path, process))
