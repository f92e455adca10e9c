"""The tiny SD 1.x preset: a random UNet, VAE and CLIP text encoder with a byte-level tokenizer, saved as a diffusers folder."""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.models.tiny import TINY_SD_VAE, byte_level_clip_tokenizer, ensure_tiny

TINY_SD15 = {
    "unet": dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=16,
    ),
    "vae": TINY_SD_VAE,
    "text_encoder": dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=77,
    ),
    "scheduler": dict(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        prediction_type="epsilon", clip_sample=False, steps_offset=1,
    ),
    "seed": 0,
}


def build_sd15(folder: Path, preset: dict) -> None:
    """A random SD 1.x pipeline folder with the preset's sizes (tiny here; benchmarks/full_size.py passes SD 1.5's
    own), created on the current default device and dtype."""
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = byte_level_clip_tokenizer(preset["text_encoder"]["max_position_embeddings"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset["seed"])
        unet = UNet2DConditionModel(**preset["unet"])
        vae = AutoencoderKL(**preset["vae"])
        text_config = CLIPTextConfig(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **preset["text_encoder"],
        )
        text_encoder = CLIPTextModel(text_config)
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDPMScheduler(**preset["scheduler"]),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def ensure_tiny_sd15(preset: dict = TINY_SD15) -> Path:
    """The folder of the tiny SD 1.x model, built on first use."""
    return ensure_tiny("sd15", preset, build_sd15)
