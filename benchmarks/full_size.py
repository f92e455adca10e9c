"""Full-size speed and memory on a CUDA machine: random-init models with the real architectures, trained for a
few dozen updates through difftune's real job path, so the figures compare with published ones.

    python -m benchmarks.full_size                          # SD 1.5 at 512 px; SDXL, Z-Image, FLUX.1, Qwen-Image
                                                            # (qfloat8, qint4, qint8; and bf16 sharded over the
                                                            # machine's GPUs) at 1024 px; Wan 2.1 1.3B at 480 px
                                                            # and Wan 2.2 TI2V-5B at 704 px, 33 frames
    python -m benchmarks.full_size --models qwen_image_qint8 qwen_image_fsdp   # sharding against quantizing
    python -m benchmarks.full_size --models wan22_a14b      # Wan 2.2 A14B's two experts (qfloat8, low_vram; ~57 GB
                                                            # of disk for the random model)
    python -m benchmarks.full_size --models zimage --updates 40 --json zimage.json
    python -m benchmarks.full_size --size tiny --device cpu # the same path on the tiny presets (a smoke test)

Per model it builds a diffusers folder on the device (random weights: no download, nothing to license), writes
a few synthetic images with captions, runs one job (latent and text-embedding caches, batch 1, LoRA, gradient
checkpointing, bf16, AdamW 8-bit; Z-Image, FLUX.1 and Qwen-Image with the transformer quantized) and prints:
- s/update: the median over metrics lines (one per `LOG_EVERY` updates, each the mean of its updates, so the
  loop runs as it does for users, reading values back only on logged updates) after the first line;
- peak accelerator memory while training (the peak counter is reset when the loop starts) and over the whole
  run (model load and caching included);
- wall seconds of each phase: building the random model, the job's set-up, the training loop, the final saves.

`qwen_image_fsdp` trains the same Qwen-Image in bf16 with `train.sharding: fsdp`, launched over every GPU of the
machine (one process each, as a user launches it); its memory figure is the largest of the GPUs' peaks. With one GPU
there is nothing to shard over: it prints the denoiser's weights per GPU for 2, 4 and 8 GPUs, computed from the
weight files and marked so.

Wan trains on generated clips (drifting colour fields) instead of images. Z-Image's, Qwen-Image's and Wan's text
encoders keep their real width (the transformer's caption input) but only a few
of their layers: they run only while the text embeddings are cached, so training figures do not depend on their
depth. Each model's folder is deleted once no later run uses it (Qwen-Image's takes about 41 GB of disk).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
LOG_EVERY = 5

from toolkit.models.wan.tiny import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, unipc_flow_scheduler  # noqa: E402

#: SD 1.5's UNet, VAE and CLIP ViT-L/14 text encoder (runwayml/stable-diffusion-v1-5 configs)
SD15_FULL = {
    "unet": dict(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
    ),
    "vae": dict(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32,
        block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512, scaling_factor=0.18215,
    ),
    "text_encoder": dict(
        hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
        max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu",
    ),
    "scheduler": dict(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        prediction_type="epsilon", clip_sample=False, steps_offset=1,
    ),
    "seed": 0,
}

#: SDXL base 1.0's UNet, VAE and text encoders (CLIP ViT-L/14 and OpenCLIP bigG, stabilityai/stable-diffusion-xl-base-1.0
#: configs)
SDXL_FULL = {
    "unet": dict(
        sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
        cross_attention_dim=2048, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816, norm_num_groups=32,
    ),
    "vae": dict(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32,
        block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, sample_size=1024, scaling_factor=0.13025, force_upcast=True,
    ),
    "text_encoder": dict(
        hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
        max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu",
    ),
    "text_encoder_2": dict(
        hidden_size=1280, intermediate_size=5120, num_attention_heads=20, num_hidden_layers=32,
        max_position_embeddings=77, projection_dim=1280, hidden_act="gelu",
    ),
    "scheduler": dict(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        prediction_type="epsilon", clip_sample=False, steps_offset=1, timestep_spacing="leading",
    ),
    "seed": 0,
}

#: FLUX.1 [dev]'s 11.9B transformer (black-forest-labs/FLUX.1-dev's config), CLIP ViT-L, the FLUX.1 VAE, and a
#: T5-XXL-wide encoder with 2 of its 24 layers (like Z-Image's text encoder: it runs only while caching)
FLUX_FULL = {
    "transformer": dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=[16, 56, 56],
    ),
    "text_encoder": dict(
        hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
        max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu",
    ),
    "text_encoder_2": dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64,
                           relative_attention_num_buckets=32, feed_forward_proj="gated-gelu"),
    "vae": dict(
        in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2, norm_num_groups=32,
        block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    ),
    "scheduler": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                  "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096},
    "seed": 0,
}

#: Z-Image's 6B transformer (diffusers' defaults are Tongyi-MAI/Z-Image's config), the Flux VAE, and a
#: Qwen3-4B-wide text encoder with 4 of its 36 layers (see the module docstring)
ZIMAGE_FULL = {
    "transformer": dict(
        all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
        n_heads=30, n_kv_heads=30, qk_norm=True, cap_feat_dim=2560, axes_dims=[32, 48, 48],
        axes_lens=[1536, 512, 512],
    ),
    "text_encoder": dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
    ),
    "vae": dict(
        in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2, norm_num_groups=32,
        block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    ),
    "scheduler": {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0},
    "seed": 0,
    "shared_seed": 0,
}


#: Qwen-Image's 20B transformer (diffusers' defaults are Qwen/Qwen-Image's config), its VAE (the class defaults are
#: the released config), a Qwen2.5-VL-7B-wide text encoder with 4 of its 28 layers and a one-block vision tower (see
#: the module docstring), and the released scheduler
QWEN_IMAGE_FULL = {
    "transformer": dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=3584, axes_dims_rope=[16, 56, 56],
    ),
    "text_encoder": {
        "text_config": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                            num_key_value_heads=4, max_position_embeddings=128000, rope_theta=1000000.0,
                            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        "vision_config": dict(depth=1, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                              fullatt_block_indexes=[0]),
    },
    "vae": dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]),
    "scheduler": {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                  "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                  "time_shift_type": "exponential"},
    "seed": 0,
}


def _wan_transformer(heads: int, ffn: int, layers: int, channels: int = 16) -> dict:
    """A Wan transformer's config (heads of 128 dims; UMT5-XXL's 4096-wide text input)."""
    return dict(patch_size=[1, 2, 2], num_attention_heads=heads, attention_head_dim=128, in_channels=channels,
                out_channels=channels, text_dim=4096, freq_dim=256, ffn_dim=ffn, num_layers=layers,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


#: UMT5-XXL's width with 2 of its 24 layers (it runs only while the text embeddings are cached, see the docstring)
_UMT5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_heads=64, num_layers=2, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, feed_forward_proj="gated-gelu")
#: the Wan 2.1 VAE (the class defaults are its released config)
_WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])

#: Wan 2.1 T2V 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers: 30 blocks of 1536), flow_shift 3
WAN21_1_3B_FULL = {"transformers": [_wan_transformer(12, 8960, 30)], "text_encoder": _UMT5_XXL, "vae": _WAN21_VAE,
                   "scheduler": unipc_flow_scheduler(3.0), "pipeline": {}, "seed": 0}
#: Wan 2.2 TI2V-5B (30 blocks of 3072 over the 48-channel VAE, per-token timesteps), flow_shift 5
WAN22_5B_FULL = {"transformers": [_wan_transformer(24, 14336, 30, channels=48)], "text_encoder": _UMT5_XXL,
                 "vae": dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                             temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                             out_channels=12, patch_size=2, scale_factor_spatial=16,
                             latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD),
                 "scheduler": unipc_flow_scheduler(5.0), "pipeline": {"expand_timesteps": True}, "seed": 0}
#: Wan 2.2 T2V A14B: two 14B experts (40 blocks of 5120) switching at 0.875, flow_shift 12
WAN22_A14B_FULL = {"transformers": [_wan_transformer(40, 13824, 40)] * 2, "text_encoder": _UMT5_XXL,
                   "vae": _WAN21_VAE, "scheduler": unipc_flow_scheduler(12.0), "pipeline": {"boundary_ratio": 0.875}, "seed": 0}


def presets(size: str) -> dict[str, dict]:
    """Per model: its preset, the builder, the training resolution and the model keys of the job."""
    from toolkit.models.flux.tiny import TINY_FLUX_DEV, build_flux
    from toolkit.models.flux_kontext.tiny import TINY_FLUX_KONTEXT, build_flux_kontext
    from toolkit.models.qwen_image.tiny import TINY_QWEN_IMAGE, build_qwen_image
    from toolkit.models.qwen_image_edit.tiny import TINY_QWEN_IMAGE_EDIT_2509, build_qwen_image_edit
    from toolkit.models.sd15.tiny import TINY_SD15, build_sd15
    from toolkit.models.sdxl.tiny import TINY_SDXL, build_sdxl
    from toolkit.models.wan.tiny import TINY_WAN21, TINY_WAN22_5B, TINY_WAN22_A14B, build_wan
    from toolkit.models.zimage.tiny import TINY_ZIMAGE, build_zimage

    full = size == "full"
    return {
        "sd15": {"preset": SD15_FULL if full else TINY_SD15, "build": build_sd15, "resolution": 512 if full else 64,
                 "model": {"arch": "sd15"}},
        "sdxl": {"preset": SDXL_FULL if full else TINY_SDXL, "build": build_sdxl, "resolution": 1024 if full else 64,
                 "model": {"arch": "sdxl"}},
        "zimage": {"preset": ZIMAGE_FULL if full else TINY_ZIMAGE, "build": build_zimage,
                   "resolution": 1024 if full else 64,
                   "model": {"arch": "zimage", "quantize": True, "qtype": "qfloat8"}},
        "flux": {"preset": FLUX_FULL if full else TINY_FLUX_DEV, "build": build_flux,
                 "resolution": 1024 if full else 64,
                 "model": {"arch": "flux", "quantize": True, "qtype": "qfloat8"}},
        # edit pairs: each target with a reference of its size, whose tokens double the transformer's sequence
        "flux_kontext": {"preset": FLUX_FULL if full else TINY_FLUX_KONTEXT, "build": build_flux_kontext,
                         "resolution": 1024 if full else 64, "references": True,
                         "model": {"arch": "flux_kontext", "quantize": True, "qtype": "qfloat8"}},
        # one random Qwen-Image folder (about 41 GB in bf16) serves both quantized runs
        "qwen_image": {"preset": QWEN_IMAGE_FULL if full else TINY_QWEN_IMAGE, "build": build_qwen_image,
                       "resolution": 1024 if full else 64, "folder": "qwen_image",
                       "model": {"arch": "qwen_image", "quantize": True, "qtype": "qfloat8"}},
        # Edit-2509 on pairs: the Qwen-Image model with a processor, one 1024 x 1024 reference per target
        "qwen_image_edit": {"preset": {**QWEN_IMAGE_FULL, "pipeline": "QwenImageEditPlusPipeline",
                                       "vision_tokens": TINY_QWEN_IMAGE_EDIT_2509["vision_tokens"]}
                            if full else TINY_QWEN_IMAGE_EDIT_2509, "build": build_qwen_image_edit,
                            "resolution": 1024 if full else 64, "references": True,
                            "model": {"arch": "qwen_image_edit", "quantize": True, "qtype": "qint4",
                                      **({} if full else {"reference_pixels": 4096})}},
        "qwen_image_qint4": {"preset": QWEN_IMAGE_FULL if full else TINY_QWEN_IMAGE, "build": build_qwen_image,
                             "resolution": 1024 if full else 64, "folder": "qwen_image",
                             "model": {"arch": "qwen_image", "quantize": True, "qtype": "qint4"}},
        # the same model in bf16, quantized to qint8 on one GPU against sharded over the machine's GPUs (FSDP)
        "qwen_image_qint8": {"preset": QWEN_IMAGE_FULL if full else TINY_QWEN_IMAGE, "build": build_qwen_image,
                             "resolution": 1024 if full else 64, "folder": "qwen_image",
                             "model": {"arch": "qwen_image", "quantize": True, "qtype": "qint8"}},
        "qwen_image_fsdp": {"preset": QWEN_IMAGE_FULL if full else TINY_QWEN_IMAGE, "build": build_qwen_image,
                            "resolution": 1024 if full else 64, "folder": "qwen_image", "sharded": True,
                            "blocks": "transformer_blocks", "model": {"arch": "qwen_image"}},
        # video: clips of 33 frames (9 latent frames)
        "wan21": {"preset": WAN21_1_3B_FULL if full else TINY_WAN21, "build": build_wan,
                  "resolution": 480 if full else 32, "frames": 33 if full else 5, "model": {"arch": "wan"}},
        "wan22_5b": {"preset": WAN22_5B_FULL if full else TINY_WAN22_5B, "build": build_wan,
                     "resolution": 704 if full else 64, "frames": 33 if full else 5,
                     "model": {"arch": "wan", "quantize": True, "qtype": "qfloat8"}},
        # not in the default list: two 14B experts take about 57 GB of disk in bf16
        "wan22_a14b": {"preset": WAN22_A14B_FULL if full else TINY_WAN22_A14B, "build": build_wan,
                       "resolution": 480 if full else 32, "frames": 33 if full else 5,
                       "model": {"arch": "wan", "quantize": True, "qtype": "qfloat8", "low_vram": True}},
    }


@contextmanager
def built_on(device: str):
    """Modules created inside are created on `device` (bf16 on CUDA): a 6B model initialises in seconds there
    instead of minutes on the host, and is written in the dtype it trains in."""
    import torch

    dtype = torch.get_default_dtype()
    if device == "cuda":
        torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(dtype)


def write_images(folder: Path, count: int, size: int, seed: int = 0) -> None:
    """Smooth random colour fields with captions (what they look like does not change the speed)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for index in range(count):
        coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(coarse).resize((size, size), Image.BICUBIC).save(folder / f"img_{index:02d}.png")
        (folder / f"img_{index:02d}.txt").write_text(f"a photo of shp number {index}, colourful blur")


def write_clips(folder: Path, count: int, size: int, frames: int) -> None:
    """Smooth random colour fields drifting across the frame, as H.264 clips with captions."""
    import numpy as np
    from PIL import Image

    from toolkit.run.video import write_video

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        field = np.asarray(Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize(
            (2 * size, size), Image.BICUBIC))
        video = np.stack([field[:, k * size // (2 * frames):][:, :size] for k in range(frames)])
        write_video(folder / f"clip_{index:02d}", np.ascontiguousarray(video), 16.0, {})
        (folder / f"clip_{index:02d}.txt").write_text(f"a video of shp number {index}, drifting colours")


def job_file(folder: Path, name: str, model_path: Path, spec: dict, args) -> Path:
    import yaml

    cuda = args.device == "cuda"
    process = {
        "type": "sd_trainer", "training_folder": str(folder / "output"), "device": args.device,
        "trigger_word": "shp",
        "network": {"linear": args.rank, "linear_alpha": args.rank},
        "save": {"save_every": 0, "formats": ["diffusers"]},
        "datasets": [{"folder_path": str(folder / "data"), "resolution": [spec["resolution"]],
                      "cache_latents": True, "cache_dir": str(folder / "cache"),
                      **({"num_frames": spec["frames"]} if "frames" in spec else {}),
                      **({"control_path": str(folder / "references")} if spec.get("references") else {})}],
        "train": {"batch_size": 1, "steps": args.updates, "lr": 1e-4, "dtype": "bf16" if cuda else "fp32",
                  # sharded parameters take torch's AdamW, not bitsandbytes' 8-bit one
                  "optimizer": "adamw8bit" if cuda and not spec.get("sharded") else "adamw",
                  "gradient_checkpointing": True,
                  "cache_text_embeddings": True, "compile": args.compile,
                  **({"sharding": "fsdp"} if spec.get("sharded") else {})},
        "model": {**spec["model"], "name_or_path": str(model_path), "dtype": "bf16" if cuda else "fp32"},
        "logging": {"log_every": LOG_EVERY},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": name, "process": [process]}}))
    return path


def run_job(path: Path) -> tuple[dict, object]:
    """Run the job; when the training loop started and ended, and the accelerator peaks before it and during it
    (the counter is reset when it starts) come back."""
    import torch

    from jobs.job import get_job
    from jobs.registry import build_registry
    from toolkit.config.loader import load_config

    registry = build_registry(REPO / "extensions")
    config, path = load_config(str(path), registry)
    job = get_job(config, path, registry)
    trainer = job.processes[0]
    loop: dict = {}
    train = trainer.train

    def measured_train():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            loop["peak_before_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        loop["started"] = time.perf_counter()
        train()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            loop["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        loop["ended"] = time.perf_counter()

    trainer.train = measured_train
    job.run()
    return loop, trainer


def measure_model(name: str, spec: dict, args, scratch: Path) -> dict:
    import torch

    from toolkit.run.metrics import read_metrics

    folder = scratch / name
    model = scratch / spec.get("folder", name) / "model"
    result: dict = {"resolution": spec["resolution"], "updates": args.updates, "rank": args.rank,
                    "size": args.size, "compile": args.compile, "frames": spec.get("frames", 1)}
    started = time.perf_counter()
    if not model.is_dir():  # another run may share this model (`folder`)
        with built_on(args.device):
            spec["build"](model, spec["preset"])
    result["build_s"] = time.perf_counter() - started
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the built model's memory goes back before the job measures its own
    if "frames" in spec:
        write_clips(folder / "data", args.images, spec["resolution"], spec["frames"])
    else:
        write_images(folder / "data", args.images, spec["resolution"])
    if spec.get("references"):  # other pictures of the same names: each target's reference
        write_images(folder / "references", args.images, spec["resolution"], seed=1)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if spec.get("sharded"):
        return result | measure_sharded(name, spec, args, folder, model)
    started = time.perf_counter()
    loop, trainer = run_job(job_file(folder, name, model, spec, args))
    ended = time.perf_counter()
    result["setup_s"] = loop["started"] - started
    result["loop_s"] = loop["ended"] - loop["started"]
    result["finish_s"] = ended - loop["ended"]
    records = read_metrics(folder / "output" / name / "metrics.jsonl")
    steady = [r["time"] for r in records[args.warmup:]] or [r["time"] for r in records]
    result["s_per_update"] = statistics.median(steady)
    result["loss_first_last"] = [records[0]["loss"], records[-1]["loss"]]
    result["trainable_params_m"] = sum(p.numel() for p in trainer.lora_params) / 1e6
    if torch.cuda.is_available():
        result["peak_training_gib"] = loop["peak_gib"]
        result["peak_overall_gib"] = max(loop["peak_before_gib"], torch.cuda.max_memory_allocated() / 2**30)
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def sharding_processes(device: str) -> int:
    """The processes a sharded job runs on: the machine's GPUs; on the CPU (the tiny smoke run) two."""
    import torch

    return torch.cuda.device_count() if device == "cuda" else 2


def measure_sharded(name: str, spec: dict, args, folder: Path, model: Path) -> dict:
    """The job sharded over the machine's GPUs (`train.sharding: fsdp`, one process per GPU, launched as a user would):
    s/update from its metrics, each GPU's peak memory from the processes (`--worker`). With one GPU there is nothing to
    shard over: the per-GPU figures for 2, 4 and 8 GPUs are computed from the weight files (the bf16 base over N, plus
    two of its largest blocks gathered: the one computing and the one prefetched) and marked so."""
    import os
    import subprocess

    from toolkit.run.metrics import read_metrics

    processes = sharding_processes(args.device)
    if processes < 2:
        return {"computed": computed_sharding(model, spec)}
    peaks = folder / "peaks"
    peaks.mkdir(parents=True, exist_ok=True)
    job = job_file(folder, name, model, spec, args)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               str(Path(__file__).resolve()), "--worker", str(job), "--peaks", str(peaks)]
    env = {**os.environ, "PYTHONPATH": str(REPO), **({"ACCELERATE_USE_CPU": "1"} if args.device == "cpu" else {})}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: the sharded launch failed:\n{done.stderr[-4000:]}")
    ranks = [json.loads(path.read_text()) for path in sorted(peaks.glob("rank*.json"))]
    records = read_metrics(folder / "output" / name / "metrics.jsonl")
    steady = [r["time"] for r in records[args.warmup:]] or [r["time"] for r in records]
    figures = {"processes": processes, "s_per_update": statistics.median(steady),
               "loss_first_last": [records[0]["loss"], records[-1]["loss"]], "setup_s": ranks[0]["setup_s"],
               "loop_s": ranks[0]["loop_s"], "finish_s": time.perf_counter() - started - ranks[0]["setup_s"]
               - ranks[0]["loop_s"], "trainable_params_m": ranks[0]["trainable_params_m"]}
    if "peak_gib" in ranks[0]:
        figures["peak_training_gib"] = max(r["peak_gib"] for r in ranks)
        figures["peak_overall_gib"] = max(max(r["peak_gib"], r["peak_before_gib"]) for r in ranks)
    return figures


def computed_sharding(model: Path, spec: dict) -> dict[int, float]:
    """{GPUs: GiB of denoiser weights per GPU} for 2, 4 and 8 GPUs: bf16 weights over N plus two of the largest blocks
    (gathered), from the weight files' shapes. Weights only: activations and the LoRA's optimizer state come on top."""
    from toolkit.models.common import subfolder_weight_files
    from safetensors import safe_open

    total, blocks = 0, {}
    for path in subfolder_weight_files(str(model), "transformer", None, None):
        with safe_open(str(path), "pt") as handle:
            for key in handle.keys():
                count = 1
                for dim in handle.get_slice(key).get_shape():
                    count *= dim
                total += count * 2
                if key.startswith(spec["blocks"] + "."):
                    block = ".".join(key.split(".")[:2])
                    blocks[block] = blocks.get(block, 0) + count * 2
    largest = max(blocks.values())
    return {gpus: (total / gpus + 2 * largest) / 2**30 for gpus in (2, 4, 8)}


def worker(job: Path, peaks: Path) -> int:
    """One process of a sharded launch: the job, and this process's figures in `peaks`/rank<R>.json."""
    import os

    started = time.perf_counter()
    loop, trainer = run_job(job)
    figures = {"setup_s": loop["started"] - started, "loop_s": loop["ended"] - loop["started"],
               "trainable_params_m": sum(p.numel() for p in trainer.lora_params) / 1e6}
    if "peak_gib" in loop:
        figures.update(peak_gib=loop["peak_gib"], peak_before_gib=loop["peak_before_gib"])
    (peaks / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(figures))
    return 0


def table(results: dict) -> str:
    lines = []
    for name, r in results["models"].items():
        if "computed" in r:
            lines.append(f"{name} {r['resolution']}px: one GPU, nothing to shard over; computed denoiser weights per "
                         "GPU (bf16 / N + two blocks): " + ", ".join(f"{gpus} GPUs {gib:.1f} GiB"
                                                                   for gpus, gib in r["computed"].items()))
            continue
        memory = (f", peak {r['peak_training_gib']:.2f} GiB training / {r['peak_overall_gib']:.2f} GiB overall"
                  + (" per GPU" if "processes" in r else "") if "peak_training_gib" in r else "")
        if "processes" in r:
            memory += f", sharded over {r['processes']} {'GPUs' if r.get('peak_training_gib') else 'processes'}"
        frames = f" x {r['frames']} frames" if r.get("frames", 1) > 1 else ""
        lines.append(f"{name} {r['resolution']}px{frames} rank {r['rank']}: {r['s_per_update']:.3f} s/update{memory}; "
                     f"build {r['build_s']:.0f} s, set-up {r['setup_s']:.0f} s, loop {r['loop_s']:.0f} s, saves {r['finish_s']:.0f} s "
                     f"({r['updates']} updates), loss {r['loss_first_last'][0]:.4f} -> {r['loss_first_last'][1]:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ["sd15", "sdxl", "zimage", "flux", "flux_kontext", "qwen_image", "qwen_image_edit", "qwen_image_qint4",
             "qwen_image_qint8", "qwen_image_fsdp",
             "wan21", "wan22_5b"]
    parser.add_argument("--models", nargs="+", default=names, choices=[*names, "wan22_a14b"])
    parser.add_argument("--size", default="full", choices=["full", "tiny"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=1,
                        help=f"metrics lines (of {LOG_EVERY} updates each) left out of the median")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="train.compile: true")
    parser.add_argument("--scratch", help="folder for models, images and runs (default: a temporary one)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON (after each model)")
    parser.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)  # one process of a sharded launch
    parser.add_argument("--peaks", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(Path(args.worker), Path(args.peaks))
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --size tiny --device cpu for a smoke run)")
    from benchmarks.run import machine

    results: dict = {"machine": machine(), "models": {}}
    specs = presets(args.size)
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        for index, name in enumerate(args.models):
            results["models"][name] = measure_model(name, specs[name], args, Path(scratch))
            # the big models take tens of GB of disk each: a model folder goes once no later run uses it
            later = {specs[n].get("folder", n) for n in args.models[index + 1:]}
            for folder in Path(scratch).iterdir():
                if folder.name not in later:
                    shutil.rmtree(folder, ignore_errors=True)
            print(table({"models": {name: results["models"][name]}}), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
