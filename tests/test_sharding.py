"""`train.sharding: fsdp` (toolkit/run/sharding.py): the denoiser and its LoRA sharded over the processes with FSDP2.

Two processes on gloo train the same updates as one process taking the same samples per update (its
`gradient_accumulation` is the process count): the same LR at every update, the same losses and validation losses,
and the same final LoRA, EMA and samples, within float tolerance (the sums of the gradients over processes are added in
another order). A sharded run resumes bit-identically after Ctrl-C, and on another process count (2 -> 3).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import run
from helpers import REPO, assert_same_training, launch, make_images, trainer_process, write_job
from toolkit.run.metrics import read_metrics

STEPS = 20
#: the LR changes at every update: warmup, then cosine
SCHEDULE = {"lr_scheduler": "cosine", "lr_warmup_steps": 4}
#: how close a sharded run comes to the one-process run, per dtype: both average the same two micro-batches' gradients
#: (one process by accumulating, two by FSDP2's reduce-scatter), so they agree to float rounding. Measured here
#: (torch 2.14.1, CPU): losses and validation losses equal, the LoRA and EMA equal in float32 and within 1.5e-8 in bf16
TOLERANCE = {"fp32": {"loss": 1e-6, "lora": 1e-6}, "bf16": {"loss": 1e-5, "lora": 1e-5}}


def sharded_process(tmp: Path, data: Path, model: dict, dtype: str, **train) -> dict:
    """A 20-update job on 8 images of one size in `data` (4 training: 2 batches, one per process, or one update's
    window on one process; 4 held out for the validation loss) with an EMA, samples at 10 and 20, and the diffusers
    form beside the primary one; `sharding: fsdp`."""
    return trainer_process(
        tmp, training_folder=str(tmp / "output"), model={**model, "dtype": dtype},
        datasets=[{"folder_path": str(data), "resolution": [64]}],
        train={"steps": STEPS, "batch_size": 2, "lr": 2e-3, "dtype": dtype, "sharding": "fsdp",
               "ema": {"decay": 0.9}, **SCHEDULE, **train},
        validation={"split": 0.5, "every": 5, "batch_size": 2, "timesteps": 2},
        sample={"prompts": ["shp a red circle"], "sample_every": 10, "sample_steps": 2, "width": 64, "height": 64},
        save={"save_every": 10, "formats": ["diffusers", "peft"], "max_step_saves_to_keep": 5},
    )


#: the two families of the equivalence checks: a UNet in float32 and a DiT in bf16 (with gradient checkpointing inside
#: the sharded blocks and the shards kept in host memory)
FAMILIES = {
    "unet": ({"arch": "sd15", "name_or_path": "tiny"}, "fp32", {}),
    "dit": ({"arch": "flux", "name_or_path": "tiny"}, "bf16", {"gradient_checkpointing": True,
                                                              "fsdp_cpu_offload": True}),
}


#: LoKr (peft's LyCORIS layers: their own parameter shapes, some too small to split evenly), sharded and under DDP in
#: the same launch, in float32 (measured: the same losses and gradient norms as DDP and one process; in bf16 the sharded
#: run's gradient norm parts from DDP's by about 3e-4 from the first update, LoRA's does not)
LOKR = ({"arch": "sd15", "name_or_path": "tiny"}, "fp32",
        # module dropout: a dropped module gets no gradient on one process while the other computes it
        {"network": {"type": "lokr", "linear": 4, "linear_alpha": 4, "module_dropout": 0.3}})


def lokr_process(tmp: Path, sharding: str) -> dict:
    """Batch 1 and `gradient_accumulation: 2`: each process's two micro-batches of an epoch make one update, the
    first without reducing its gradients (FSDP2's and DDP's no-sync)."""
    model, dtype, extra = LOKR
    process = sharded_process(tmp, tmp / "data", model, dtype, sharding=sharding, batch_size=1,
                              gradient_accumulation=2)
    return process | extra


def every_family(tmp: Path, sharding: str) -> dict[str, dict]:
    """Each other family's own test job (three or four updates, batch 1, float32), with `sharding` as given:
    Qwen-Image-Edit on its pairs, SDXL with its text encoders trained, Z-Image without its quantization and separate sampling model (both refused with
    sharding), Wan 2.2 A14B's two experts in turn. (bf16 runs sharded in FLUX.1's equivalence and in the exact resume, an SD 1.5 job; a UNet's bf16 backward
    sharded comes out a few units of bf16's last place away from the unsharded one's, which Adam's normalised steps
    carry on, so a UNet's bf16 runs are compared with themselves.)"""
    from test_qwen_image_edit_training import edit_process
    from test_qwen_image_training import qwen_process
    from test_sdxl_training import sdxl_process
    from test_wan_training import wan_process
    from test_wuerstchen import wuerstchen_process
    from test_zimage_training import zimage_process

    train = {"sharding": sharding, "steps": 3, "batch_size": 1}
    jobs = {
        # its two text encoders trained too (not sharded: their LoRA's gradients averaged by hand, clipped with the
        # sharded ones under one norm)
        "sdxl": sdxl_process(tmp / "sdxl", train={**train, "text_encoder_lr": 5e-4},
                             network={"linear": 4, "linear_alpha": 4, "train_text_encoder": True}),
        "zimage": zimage_process(tmp / "zimage", train={**train, "cache_text_embeddings": True}),
        "qwen_image": qwen_process(tmp / "qwen_image", train={**train, "cache_text_embeddings": True}),
        # edit pairs: each target's reference latents beside it in the sharded transformer, the text encoder reading
        # the references (FLUX.1 Kontext joins its references the same way to FLUX.1's sharded blocks)
        "qwen_image_edit": edit_process(tmp / "qwen_image_edit", train={**train, "cache_text_embeddings": True}),
        "wuerstchen": wuerstchen_process(tmp / "wuerstchen", train=train),
        "wan": wan_process(tmp / "wan", "tiny-wan2.2-a14b", model={"expert_switch_every": 1},
                           train={**train, "steps": 4, "cache_text_embeddings": True}),
        "wan21": wan_process(tmp / "wan21", train=train),
    }
    jobs["zimage"]["model"]["quantize"] = False
    jobs["zimage"]["model"].pop("sampling", None)
    return {f"{name}_{sharding}": process for name, process in jobs.items()}


#: the families of `every_family`, and how close their sharded run comes to DDP's
FAMILY_TOLERANCE = {"sdxl": 1e-5, "zimage": 1e-5, "qwen_image": 1e-5, "qwen_image_edit": 1e-5, "wuerstchen": 1e-5,
                    "wan": 1e-5, "wan21": 1e-5}


def resume_process(tmp: Path) -> dict:
    return sharded_process(tmp, tmp / "data", {"arch": "sd15", "name_or_path": "tiny"}, "bf16",
                           steps=8) | {"save": {"save_every": 2, "max_step_saves_to_keep": 5}}


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory, tiny_sd15):
    """One two-process launch: each family's job, then a job straight through and the same job interrupted after 3
    updates (last: the interrupt ends the launch), with `run.py --control` asking for a checkpoint after update 5 and
    samples after update 7 in each; a copy of the interrupted run; a second launch resumes it on two processes, a
    third the copy on three."""
    from toolkit.models.flux.tiny import ensure_tiny_flux

    ensure_tiny_flux()
    tmp = tmp_path_factory.mktemp("sharded")
    make_images(tmp / "data", 8, size=(64, 64))
    jobs = [write_job(tmp / f"{name}.yaml", name, sharded_process(tmp, tmp / "data", model, dtype, **train))
            for name, (model, dtype, train) in FAMILIES.items()]
    jobs += [write_job(tmp / f"lokr_{sharding}.yaml", f"lokr_{sharding}", lokr_process(tmp, sharding))
             for sharding in ("fsdp", "none")]
    jobs += [write_job(tmp / f"{name}.yaml", name, process) for sharding in ("fsdp", "none")
             for name, process in every_family(tmp / "families", sharding).items()]
    jobs += [write_job(tmp / "straight.yaml", "straight", resume_process(tmp)),
             write_job(tmp / "resumed.yaml", "resumed", resume_process(tmp))]
    first = launch(jobs[0], 2, cwd=tmp, script=REPO / "tests" / "instrumented_run.py",
                   env={"DIFFTUNE_TEST_INTERRUPT_AFTER": "3", "DIFFTUNE_TEST_INTERRUPT_JOB": "resumed",
                        "DIFFTUNE_TEST_CONTROL_AFTER": "5:save,7:sample"},
                   extra_jobs=[str(job) for job in jobs[1:]])
    (tmp / "first_launch.log").write_text(first.stderr)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "stopped at step 3" in first.stderr
    output = tmp / "output"
    shutil.copytree(output / "resumed", output / "three")
    second = launch(tmp / "resumed.yaml", 2, cwd=tmp)
    assert second.returncode == 0, second.stderr[-4000:]
    third = launch(write_job(tmp / "three.yaml", "three", resume_process(tmp)), 3, cwd=tmp)
    assert third.returncode == 0, third.stderr[-4000:]
    return tmp, first, third


def one_process_run(tmp: Path, data: Path, family: str) -> Path:
    """The family's job on one process, `gradient_accumulation: 2`: the same samples per update as two processes."""
    model, dtype, train = FAMILIES[family]
    process = sharded_process(tmp, data, model, dtype, **train, gradient_accumulation=2)
    assert run.main([str(write_job(tmp / f"{family}_one.yaml", family, process))]) == 0
    return tmp / "output" / family


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_sharded_processes_train_as_one_process(sharded_runs, tmp_path, family):
    """Per update the same step, epoch and LR (exactly) and loss (within the family's tolerance); the same validation
    losses, final LoRA and EMA (every form: primary, diffusers, peft) within it; the samples written once, by the main
    process, and close to one process's; the LoRA in diffusers' form loads in diffusers' own pipeline. The control
    requests acted on every process together: a checkpoint at 5, samples at 7."""
    launched, _, _ = sharded_runs
    sharded, one = launched / "output" / family, one_process_run(tmp_path, launched / "data", family)
    tolerance = TOLERANCE[FAMILIES[family][1]]
    ours, theirs = read_metrics(sharded / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
    assert [(r["step"], r["epoch"], r.get("lr")) for r in ours] == [(r["step"], r["epoch"], r.get("lr")) for r in theirs]
    assert len([r for r in ours if "loss" in r]) == STEPS
    for key in ("loss", "val_loss"):
        pairs = [(a[key], b[key]) for a, b in zip(ours, theirs) if key in a]
        assert pairs and len(pairs) == len([b for b in theirs if key in b])
        assert max(abs(a - b) for a, b in pairs) <= tolerance["loss"] * max(abs(b) for _, b in pairs), (key, pairs)
    for suffix in (".safetensors", ".diffusers.safetensors", ".ema.safetensors", ".ema.diffusers.safetensors"):
        a, b = load_file(str(sharded / f"{family}{suffix}")), load_file(str(one / f"{family}{suffix}"))
        assert max_difference(a, b) <= tolerance["lora"], suffix
    for peft in ("_peft", ".ema_peft"):
        a, b = (load_file(str(folder / f"{family}{peft}" / "adapter_model.safetensors")) for folder in (sharded, one))
        assert max_difference(a, b) <= tolerance["lora"], peft
    assert sorted(p.name for p in (sharded / "samples").iterdir()) == [
        "step_000000007_0.png", "step_000000010_0.png", "step_000000020_0.png"]
    assert (sharded / "checkpoints" / "step_000000005" / "train_state.json").is_file()
    for name in ("step_000000010_0.png", "step_000000020_0.png"):
        a, b = (np.asarray(Image.open(folder / "samples" / name), dtype=np.int16) for folder in (sharded, one))
        assert np.abs(a - b).mean() < 2.0, name
    assert_loads_in_diffusers(sharded / f"{family}.diffusers.safetensors", FAMILIES[family][0]["arch"])


def assert_loads_in_diffusers(path: Path, arch: str) -> None:
    from diffusers import FluxPipeline, StableDiffusionPipeline

    from toolkit.models.flux.tiny import ensure_tiny_flux
    from toolkit.models.sd15.tiny import ensure_tiny_sd15

    pipeline_class, source = {"sd15": (StableDiffusionPipeline, ensure_tiny_sd15),
                              "flux": (FluxPipeline, ensure_tiny_flux)}[arch]
    pipe = pipeline_class.from_pretrained(str(source()))
    pipe.load_lora_weights(str(path.parent), weight_name=path.name)
    denoiser = pipe.unet if arch == "sd15" else pipe.transformer
    loaded = {k: v for k, v in denoiser.state_dict().items() if "lora_B" in k}
    assert loaded and max(v.abs().max().item() for v in loaded.values()) > 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_sharded_lokr_trains_as_under_ddp(sharded_runs):
    """LoKr with module dropout (a dropped module gets no gradient on one process while the other computes one),
    accumulating two micro-batches per update: per update the same loss and LR as the same job under DDP, and the
    same final LoKr and EMA but for the modules every process dropped at once."""
    launched, _, _ = sharded_runs
    sharded, ddp = launched / "output" / "lokr_fsdp", launched / "output" / "lokr_none"
    ours, theirs = read_metrics(sharded / "metrics.jsonl"), read_metrics(ddp / "metrics.jsonl")
    assert [(r["step"], r.get("lr")) for r in ours] == [(r["step"], r.get("lr")) for r in theirs]
    assert len([r for r in ours if "loss" in r]) == STEPS
    pairs = [(a["loss"], b["loss"]) for a, b in zip(ours, theirs) if "loss" in a]
    assert max(abs(a - b) for a, b in pairs) <= 1e-5 * max(b for _, b in pairs), pairs
    for suffix in (".safetensors", ".ema.safetensors"):
        a, b = (load_file(str(folder / f"{folder.name}{suffix}")) for folder in (sharded, ddp))
        assert set(a) == set(b) and any("lokr" in k for k in a)
        # a module that every process dropped in an update: DDP leaves it without a gradient (AdamW skips it), FSDP2
        # reduces a zero one (AdamW's moments still move it); every other module's weights are DDP's (measured: 84 of 96)
        same = [k for k in a if (a[k].float() - b[k].float()).abs().max().item() <= 1e-5]
        assert len(same) >= 0.75 * len(a), (suffix, len(same), len(a))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", list(FAMILY_TOLERANCE))
def test_every_family_trains_sharded_as_under_ddp(sharded_runs, family):
    """Each family's own test job, sharded and under DDP in the same launch: the same steps and LRs, losses and final
    files (Wan 2.2 A14B: each expert's) within the family's tolerance."""
    launched, _, _ = sharded_runs
    sharded, ddp = (next((launched / "families" / family / "output").glob(f"{family}_{mode}"))
                    for mode in ("fsdp", "none"))
    ours, theirs = read_metrics(sharded / "metrics.jsonl"), read_metrics(ddp / "metrics.jsonl")
    assert [(r["step"], r.get("lr")) for r in ours] == [(r["step"], r.get("lr")) for r in theirs]
    assert [r["step"] for r in ours if "loss" in r] == list(range(1, len(ours) + 1))
    tolerance = FAMILY_TOLERANCE[family]
    pairs = [(a["loss"], b["loss"]) for a, b in zip(ours, theirs) if "loss" in a]
    assert max(abs(a - b) for a, b in pairs) <= tolerance * max(b for _, b in pairs), pairs
    files = sorted(p.name[len(sharded.name):] for p in sharded.glob(f"{sharded.name}*.safetensors"))
    assert files == sorted(p.name[len(ddp.name):] for p in ddp.glob(f"{ddp.name}*.safetensors")) and files
    for suffix in files:
        a, b = (load_file(str(folder / f"{folder.name}{suffix}")) for folder in (sharded, ddp))
        assert max_difference(a, b) <= tolerance, suffix


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_sharded_run_resumes_exactly_and_on_three_processes(sharded_runs):
    """Ctrl-C after 3 updates and the same command again: the same losses, LRs, validation losses and final files
    (EMA included) as the run straight through, bit for bit. The checkpoint holds one full LoRA and the full
    optimizer state (what an unsharded run writes), so the copy of the interrupted run continues on three processes:
    from step 3 to the end, with the straight run's LR at every update."""
    launched, first, third = sharded_runs
    output = launched / "output"
    assert_same_training(output / "straight", output / "resumed")
    checkpoint = output / "three" / "checkpoints" / "step_000000002"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "ema.safetensors", "lora.safetensors", "optimizer.pt", "rng_rank0.pt", "rng_rank1.pt", "scheduler.pt",
        "train_state.json"]
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    lora = load_file(str(checkpoint / "lora.safetensors"))
    assert sum(v.numel() for s in optimizer["state"].values() for k, v in s.items() if k == "exp_avg") == sum(
        v.numel() for k, v in lora.items() if "lora" in k)  # full moments, one per LoRA weight
    assert "written by 2 processes, this run has 3" in third.stderr
    straight = {r["step"]: r for r in read_metrics(output / "straight" / "metrics.jsonl")}
    three = [r for r in read_metrics(output / "three" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in three] == list(range(1, 9))
    assert [r["lr"] for r in three] == [straight[r["step"]]["lr"] for r in three]
    assert all(np.isfinite(r["loss"]) for r in three)
    state = json.loads((output / "three" / "checkpoints" / "step_000000008" / "train_state.json").read_text())
    assert state["world_size"] == 3 and state["global_step"] == 8
    assert (output / "three" / "three.safetensors").is_file()


@pytest.mark.parametrize("model, train, key", [
    ({"arch": "flux", "name_or_path": "tiny", "quantize": True}, {"sharding": "fsdp"}, "model.quantize"),
    ({"arch": "sd15", "name_or_path": "/models/sd15.safetensors"}, {"sharding": "fsdp"}, "model.name_or_path"),
    ({"arch": "sd15", "name_or_path": "tiny"}, {"fsdp_cpu_offload": True}, "train.fsdp_cpu_offload"),
    ({"arch": "sd15", "name_or_path": "tiny"}, {"sharding": "fsdp", "dtype": "fp16"}, "train.dtype"),
    ({"arch": "sd15", "name_or_path": "tiny"}, {"sharding": "fsdp", "optimizer": "adamw8bit"}, "train.optimizer"),
])
def test_what_cannot_be_sharded_is_refused_by_the_config_naming_both_keys(tmp_path, registry, model, train, key):
    """Before anything loads: quanto's weights cannot be sharded, a single file cannot be read row by row, the shards'
    host offload needs sharding, fp16's skipped updates would need every process to see every gradient, and
    bitsandbytes' 8-bit optimizers take no sharded tensors."""
    from test_config import problem_keys

    from toolkit.config.loader import ConfigError, load_config

    process = trainer_process(tmp_path, model=model, train={"steps": 2, **train})
    with pytest.raises(ConfigError) as error:
        load_config(str(write_job(tmp_path / "job.yaml", "j", process)), registry)
    assert key in problem_keys(error.value)
    lines = [line for line in str(error.value).splitlines() if line.strip().startswith(f"config.process[0].{key}:")]
    assert any("train.sharding: fsdp" in line for line in lines), lines


def test_a_lora_on_a_denoiser_built_empty_starts_as_on_the_loaded_one(tiny_sd15):
    """The denoiser built from its config on the meta device (what each sharded process fills) takes the LoRA with the
    same initial values, from the same random stream, as the loaded denoiser; its buffers are real and its weight files
    known."""
    from diffusers import UNet2DConditionModel

    from toolkit.config.sections import NetworkConfig
    from toolkit.device import WEIGHTS_ATTRIBUTE
    from toolkit.models.common import pretrained_denoiser
    from toolkit.network.lora import add_lora, lora_state_dict

    network, targets = NetworkConfig(linear=4, linear_alpha=4), ["to_q", "to_k", "to_v", "to_out.0"]
    states = []
    for empty in (False, True):
        unet = pretrained_denoiser(UNet2DConditionModel, str(tiny_sd15), "unet", torch.bfloat16, empty)
        unet.requires_grad_(False)
        torch.manual_seed(3)
        add_lora(unet, network, targets, device=torch.device("cpu"))
        states.append({k: v for k, v in unet.named_parameters() if v.requires_grad})
        if empty:
            assert all(p.device.type == "meta" for n, p in unet.named_parameters() if not p.requires_grad)
            assert all(b.device.type == "cpu" for b in unet.buffers())
            assert getattr(unet, WEIGHTS_ATTRIBUTE).location.keys() == UNet2DConditionModel.from_pretrained(
                str(tiny_sd15), subfolder="unet").state_dict().keys()
    loaded, empty = states
    assert loaded.keys() == empty.keys() and all(torch.equal(loaded[k], empty[k]) for k in loaded)
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in empty.values())


def denoisers_at_full_size() -> dict:
    """Each family's denoiser class and full-size config (Würstchen's prior at its published size: c 2048, depth 32)."""
    from diffusers import (
        FluxTransformer2DModel,
        QwenImageTransformer2DModel,
        UNet2DConditionModel,
        WanTransformer3DModel,
        ZImageTransformer2DModel,
    )
    from diffusers.pipelines.deprecated.wuerstchen import WuerstchenPrior

    from benchmarks import full_size as full

    return {
        "sd15": (UNet2DConditionModel, full.SD15_FULL["unet"]), "sdxl": (UNet2DConditionModel, full.SDXL_FULL["unet"]),
        "flux": (FluxTransformer2DModel, full.FLUX_FULL["transformer"]),
        "zimage": (ZImageTransformer2DModel, full.ZIMAGE_FULL["transformer"]),
        "qwen_image": (QwenImageTransformer2DModel, full.QWEN_IMAGE_FULL["transformer"]),
        "wan": (WanTransformer3DModel, full.WAN22_A14B_FULL["transformers"][0]),
        "wuerstchen": (WuerstchenPrior, {"c_in": 16, "c": 2048, "c_cond": 1280, "c_r": 64, "depth": 32, "nhead": 32}),
    }


@pytest.mark.parametrize("arch", ["sd15", "sdxl", "flux", "zimage", "qwen_image", "wan", "wuerstchen"])
def test_each_family_names_blocks_that_split_its_denoiser_finely(arch):
    """The family's `sharded_blocks` at full size (built on the meta device): the units hold all but a few percent of
    the denoiser (what stays outside is gathered for the whole forward), and none holds more than a seventh of it
    (a process gathers one unit at a time, and prefetches the next)."""
    from accelerate import init_empty_weights

    from toolkit.models.registry import get_adapter_class
    from toolkit.run.sharding import block_modules

    model_class, config = denoisers_at_full_size()[arch]
    with init_empty_weights():
        denoiser = model_class(**config)
    total = sum(p.numel() for p in denoiser.parameters())
    units = [sum(p.numel() for p in unit.parameters())
             for unit in block_modules(denoiser, get_adapter_class(arch).sharded_blocks)]
    assert len(units) >= 8
    assert total - sum(units) < 0.07 * total, (total, sum(units))
    assert max(units) < total / 7, (max(units), total)
