"""End to end on the tiny SD model: the real job path from a config file to a LoRA that diffusers loads."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import StableDiffusionPipeline
from helpers import held_out_loss, make_images, trainer_process, write_job
from safetensors import safe_open

from jobs.job import get_job
from toolkit.config.loader import load_config
from toolkit.config.schema import DatasetConfig
from toolkit.data.dataset import build_dataset, load_pixels
from toolkit.run.metrics import read_metrics

UPDATES = 60


@pytest.fixture(scope="module")
def trained(tmp_path_factory, registry, tiny_sd15):
    """One 60-update run of the quickstart shape (rank 4, alpha 8 so alpha/rank matters on load)."""
    tmp = tmp_path_factory.mktemp("e2e")
    process = trainer_process(
        tmp,
        network={"linear": 4, "linear_alpha": 8},
        train={"steps": UPDATES, "lr": 2e-3, "batch_size": 2},
        save={"save_every": 25, "max_step_saves_to_keep": 2, "dtype": "float32", "formats": ["diffusers"]},
        sample={"sample_every": 30, "prompts": ["[trigger], a red circle"], "sample_steps": 2,
                "width": 64, "height": 64},
    )
    config, path = load_config(str(write_job(tmp / "job.yaml", "e2e", process)), registry)
    job = get_job(config, path, registry)
    job.run()
    return job.processes[0], tmp / "output" / "e2e"


@pytest.mark.slow
def test_outputs_follow_the_documented_layout(trained):
    _, run_dir = trained
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "e2e.safetensors").is_file() and (run_dir / "e2e.diffusers.safetensors").is_file()
    # steps 25 and 50 saved by save_every, 60 at the end; two kept
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000000050", "step_000000060"]
    last = run_dir / "checkpoints" / "step_000000060"
    assert sorted(p.name for p in last.iterdir()) == [
        "lora.safetensors", "optimizer.pt", "rng_rank0.pt", "scheduler.pt", "train_state.json"]
    state = json.loads((last / "train_state.json").read_text())
    assert state["global_step"] == UPDATES and state["world_size"] == 1
    # 4 micro-batches per epoch: update 60 consumed all of epoch 14
    assert state["epoch"] == 14 and state["micro_batch_in_epoch"] == 4
    assert {"torch", "diffusers", "peft"} <= set(state["versions"]) and state["config_fingerprint"]
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == [
        "step_000000030_0.png", "step_000000060_0.png"
    ]


@pytest.mark.slow
def test_sampling_hands_the_model_back_in_training_mode(trained):
    process, _ = trained
    assert process.trained_module.training  # samples were rendered at steps 30 and 60


@pytest.mark.slow
def test_metrics_have_one_line_per_update(trained):
    _, run_dir = trained
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, UPDATES + 1))
    for record in records:
        assert {"step", "epoch", "loss", "lr", "grad_norm", "time"} <= set(record)
        assert record["lr"] == pytest.approx(2e-3)
    # 8 images, batch 2 -> 4 updates per epoch
    assert records[3]["epoch"] == 0 and records[4]["epoch"] == 1


@pytest.mark.slow
def test_lora_header_carries_config_and_peft_metadata(trained):
    _, run_dir = trained
    with safe_open(str(run_dir / "e2e.diffusers.safetensors"), "pt") as handle:
        meta = handle.metadata()
        keys = list(handle.keys())
    assert json.loads(meta["difftune_config"])["network"]["linear_alpha"] == 8
    assert meta["difftune_step"] == str(UPDATES)
    assert json.loads(meta["lora_adapter_metadata"])["unet.lora_alpha"] == 8
    assert keys and all(k.startswith("unet.") for k in keys)


@pytest.mark.slow
def test_model_learns_and_lora_loads_in_diffusers(trained, tiny_sd15):
    process, run_dir = trained
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    adapter = process.adapter
    dataset = build_dataset([DatasetConfig(folder_path=str(process.config.datasets[0].folder_path),
                                           resolution=[64])], "shp", adapter.divisor)
    square = [item for item in dataset.items if item.bucket == (64, 64)]
    pixels = torch.stack([load_pixels(item) for item in square])
    captions = [item.record.caption for item in square]

    def render():
        return pipe("shp, a red circle", num_inference_steps=2, width=64, height=64, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    before_loss = held_out_loss(adapter, pipe.unet, pixels, captions)
    before_image = render()
    pipe.load_lora_weights(str(run_dir), weight_name="e2e.safetensors")
    after_loss = held_out_loss(adapter, pipe.unet, pixels, captions)
    after_image = render()

    assert after_loss < before_loss * 0.95, (before_loss, after_loss)
    assert abs(after_image - before_image).max() > 1e-3

    # the file reproduces the trained model exactly (alpha / rank scaling survives the round trip)
    process.adapter.unet.eval()
    assert held_out_loss(adapter, process.adapter.unet, pixels, captions) == pytest.approx(after_loss, rel=1e-5)


@pytest.mark.slow
def test_accumulation_epochs_bf16_and_checkpointing(tmp_path, registry, tiny_sd15):
    """8 images, batch 2, accumulation 2: 4 micro-batches -> 2 updates per epoch; 2 epochs -> 4 updates."""
    process = trainer_process(
        tmp_path,
        train={"steps": None, "epochs": 2, "gradient_accumulation": 2, "dtype": "bf16",
               "gradient_checkpointing": True},
    )
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "accum", process)), registry)
    job = get_job(config, path, registry)
    job.run()
    records = read_metrics(tmp_path / "output" / "accum" / "metrics.jsonl")
    assert [(r["step"], r["epoch"]) for r in records] == [(1, 0), (2, 0), (3, 1), (4, 1)]
    trainer = job.processes[0]
    assert trainer.runtime.mixed_precision == "bf16"
    assert trainer.adapter.unet.is_gradient_checkpointing
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)


@pytest.mark.slow
def test_a_short_last_accumulation_window_gets_the_full_gradient(tmp_path, registry, tiny_sd15):
    """Two images, batch 2: one micro-batch per epoch. With accumulation 2 every update is a short window of
    one micro-batch, so training must match accumulation 1 exactly (same losses, norms and weights)."""
    data = make_images(tmp_path / "two", 2, size=(64, 64))
    runs = {}
    for accumulation in (1, 2):
        process = trainer_process(tmp_path, datasets=[{"folder_path": str(data), "resolution": [64]}],
                                  train={"steps": 3, "gradient_accumulation": accumulation})
        name = f"acc{accumulation}"
        config, path = load_config(str(write_job(tmp_path / f"{name}.yaml", name, process)), registry)
        get_job(config, path, registry).run()
        runs[accumulation] = read_metrics(tmp_path / "output" / name / "metrics.jsonl")
    strip = [[(r["loss"], r["grad_norm"]) for r in records] for records in runs.values()]
    assert strip[0] == strip[1]


@pytest.mark.slow
def test_max_grad_norm_clips_the_update(tmp_path, registry, tiny_sd15):
    """Adam barely moves weights whose gradients were clipped far below its eps; the logged norm is pre-clip."""
    moved = {}
    for max_norm in (0.0, 1e-12):
        process = trainer_process(tmp_path, train={"steps": 2, "max_grad_norm": max_norm})
        name = f"clip{max_norm}"
        config, path = load_config(str(write_job(tmp_path / f"{name}.yaml", name, process)), registry)
        job = get_job(config, path, registry)
        job.run()
        lora_up = [p for n, p in job.processes[0].adapter.unet.named_parameters() if "lora_B" in n]
        moved[max_norm] = max(p.abs().max().item() for p in lora_up)
        norms = [r["grad_norm"] for r in read_metrics(tmp_path / "output" / name / "metrics.jsonl")]
        assert norms[0] > 1e-6
    assert moved[1e-12] < moved[0.0] * 1e-3


@pytest.mark.slow
def test_another_objective_is_a_part_handed_in_not_a_subclass(tmp_path, tiny_sd15):
    """A process type registered as `partial(BaseSDTrainProcess, objective=...)` trains with that objective: its
    loss parts reach metrics.jsonl, and the rest of the run (checkpoints, the LoRA) is the same machinery."""
    from functools import partial

    from jobs.process.base_sd_train_process import BaseSDTrainProcess
    from jobs.registry import ProcessRegistry
    from toolkit.config.schema import SDTrainerConfig
    from toolkit.train.objective import DiffusionObjective

    class DoubledObjective(DiffusionObjective):
        def loss(self, batch, embeds, at):
            result = super().loss(batch, embeds, at)
            result.parts = {"loss_doubled": 2 * result.loss.detach()}
            result.loss = 2 * result.loss
            return result

    registry = ProcessRegistry()
    registry.register("sd_trainer", partial(BaseSDTrainProcess, objective=DoubledObjective), SDTrainerConfig)
    config, path = load_config(str(write_job(tmp_path / "job.yaml", "doubled", trainer_process(tmp_path))), registry)
    job = get_job(config, path, registry)
    job.run()
    assert isinstance(job.processes[0].objective, DoubledObjective)
    records = read_metrics(tmp_path / "output" / "doubled" / "metrics.jsonl")
    assert len(records) == 4 and all("loss_main" not in r for r in records)
    assert all(r["loss"] == pytest.approx(r["loss_doubled"]) and r["loss"] > 0 for r in records)
    assert (tmp_path / "output" / "doubled" / "doubled.safetensors").is_file()
