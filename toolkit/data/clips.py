"""Reading video clips for training: how many frames a clip has and at what rate, which of its frames a training
sample takes (a count at a frame rate, from the start; a short clip refused or looped), and decoding just those.

Containers (`.mp4`, `.webm`, `.mov`) are read with PyAV (ffmpeg's decoders, in wheels on every platform); GIF and
animated WebP with Pillow, which reads their per-frame durations. A still image reads as a one-frame clip. One clip
is decoded at a time, frame by frame, keeping only the frames asked for; nothing holds a folder in memory.
toolkit/data/dataset.py reads a video family's clips with these (datasets[].num_frames / fps / short_clips)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageSequence

from toolkit.errors import UserError

#: containers PyAV decodes
CONTAINER_EXTENSIONS = (".mp4", ".webm", ".mov")
#: formats that may be animated (Pillow reads their frames and durations); one frame is a still image
ANIMATED_IMAGE_EXTENSIONS = (".gif", ".webp")

ShortClips = Literal["refuse", "loop"]


class ClipError(UserError, ValueError):
    """A clip that cannot give the frames asked of it (too short, or unreadable); the message names it."""


@dataclass(frozen=True)
class ClipInfo:
    frames: int
    #: frames per second (a still image: 0)
    fps: float
    width: int
    height: int


def clip_info(path: Path) -> ClipInfo:
    """Frame count, rate and size of a clip (or 1 frame for a still image), without decoding its pictures where
    the container says them; an unreadable file raises ClipError naming it."""
    try:
        if path.suffix.lower() in CONTAINER_EXTENSIONS:
            return _container_info(path)
        return _image_info(path)
    except ClipError:
        raise
    except Exception as err:  # PyAV and Pillow raise many types for broken files
        raise ClipError(f"unreadable clip {path}: {err}") from err


def _container_info(path: Path) -> ClipInfo:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        frames = stream.frames
        if not frames:  # some containers (WebM) do not store the count: count the packets' frames
            frames = sum(1 for _ in container.decode(stream))
        return ClipInfo(frames, fps, stream.codec_context.width, stream.codec_context.height)


def _image_info(path: Path) -> ClipInfo:
    with Image.open(path) as image:
        frames = getattr(image, "n_frames", 1)
        # WebP states a frame's duration only once the frame is loaded (GIF on seeking)
        durations = ([_loaded(frame).info.get("duration", 0) for frame in ImageSequence.Iterator(image)]
                     if frames > 1 else [])
        mean_ms = sum(durations) / len(durations) if durations else 0
        return ClipInfo(frames, 1000.0 / mean_ms if mean_ms > 0 else 0.0, image.width, image.height)


def _loaded(frame: Image.Image) -> Image.Image:
    frame.load()
    return frame


def frame_indices(info: ClipInfo, num_frames: int, fps: float | None = None, short: ShortClips = "refuse",
                  name: str = "clip") -> list[int]:
    """Which source frames a sample of `num_frames` takes from the start of a clip: every frame, or with `fps` the
    frame showing at each 1/fps step of time (a clip at 30 fps read at 15 takes every other frame). A clip with
    too few frames is refused naming `name` and what would fit, or with `short: loop` read round again from its
    start. A still image (one frame) fills every frame."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be at least 1, got {num_frames}")
    if info.frames == 1:
        return [0] * num_frames
    step = 1.0 if fps is None or info.fps <= 0 else info.fps / fps
    # the frame on screen at time k / fps; the epsilon keeps exact ratios (30 -> 15 fps) off float noise
    wanted = [math.floor(k * step + 1e-9) for k in range(num_frames)]
    if wanted[-1] < info.frames:
        return wanted
    if short == "loop":
        return [index % info.frames for index in wanted]
    fits = math.floor((info.frames - 1) / step + 1e-9) + 1
    at = f" at {fps:g} fps" if fps is not None else ""
    raise ClipError(f"{name}: {info.frames} frames at {info.fps:g} fps give {fits} frames{at}, but num_frames is "
                    f"{num_frames} (set datasets[].short_clips: loop to loop short clips)")


def read_frames(path: Path, indices: list[int]) -> np.ndarray:
    """The source frames at `indices` (in that order, repeats allowed) as RGB uint8 [F, H, W, 3], decoding from the
    start and stopping after the last one needed; an unreadable clip, or one with fewer frames than an index,
    raises ClipError naming it."""
    needed = set(indices)
    kept: dict[int, np.ndarray] = {}
    decoded = 0
    try:
        for index, frame in enumerate(_frames(path)):
            decoded = index + 1
            if index in needed:
                kept[index] = frame
            if len(kept) == len(needed):
                break
    except Exception as err:
        raise ClipError(f"unreadable clip {path}: {err}") from err
    missing = sorted(needed - kept.keys())
    if missing:
        raise ClipError(f"{path}: has no frame {missing[0]} (it ended after {decoded} frames)")
    return np.stack([kept[index] for index in indices])


def _frames(path: Path):
    """The clip's frames as RGB arrays, decoded one at a time."""
    if path.suffix.lower() in CONTAINER_EXTENSIONS:
        import av

        with av.open(str(path)) as container:
            for frame in container.decode(video=0):
                yield frame.to_ndarray(format="rgb24")
        return
    with Image.open(path) as image:
        for frame in ImageSequence.Iterator(image):
            yield np.asarray(frame.convert("RGB"))
