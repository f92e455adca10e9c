"""A tiny random Z-Image, built offline and saved as a normal diffusers ZImagePipeline folder.

Every part is the real class with small dimensions: ZImageTransformer2DModel, a Qwen3Model text encoder,
a byte-level Qwen2Tokenizer carrying a Qwen3-style chat template (the pipeline applies it to every prompt),
a 16-channel AutoencoderKL with Z-Image's shift/scaling factors, and Z-Image-Turbo's scheduler config.

`seed` seeds the transformer and `shared_seed` the text encoder and VAE, so the "turbo" preset is a second
transformer with other weights over the very same text encoder, tokenizer and VAE, like the real pair.
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.models.tiny import ensure_tiny, seeded

TINY_ZIMAGE = {
    "transformer": {
        "all_patch_size": [2],
        "all_f_patch_size": [1],
        "in_channels": 16,
        "dim": 32,
        "n_layers": 2,
        "n_refiner_layers": 1,
        "n_heads": 2,
        "n_kv_heads": 2,
        "qk_norm": True,
        "cap_feat_dim": 32,
        "axes_dims": [4, 6, 6],  # sum = head dim (32 / 2); the caption axis must exceed 512 + 32 positions
        "axes_lens": [1024, 64, 64],
    },
    "text_encoder": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 1024,
    },
    "vae": {
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": [16, 16, 32, 32],
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "latent_channels": 16,
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "sample_size": 64,
        # the values of Z-Image's (Flux's) VAE, so the latent convention is exercised with real numbers
        "scaling_factor": 0.3611,
        "shift_factor": 0.1159,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    },
    # Tongyi-MAI/Z-Image-Turbo's scheduler/scheduler_config.json
    "scheduler": {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0},
    "seed": 0,
    "shared_seed": 0,
}

#: the same model with another transformer (e.g. a separate sampling transformer in tests)
TINY_ZIMAGE_TURBO = {**TINY_ZIMAGE, "seed": 1}

#: Qwen3's chat template, reduced to what ZImagePipeline uses: plain messages, the generation prompt, and the
#: empty think block Qwen3 adds when `enable_thinking` is false (the pipeline passes true, so none)
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def byte_level_qwen_tokenizer():
    """A Qwen2Tokenizer over single bytes (no merges) with Qwen's special tokens and chat template: any text
    tokenizes, nothing is downloaded. `<|endoftext|>` pads, as in Qwen3."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def _tiny_transformer(config: dict):
    from diffusers import ZImageTransformer2DModel

    transformer = ZImageTransformer2DModel(**config)
    # Pad tokens fill caption and image sequences up to a multiple of 32; depending on the diffusers version
    # they start as torch.empty or zeros, so give them real random values that a test can see.
    with torch.no_grad():
        for token in (transformer.x_pad_token, transformer.cap_pad_token):
            token.normal_(std=0.5)
    return transformer


def _tiny_text_encoder(config: dict, tokenizer):
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **config))


def build_zimage(folder: Path, preset: dict) -> None:
    """A random Z-Image pipeline folder with the preset's sizes, created on the current default device and
    dtype (benchmarks/full_size.py builds the full-size one on the GPU)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline

    tokenizer = byte_level_qwen_tokenizer()
    text_encoder = seeded(preset["shared_seed"], lambda: _tiny_text_encoder(preset["text_encoder"], tokenizer))
    vae = seeded(preset["shared_seed"] + 1, lambda: AutoencoderKL(**preset["vae"]))
    transformer = seeded(preset["seed"], lambda: _tiny_transformer(preset["transformer"]))
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**preset["scheduler"]),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def ensure_tiny_zimage(preset: dict = TINY_ZIMAGE) -> Path:
    """The folder of the tiny Z-Image model, built on first use."""
    return ensure_tiny("zimage", preset, build_zimage)


def ensure_tiny_zimage_turbo(preset: dict = TINY_ZIMAGE_TURBO) -> Path:
    """The tiny model with a second transformer (other weights, same text encoder, tokenizer and VAE)."""
    return ensure_tiny("zimage", preset, build_zimage)
