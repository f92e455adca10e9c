"""Tiny random FLUX.1 presets, built offline and saved as normal diffusers FluxPipeline folders: [dev] (guidance
embedding, dynamic shift), [schnell] (no guidance embedding, fixed shift, as the released configs have them) and
Flex.1's shape (fewer double-stream blocks).

Every part is the real class with small dimensions: FluxTransformer2DModel over 2x2-packed 16-channel latents,
a CLIP text model (its pooled output is the transformer's pooled projection input), a T5 encoder with a small
sentencepiece-style (Unigram) tokenizer built in-process, and a 16-channel AutoencoderKL with the FLUX.1 VAE's
shift and scaling factors."""

from __future__ import annotations

from pathlib import Path

from toolkit.models.tiny import byte_level_clip_tokenizer, ensure_tiny, seeded, unigram_t5_tokenizer

TINY_FLUX_DEV = {
    "transformer": {
        "patch_size": 1,
        "in_channels": 64,  # 16 latent channels x 2x2 packing
        "num_layers": 1,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,  # T5's width
        "pooled_projection_dim": 32,  # CLIP's width
        "guidance_embeds": True,
        "axes_dims_rope": [4, 6, 6],  # sum = the head dim
    },
    "text_encoder": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                     "max_position_embeddings": 77},
    "text_encoder_2": {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
                       "relative_attention_num_buckets": 8, "feed_forward_proj": "gated-gelu"},
    "vae": {
        "in_channels": 3, "out_channels": 3, "block_out_channels": [16, 16, 32, 32],
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
        "latent_channels": 16, "layers_per_block": 1, "norm_num_groups": 8, "sample_size": 64,
        # the FLUX.1 VAE's values, so the latent convention is exercised with real numbers
        "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False,
    },
    # black-forest-labs/FLUX.1-dev's scheduler/scheduler_config.json
    "scheduler": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                  "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096},
    "seed": 0,
}

#: [schnell]: no guidance embedding; its released scheduler has a fixed shift of 1 and no dynamic shifting
TINY_FLUX_SCHNELL = {
    **TINY_FLUX_DEV,
    "transformer": {**TINY_FLUX_DEV["transformer"], "guidance_embeds": False},
    "scheduler": {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False},
}

#: Flex.1's shape: a guidance embedding and fewer than half as many double- as single-stream blocks (8 and 38)
TINY_FLEX = {**TINY_FLUX_DEV, "transformer": {**TINY_FLUX_DEV["transformer"], "num_single_layers": 3}}


def flux_parts(preset: dict) -> dict:
    """The parts of a random FLUX.1-layout pipeline with the preset's sizes, created on the current default device and
    dtype, by their pipeline argument names."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = byte_level_clip_tokenizer(preset["text_encoder"]["max_position_embeddings"])
    tokenizer_2 = unigram_t5_tokenizer()
    seed = preset["seed"]
    text_encoder = seeded(seed, lambda: CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **preset["text_encoder"])))
    text_encoder_2 = seeded(seed + 1, lambda: T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), pad_token_id=tokenizer_2.pad_token_id, eos_token_id=tokenizer_2.eos_token_id,
        decoder_start_token_id=tokenizer_2.pad_token_id, **preset["text_encoder_2"])))
    vae = seeded(seed + 2, lambda: AutoencoderKL(**preset["vae"]))
    transformer = seeded(seed + 3, lambda: FluxTransformer2DModel(**preset["transformer"]))
    return {"scheduler": FlowMatchEulerDiscreteScheduler(**preset["scheduler"]), "vae": vae,
            "text_encoder": text_encoder, "tokenizer": tokenizer, "text_encoder_2": text_encoder_2,
            "tokenizer_2": tokenizer_2, "transformer": transformer}


def build_flux(folder: Path, preset: dict) -> None:
    """A random FLUX.1 pipeline folder with the preset's sizes, created on the current default device and dtype
    (benchmarks/full_size.py builds the full-size one on the GPU)."""
    from diffusers import FluxPipeline

    FluxPipeline(**flux_parts(preset)).save_pretrained(folder, safe_serialization=True)


def ensure_tiny_flux(preset: dict = TINY_FLUX_DEV) -> Path:
    """The folder of the tiny FLUX.1 [dev] model, built on first use."""
    return ensure_tiny("flux", preset, build_flux)


def ensure_tiny_flux_schnell(preset: dict = TINY_FLUX_SCHNELL) -> Path:
    """The folder of the tiny FLUX.1 [schnell] model, built on first use."""
    return ensure_tiny("flux-schnell", preset, build_flux)


def ensure_tiny_flex(preset: dict = TINY_FLEX) -> Path:
    """The folder of the tiny Flex.1-shaped model, built on first use."""
    return ensure_tiny("flex", preset, build_flux)
