"""Tiny random models built offline and stored as normal diffusers folders.

Tests and the quickstart load them through the same code as real models. They are built once per
preset version under the difftune cache (`$DIFFTUNE_CACHE`, default `~/.cache/difftune`), written to a
temporary folder and renamed, so concurrent processes never see half a model.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import string
import tempfile
from collections.abc import Callable
from pathlib import Path

#: written last into a finished preset folder
COMPLETE_MARK = "difftune_tiny_preset.json"

#: the tiny 4-channel VAE of the Stable Diffusion presets (/8, as the real one)
TINY_SD_VAE = dict(
    in_channels=3,
    out_channels=3,
    block_out_channels=(16, 16, 32, 32),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    latent_channels=4,
    layers_per_block=1,
    norm_num_groups=8,
    sample_size=64,
)


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


def unigram_t5_tokenizer():
    """A T5 tokenizer over single characters and a few word starts (Unigram, like T5's sentencepiece model):
    any ASCII text tokenizes, `</s>` ends every prompt, `<pad>` pads; nothing is downloaded."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.printable if not c.isspace()]
    pieces += [("\u2581" + c, -2.5) for c in string.ascii_letters + string.digits]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def seeded(seed: int, build: Callable[[], object]):
    """`build()` with torch's CPU RNG seeded to `seed` and restored after: a tiny model's random weights are a function
    of its preset alone."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def ensure_tiny(name: str, preset: dict, build: Callable[[Path, dict], None]) -> Path:
    """The folder of tiny preset `name`, built by `build(folder, preset)` on first use. The build writes into
    a temporary folder that is renamed when complete, so a half-built model is never seen."""
    folder = _preset_folder(name, preset)
    if (folder / COMPLETE_MARK).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        build(tmp, copy.deepcopy(preset))  # a builder that changes its preset must not change this folder's name
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


