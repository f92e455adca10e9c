"""Tiny random models built offline and stored as normal diffusers folders.

Tests and the quickstart load them through the same code as real models. They are built once per
preset version under the difftune cache (`$DIFFTUNE_CACHE`, default `~/.cache/difftune`), written to a
temporary folder and renamed, so concurrent processes never see half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

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
    "vae": dict(
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 16, 32, 32),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=64,
    ),
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


#: written last into a finished preset folder
COMPLETE_MARK = "difftune_tiny_preset.json"


def cache_root() -> Path:
    return Path(os.environ.get("DIFFTUNE_CACHE", Path.home() / ".cache" / "difftune"))


def _preset_folder(name: str, preset: dict) -> Path:
    digest = hashlib.sha256(json.dumps(preset, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / "tiny" / f"{name}-{digest}"


def byte_level_clip_tokenizer(max_length: int = 77):
    """A CLIP tokenizer over single bytes (no merges): any text tokenizes, nothing is downloaded."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    symbols = sorted(ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for suffix in ("", "</w>"):
        for symbol in symbols:
            vocab[symbol + suffix] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = max_length
    return tokenizer


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


def ensure_tiny(name: str, preset: dict, build: Callable[[Path, dict], None]) -> Path:
    """The folder of tiny preset `name`, built by `build(folder, preset)` on first use. The build writes into
    a temporary folder that is renamed when complete, so a half-built model is never seen."""
    folder = _preset_folder(name, preset)
    if (folder / COMPLETE_MARK).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        build(tmp, preset)
        missing = [str(p.parent.relative_to(tmp)) for p in tmp.rglob("config.json")
                   if not any(p.parent.glob("*.safetensors"))]
        if missing:  # e.g. transformers skips writing on non-zero ranks of a distributed run
            raise RuntimeError(f"building the tiny model wrote no weights for: {', '.join(missing)}")
        (tmp / COMPLETE_MARK).write_text(json.dumps(preset, sort_keys=True))
        if folder.exists() and not (folder / COMPLETE_MARK).is_file():
            shutil.rmtree(folder)  # an unfinished build (or one from before the completion mark)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / COMPLETE_MARK).is_file():  # lost a race to an incomplete folder
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def ensure_tiny_sd15(preset: dict = TINY_SD15) -> Path:
    """The folder of the tiny SD 1.x model, built on first use."""
    return ensure_tiny("sd15", preset, build_sd15)
