"""Caption text for a sample: the sidecar file (or the default), with the trigger word applied."""

from __future__ import annotations

import re
from pathlib import Path

import torch

TRIGGER_TAG = "[trigger]"


def read_caption(image_path: Path, caption_ext: str, default_caption: str) -> str:
    """The text of `<image stem>.<caption_ext>` next to the image, or `default_caption` when absent."""
    sidecar = image_path.with_suffix(f".{caption_ext}")
    if not sidecar.is_file():
        return default_caption
    try:
        text = sidecar.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"caption file {sidecar} is not UTF-8 text: {err}") from err
    return " ".join(text.split())


def _tidy(caption: str) -> str:
    """Collapse what removing a tag leaves behind: doubled commas and spaces."""
    caption = re.sub(r"\s*,\s*(,\s*)+", ", ", caption)
    caption = re.sub(r"\s+", " ", caption)
    return caption.strip(" ,")


def apply_trigger(caption: str, trigger_word: str | None, is_reg: bool) -> str:
    """Replace `[trigger]` with the trigger word, or prepend it when the caption lacks the tag.

    Regularisation captions never get the trigger; a `[trigger]` tag in them is removed.
    """
    if is_reg or not trigger_word:
        return _tidy(caption.replace(TRIGGER_TAG, "")) if TRIGGER_TAG in caption else caption
    if TRIGGER_TAG in caption:
        return caption.replace(TRIGGER_TAG, trigger_word)
    return f"{trigger_word}, {caption}" if caption else trigger_word


def split_segments(caption: str) -> list[str]:
    return [segment.strip() for segment in caption.split(",") if segment.strip()]


def process_caption(
    caption: str,
    generator: torch.Generator,
    *,
    shuffle: bool = False,
    keep_tokens: int = 1,
    caption_dropout_rate: float = 0.0,
    token_dropout_rate: float = 0.0,
    trigger_word: str | None = None,
    blank: str = "",
) -> str:
    """One training view of a caption, drawn from `generator` (keyed by seed, epoch and sample).

    - caption dropout: with `caption_dropout_rate`, the whole caption becomes the blank prompt;
    - token dropout: each comma-separated segment after the first `keep_tokens` is dropped with
      `token_dropout_rate`;
    - shuffle: the segments after the first `keep_tokens` are shuffled.
    A segment holding the trigger word is never dropped.
    """
    if caption_dropout_rate and torch.rand((), generator=generator).item() < caption_dropout_rate:
        return blank
    segments = split_segments(caption)
    kept, rest = segments[:keep_tokens], segments[keep_tokens:]
    if token_dropout_rate and rest:
        draws = torch.rand(len(rest), generator=generator).tolist()
        rest = [s for s, d in zip(rest, draws) if d >= token_dropout_rate or (trigger_word and trigger_word in s)]
    if shuffle and len(rest) > 1:
        rest = [rest[i] for i in torch.randperm(len(rest), generator=generator).tolist()]
    return ", ".join(kept + rest)
