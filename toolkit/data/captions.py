"""Caption text for a sample: the sidecar file (or the default), with the trigger word applied."""

from __future__ import annotations

import re
from pathlib import Path

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
