"""Tiny random Wan models, built offline and saved as normal diffusers WanPipeline folders.

Every part is the real class with small dimensions: WanTransformer3DModel, a UMT5EncoderModel with a small
sentencepiece-style tokenizer, AutoencoderKLWan, and the released scheduler config (UniPC with flow sigmas). Three
presets, one per released layout:
- Wan 2.1 (T2V 1.3B / 14B): one transformer over the 16-channel VAE (/8 in space, /4 in time), flow_shift 3;
- Wan 2.2 TI2V-5B: one transformer over the 48-channel residual VAE (2x2 patchified pixels, /16 in space) with its
  released per-channel latent mean/std, per-token timesteps (`expand_timesteps`), flow_shift 5;
- Wan 2.2 A14B: two transformers (high noise: `transformer`, low noise: `transformer_2`) switching at
  `boundary_ratio` 0.875, over the 16-channel VAE, flow_shift 12.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.models.tiny import ensure_tiny, seeded, unigram_t5_tokenizer

#: Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: the 48 channels' latent mean and std
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891, 0.157,
    -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322,
    0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.052,
    0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165,
    0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917,
    0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06,
    0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]


def unipc_flow_scheduler(flow_shift: float) -> dict:
    """The released Wan schedulers' config (UniPC over flow sigmas), with the model's `flow_shift`."""
    return {"num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True,
            "flow_shift": flow_shift, "solver_order": 2, "predict_x0": True, "solver_type": "bh2",
            "lower_order_final": True, "final_sigmas_type": "zero"}


_TRANSFORMER = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 16,
                "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2,
                "rope_max_seq_len": 64}
_UMT5 = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
         "relative_attention_max_distance": 16}
_VAE21 = {"base_dim": 16, "z_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
          "temperal_downsample": [False, True, True]}  # /8 in space, /4 in time; the released 2.1 mean/std (defaults)

TINY_WAN21 = {"transformers": [_TRANSFORMER], "text_encoder": _UMT5, "vae": _VAE21,
              "scheduler": unipc_flow_scheduler(3.0), "pipeline": {}, "seed": 0}

TINY_WAN22_5B = {
    "transformers": [{**_TRANSFORMER, "in_channels": 48, "out_channels": 48}],
    "text_encoder": _UMT5,
    "vae": {"base_dim": 16, "decoder_base_dim": 24, "z_dim": 48, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
            "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12,
            "patch_size": 2, "scale_factor_spatial": 16, "latents_mean": WAN22_LATENTS_MEAN,
            "latents_std": WAN22_LATENTS_STD},
    "scheduler": unipc_flow_scheduler(5.0),
    "pipeline": {"expand_timesteps": True},
    "seed": 0,
}

TINY_WAN22_A14B = {"transformers": [_TRANSFORMER, _TRANSFORMER], "text_encoder": _UMT5, "vae": _VAE21,
                   "scheduler": unipc_flow_scheduler(12.0), "pipeline": {"boundary_ratio": 0.875}, "seed": 0}


def build_wan(folder: Path, preset: dict) -> None:
    """A random WanPipeline folder with the preset's sizes (one or two transformers), created on the current default
    device and dtype."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = unigram_t5_tokenizer()
    seed = preset["seed"]
    text_encoder = seeded(seed, lambda: UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id, **preset["text_encoder"])))
    vae = seeded(seed + 1, lambda: AutoencoderKLWan(**preset["vae"]))
    transformers = [seeded(seed + 2 + i, lambda c=config: WanTransformer3DModel(**c))
                    for i, config in enumerate(preset["transformers"])]
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=UniPCMultistepScheduler(**preset["scheduler"]), transformer=transformers[0],
                       transformer_2=transformers[1] if len(transformers) > 1 else None, **preset["pipeline"])
    pipe.save_pretrained(folder, safe_serialization=True)


def ensure_tiny_wan21(preset: dict = TINY_WAN21) -> Path:
    return ensure_tiny("wan21", preset, build_wan)


def ensure_tiny_wan22_5b(preset: dict = TINY_WAN22_5B) -> Path:
    return ensure_tiny("wan22_5b", preset, build_wan)


def ensure_tiny_wan22_a14b(preset: dict = TINY_WAN22_A14B) -> Path:
    return ensure_tiny("wan22_a14b", preset, build_wan)
