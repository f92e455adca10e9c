"""Caption text for a sample: the sidecar file (or the default), with the trigger word applied; and the views of
it that training sees (caption and token dropout, segment shuffling), drawn per epoch and sample."""

from __future__ import annotations

import re
from dataclasses import dataclass
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


def segment_ranges(text: str) -> list[tuple[int, int]]:
    """[start, stop) character ranges of the comma-separated segments of `text`, surrounding whitespace left out
    and empty segments skipped (what `split_segments` returns is these ranges' text)."""
    ranges, start = [], 0
    for part in text.split(","):
        stripped = part.strip()
        if stripped:
            first = start + len(part) - len(part.lstrip())
            ranges.append((first, first + len(stripped)))
        start += len(part) + 1
    return ranges


def split_segments(caption: str) -> list[str]:
    """The caption's comma-separated segments, stripped, empty ones skipped."""
    return [caption[start:stop] for start, stop in segment_ranges(caption)]


def join_segments(segments: list[str]) -> str:
    """Segments as one caption: joined by ", ", as every view of a caption is written."""
    return ", ".join(segments)


def canonical_caption(caption: str) -> str:
    """The caption as its whole view is written (`join_segments`): what a cached entry encodes, so that a cached view
    and a live one start from the same text whatever spacing or empty segments the caption file has."""
    return join_segments(split_segments(caption))


def trigger_segments(segments: list[str], trigger_word: str | None) -> set[int]:
    """Indices of the segments that hold the trigger word: those that an occurrence of it overlaps in the segments
    joined as a view writes them (`join_segments`). A trigger word with commas ("ohwx man, photo") is itself several
    segments (written as `canonical_caption` writes it), and each segment it spans holds it."""
    if not trigger_word:
        return set()
    wanted = canonical_caption(trigger_word) or trigger_word.strip()
    if not wanted:
        return set()
    text = join_segments(segments)
    ranges, start = [], 0
    for segment in segments:
        ranges.append((start, start + len(segment)))
        start += len(segment) + 2  # ", "
    held: set[int] = set()
    found = text.find(wanted)
    while found >= 0:
        stop = found + len(wanted)
        held.update(k for k, (first, end) in enumerate(ranges) if found < end and stop > first)
        found = text.find(wanted, found + 1)
    return held


@dataclass(frozen=True)
class CaptionView:
    """One training view of a caption: the blank prompt (caption dropout), or the caption's segments
    (indices into `split_segments(caption)`) in the order the view puts them."""

    blank: bool
    order: tuple[int, ...]


def plan_caption_view(
    segments: list[str],
    generator: torch.Generator,
    *,
    shuffle: bool = False,
    keep_tokens: int = 1,
    caption_dropout_rate: float = 0.0,
    token_dropout_rate: float = 0.0,
    trigger_word: str | None = None,
) -> CaptionView:
    """Draw one view of a caption's `segments` from `generator` (keyed by seed, epoch and sample). Both caption
    sources follow this plan: live captions join the segments it names, cached ones move the segments' token
    positions, so the two give the same token sequences.

    The draws, in this order: one for caption dropout (when `caption_dropout_rate` is set: the view is the blank
    prompt with that probability); one per segment after the first `keep_tokens` for token dropout (when
    `token_dropout_rate` is set: each is dropped with that probability); one permutation of the segments that may
    move (when shuffling and more than one may). The first `keep_tokens` segments stay in place, and so does a
    segment holding the trigger word: it is never dropped and keeps its slot among the kept segments while the
    others are shuffled around it. A trigger word with commas spans several segments: each of them holds it
    (`trigger_segments`), so the trigger word stays whole and where it was.
    """
    if caption_dropout_rate and torch.rand((), generator=generator).item() < caption_dropout_rate:
        return CaptionView(blank=True, order=())
    fixed = list(range(min(keep_tokens, len(segments))))
    rest = list(range(len(fixed), len(segments)))
    trigger = trigger_segments(segments, trigger_word)

    def holds_trigger(index: int) -> bool:
        return index in trigger

    if token_dropout_rate and rest:
        draws = torch.rand(len(rest), generator=generator).tolist()
        rest = [i for i, draw in zip(rest, draws) if draw >= token_dropout_rate or holds_trigger(i)]
    slots = [slot for slot, i in enumerate(rest) if not holds_trigger(i)]
    if shuffle and len(slots) > 1:
        moving = [rest[slot] for slot in slots]
        for slot, pick in zip(slots, torch.randperm(len(slots), generator=generator).tolist()):
            rest[slot] = moving[pick]
    return CaptionView(blank=False, order=tuple(fixed + rest))


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
    """One training view of a caption as text (`plan_caption_view`): `blank` when caption dropout hits it, else
    its kept comma-separated segments in the view's order (`join_segments`)."""
    segments = split_segments(caption)
    view = plan_caption_view(segments, generator, shuffle=shuffle, keep_tokens=keep_tokens,
                             caption_dropout_rate=caption_dropout_rate, token_dropout_rate=token_dropout_rate,
                             trigger_word=trigger_word)
    return blank if view.blank else join_segments([segments[i] for i in view.order])
