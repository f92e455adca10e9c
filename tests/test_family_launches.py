"""Two-process checks in one launch: the transformer families (FLUX.1 Kontext and Qwen-Image-Edit on edit pairs too,
and the Wuerstchen prior), SDXL with its text encoders trained, a LoKr with module dropout, bf16 runs of SD 1.5 and
FLUX.1 (qint8 base) and an fp16 run of SD 1.5, with samples. The job files run in turn in the same two processes
(gloo), so the launch's start-up (two interpreters importing torch, diffusers and transformers) is paid once rather
than once per job. Each job is its family's own test configuration; every process's trained weights are recorded at
the end, and must be the same on both."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import REPO, launch, trainer_process, write_job
from safetensors.torch import load_file
from test_flux_kontext_training import kontext_process
from test_flux_training import flux_process
from test_qwen_image_edit_training import edit_process
from test_qwen_image_training import qwen_process
from test_sdxl_training import sdxl_process
from test_text_encoder_lora import cosine_factor
from test_wan_training import wan_process
from test_wuerstchen import wuerstchen_process
from test_zimage_training import zimage_process

from toolkit.run.metrics import read_metrics


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_family_trains_on_two_processes(tmp_path, tiny_wuerstchen):
    """Per job: the planned updates with finite losses, the LR a function of the update index whatever the process
    count, the LoRA written and the same on both processes; quantized bases (Z-Image, Qwen-Image) in DDP; only the
    main process loads Z-Image's sample-only transformer; SDXL's text encoders train (outside DDP) and follow their
    own LR; Wan 2.2 A14B's experts train in turn (DDP leaves the idle expert's LoRA without a gradient)."""
    jobs = {
        # DDP over a quanto-quantized frozen base; only the main process renders samples, so only it loads (and
        # quantizes) the separate sampling transformer
        "zimage": zimage_process(tmp_path / "zimage", train={"steps": 4, "batch_size": 1, "cache_text_embeddings": True},
                                 sample={"prompts": ["a red circle"], "sample_steps": 1, "width": 64, "height": 64}),
        "flux": flux_process(tmp_path / "flux", "tiny-schnell", train={"steps": 3, "cache_text_embeddings": True,
                                                                       "lr_scheduler": "linear"}),
        # edit pairs split over the processes, each sample with its reference latent (cached, flips drawn)
        "flux_kontext": kontext_process(tmp_path / "flux_kontext", train={"steps": 3, "lr_scheduler": "linear",
                                                                          "cache_text_embeddings": True}),
        # the text encoder reads each pair's reference: text entries per caption and reference, shared out
        "qwen_image_edit": edit_process(tmp_path / "qwen_image_edit", train={"steps": 3, "lr_scheduler": "linear",
                                                                             "cache_text_embeddings": True}),
        "qwen_image": qwen_process(tmp_path / "qwen_image", model={"quantize": True, "qtype": "qint8"},
                                   train={"steps": 3, "cache_text_embeddings": True, "lr_scheduler": "linear"}),
        # 8 images, batch 1, 2 processes: 4 updates per epoch; 6 updates
        "wuerstchen": wuerstchen_process(tmp_path / "wuerstchen", train={"steps": 6, "batch_size": 1, "lr": 1e-3}),
        # Wan 2.2 A14B on clips and an image (a clip is one sample): the experts in turn, so each update leaves the
        # other expert's LoRA without a gradient in DDP
        # other expert's LoRA without a gradient in DDP: it must not move (weight decay would move it otherwise)
        "wan": wan_process(tmp_path / "wan", "tiny-wan2.2-a14b", model={"expert_switch_every": 2},
                           train={"steps": 4, "batch_size": 1, "lr_scheduler": "linear", "cache_text_embeddings": True,
                                  "optimizer_params": {"weight_decay": 0.1}},
                           save={"save_every": 1, "max_step_saves_to_keep": 4}),
        # one transformer (Wan 2.1) wrapped by DDP
        "wan21": wan_process(tmp_path / "wan21", train={"steps": 2, "batch_size": 1}),
    }
    # the text encoders are outside DDP (their gradients averaged by hand); the LR plan is one process's
    jobs["sdxl_te"] = sdxl_process(tmp_path / "sdxl_te", network={"linear": 4, "linear_alpha": 4,
                                                                  "train_text_encoder": True},
                                   train={"steps": 4, "gradient_accumulation": 2, "lr_scheduler": "cosine",
                                          "lr_warmup_steps": 1, "text_encoder_lr": 5e-4})
    # peft's LoKr skips a dropped module entirely, so its weights miss a gradient that step; DDP is told to expect it
    jobs["lokr"] = trainer_process(tmp_path / "lokr", network={"type": "lokr", "linear": 4, "linear_alpha": 4,
                                                                "module_dropout": 0.5},
                                   train={"steps": 4, "batch_size": 1})
    # what GPU users run: bf16 base and autocast, a UNet family and a DiT on a qint8 base, with samples at step 0 and
    # the end and the validation loss; and fp16 with its GradScaler (the same unscaled gradients on both processes)
    half = {"sample": {"prompts": ["a red circle"], "sample_steps": 1, "width": 64, "height": 64,
                       "sample_at_start": True}, "validation": {"split": 0.25, "every": 2}}
    jobs["sd15_bf16"] = trainer_process(tmp_path / "sd15_bf16", model={"arch": "sd15", "name_or_path": "tiny",
                                                                       "dtype": "bf16"},
                                        train={"steps": 3, "batch_size": 1, "dtype": "bf16"}, **half)
    jobs["sd15_fp16"] = trainer_process(tmp_path / "sd15_fp16", model={"arch": "sd15", "name_or_path": "tiny",
                                                                       "dtype": "fp16"},
                                        train={"steps": 3, "batch_size": 1, "dtype": "fp16"}, **half)
    jobs["flux_bf16"] = flux_process(tmp_path / "flux_bf16", "tiny-schnell",
                                     model={"dtype": "bf16", "quantize": True, "qtype": "qint8"},
                                     train={"steps": 3, "dtype": "bf16"}, **half)
    for name in ("flux", "flux_kontext", "qwen_image", "qwen_image_edit", "wan", "wan21", "sdxl_te"):
        jobs[name]["datasets"][0]["cache_latents"] = True
    jobs["flux_kontext"]["datasets"][0]["flip_x"] = True
    paths = [str(write_job(tmp_path / f"{name}.yaml", name, process)) for name, process in jobs.items()]
    loads, weights = tmp_path / "loads", tmp_path / "weights"
    loads.mkdir()
    weights.mkdir()
    # a plain multi-GPU launch line without ACCELERATE_USE_CPU: the jobs' `device: cpu` alone gives two CPU processes
    result = launch(paths[0], 2, tmp_path, extra_jobs=paths[1:], script=REPO / "tests" / "instrumented_run.py",
                    env={"DIFFTUNE_TEST_RECORD_MODEL_LOADS": str(loads), "DIFFTUNE_TEST_RECORD_LORA": str(weights)},
                    cpu_by_env=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("processes                            2") == len(jobs)
    state = json.loads((tmp_path / "lokr" / "output" / "lokr" / "checkpoints" / "step_000000004" /
                        "train_state.json").read_text())
    assert state["world_size"] == 2 and state["global_step"] == 4
    for name in jobs:  # DDP (and the hand-averaged text encoders) keep every process's weights the same
        first, second = (load_file(str(weights / f"{name}_rank{rank}.safetensors")) for rank in (0, 1))
        assert first and first.keys() == second.keys(), name
        assert all(torch.equal(first[key], second[key]) for key in first), name

    def records(name: str) -> list[dict]:
        run_dir = tmp_path / name / "output" / name
        assert list(run_dir.glob(f"{name}*.safetensors")), name
        found = read_metrics(run_dir / "metrics.jsonl")
        assert all(math.isfinite(r["loss"]) for r in found if "loss" in r), name
        return found

    recorded = {path.stem: json.loads(path.read_text()) for path in loads.iterdir()}
    assert recorded == {"rank0": {"sampling_models": True, "sampling_transformer": True},
                        "rank1": {"sampling_models": False, "sampling_transformer": False}}
    assert [r["step"] for r in records("zimage")] == [1, 2, 3, 4]
    for name in ("flux", "flux_kontext", "qwen_image", "qwen_image_edit"):
        assert [r["lr"] for r in records(name)] == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3]), name
    assert [r["step"] for r in records("wuerstchen")] == list(range(1, 7))
    factors = [cosine_factor(k, warmup=1, total=4) for k in range(4)]
    assert [r["lr"] for r in records("sdxl_te")] == pytest.approx([1e-3 * f for f in factors])
    assert [r["lr_text_encoder"] for r in records("sdxl_te")] == pytest.approx([5e-4 * f for f in factors])
    sdxl_te = load_file(str(weights / "sdxl_te_rank0.safetensors"))
    assert any(sdxl_te[k].abs().max() > 0 for k in sdxl_te if k.startswith("text_encoder") and "lora.up" in k)
    assert [r["step"] for r in records("lokr")] == [1, 2, 3, 4]
    wan_weights = load_file(str(weights / "wan_rank0.safetensors"))
    assert {key.split(".", 1)[0] for key in wan_weights} == {"high_noise", "low_noise"}
    checkpoints = tmp_path / "wan" / "output" / "wan" / "checkpoints"
    first, second = (load_file(str(checkpoints / f"step_00000000{s}" / "lora.safetensors")) for s in (1, 2))
    for expert, moved in (("high_noise", True), ("low_noise", False)):  # updates 1 and 2 train the high-noise one
        keys = [k for k in first if k.startswith(expert)]
        assert keys and any(not torch.equal(first[k], second[k]) for k in keys) == moved, expert
    assert [r["step"] for r in records("wan21")] == [1, 2]
    wan = tmp_path / "wan" / "output" / "wan"
    assert [r["lr"] for r in records("wan")] == pytest.approx([1e-3, 1e-3 * 3 / 4, 1e-3 / 2, 1e-3 / 4])
    assert all((wan / f"wan_{expert}.safetensors").is_file() for expert in ("high_noise", "low_noise"))
    assert np.isfinite([r["loss"] for r in records("qwen_image")]).all()
    for name in ("sd15_bf16", "sd15_fp16", "flux_bf16"):
        found = records(name)
        assert [r["step"] for r in found if "loss" in r] == [1, 2, 3], name
        assert all(math.isfinite(r["val_loss"]) for r in found if "val_loss" in r), name
        samples = tmp_path / name / "output" / name / "samples"
        assert sorted(p.name for p in samples.iterdir()) == ["step_000000000_0.png", "step_000000003_0.png"], name
