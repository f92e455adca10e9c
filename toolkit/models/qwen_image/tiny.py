"""A tiny random Qwen-Image, built offline and saved as a normal diffusers QwenImagePipeline folder.

Every part is the real class with small dimensions: QwenImageTransformer2DModel over 2x2-packed 16-channel
latents, a Qwen2_5_VLForConditionalGeneration text encoder (with a one-block vision tower, as the class needs), a
byte-level BPE Qwen2Tokenizer whose merges make each word of QwenImagePipeline's prompt template one token (so the
template prefix is 34 tokens, as with the real tokenizer, and the pipeline's fixed drop of 34 removes exactly it),
an AutoencoderKLQwenImage with the released per-channel latent mean/std, and Qwen/Qwen-Image's scheduler config.
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.models.tiny import ensure_tiny, seeded

TINY_QWEN_IMAGE = {
    "transformer": {
        "patch_size": 2,
        "in_channels": 64,  # 16 latent channels x 2x2 packing
        "out_channels": 16,
        "num_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,  # the text encoder's width
        "axes_dims_rope": [4, 6, 6],  # sum = the head dim
    },
    "text_encoder": {
        "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "max_position_embeddings": 2048,
                        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},  # sum = head dim / 2
        "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                          "out_hidden_size": 32, "fullatt_block_indexes": [0]},
    },
    "vae": {"base_dim": 16, "z_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
            "temperal_downsample": [False, True, True]},  # /8, the released latents_mean / latents_std (defaults)
    # Qwen/Qwen-Image's scheduler/scheduler_config.json
    "scheduler": {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                  "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                  "time_shift_type": "exponential"},
    "seed": 0,
}

#: QwenImagePipeline's prompt template (its `prompt_template_encode`): the tiny tokenizer learns its words
TEMPLATE_TEXT = (("system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
                  "relationships of the objects and background:"), "user\n", "assistant\n")


def template_bpe_tokenizer(texts: tuple[str, ...] = TEMPLATE_TEXT, vision: tuple[str, ...] = ()):
    """A Qwen2Tokenizer over bytes plus BPE merges learned from the prompt templates' words (`texts`): any text
    tokenizes (unknown words byte by byte), the templates' words are one token each as with Qwen's own vocabulary,
    and `<|endoftext|>` pads, `<|im_start|>` / `<|im_end|>` are special, and so are the `vision` tokens (Qwen2.5-VL's,
    where the editing pipelines put images in their prompts). Nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1000, min_frequency=1, initial_alphabet=sorted(ByteLevel.alphabet()), show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    specials = ["<|im_start|>", "<|im_end|>", *vision]
    for special in ("<|endoftext|>", *specials):
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def _text_encoder(config: dict, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    special = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
               "bos_token_id": None, "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={**config["text_config"], **special}, vision_config=config["vision_config"]))


def build_qwen_image(folder: Path, preset: dict) -> None:
    """A random Qwen-Image pipeline folder with the preset's sizes, created on the current default device and dtype
    (benchmarks/full_size.py builds the full-size one on the GPU)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tokenizer = template_bpe_tokenizer()
    seed = preset["seed"]
    text_encoder = seeded(seed, lambda: _text_encoder(preset["text_encoder"], tokenizer))
    vae = seeded(seed + 1, lambda: AutoencoderKLQwenImage(**preset["vae"]))
    transformer = seeded(seed + 2, lambda: QwenImageTransformer2DModel(**preset["transformer"]))
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**preset["scheduler"]), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)


def ensure_tiny_qwen_image(preset: dict = TINY_QWEN_IMAGE) -> Path:
    """The folder of the tiny Qwen-Image model, built on first use."""
    return ensure_tiny("qwen_image", preset, build_qwen_image)
