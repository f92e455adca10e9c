"""The tiny SDXL preset: a random UNet with `text_time` added conditioning in SDXL's block layout (no attention in
the first down and last up block), a VAE, CLIP-L-like and bigG-like text encoders (the second with a projection)
and byte-level tokenizers (the second padding with "!", as SDXL's does), saved as a diffusers folder."""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.models.tiny import TINY_SD_VAE, byte_level_clip_tokenizer, ensure_tiny

TEXT_1 = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=3,
              max_position_embeddings=77)
TEXT_2 = dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_hidden_layers=3,
              max_position_embeddings=77, projection_dim=32)
TIME_EMBED_DIM = 8

TINY_SDXL = {
    "unet": dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32, 32),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1, 2),
        attention_head_dim=(2, 4, 4),
        use_linear_projection=True,
        cross_attention_dim=TEXT_1["hidden_size"] + TEXT_2["hidden_size"],
        addition_embed_type="text_time",
        addition_time_embed_dim=TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=6 * TIME_EMBED_DIM + TEXT_2["projection_dim"],
        norm_num_groups=8,
    ),
    "vae": {**TINY_SD_VAE, "scaling_factor": 0.13025, "force_upcast": True},
    "text_encoder": TEXT_1,
    "text_encoder_2": TEXT_2,
    "scheduler": dict(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        prediction_type="epsilon", clip_sample=False, steps_offset=1, timestep_spacing="leading",
    ),
    "seed": 0,
}


def build_sdxl(folder: Path, preset: dict) -> None:
    """A random SDXL pipeline folder with the preset's sizes, created on the current default device and dtype."""
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = byte_level_clip_tokenizer(preset["text_encoder"]["max_position_embeddings"])
    tokenizer_2 = byte_level_clip_tokenizer(preset["text_encoder_2"]["max_position_embeddings"])
    tokenizer_2.pad_token = "!"

    def text_config(sizes: dict, tok) -> CLIPTextConfig:
        return CLIPTextConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, **sizes)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset["seed"])
        unet = UNet2DConditionModel(**preset["unet"])
        vae = AutoencoderKL(**preset["vae"])
        text_encoder = CLIPTextModel(text_config(preset["text_encoder"], tokenizer))
        text_encoder_2 = CLIPTextModelWithProjection(text_config(preset["text_encoder_2"], tokenizer_2))
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=DDPMScheduler(**preset["scheduler"]),
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def ensure_tiny_sdxl(preset: dict = TINY_SDXL) -> Path:
    """The folder of the tiny SDXL model, built on first use."""
    return ensure_tiny("sdxl", preset, build_sdxl)
