"""Sample videos: frames written as H.264 `.mp4` (PyAV, where its ffmpeg has an H.264 encoder) or else as animated
`.webp` (Pillow), with what rendered them (prompt, seed, step, ...) in the file's metadata, written atomically.

The metadata is one JSON object: in an mp4 it is the `comment` tag (`ffprobe -show_format` shows it), in a WebP
the EXIF ImageDescription. `video_metadata` reads either back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from toolkit.files import write_atomic

#: the EXIF tag a WebP sample's metadata is stored under (ImageDescription)
EXIF_DESCRIPTION = 0x010E
VIDEO_EXTENSIONS = (".mp4", ".webp")


def h264_available() -> bool:
    """Whether PyAV's ffmpeg can encode H.264 (its wheels ship libx264; a build against a system ffmpeg may not)."""
    try:
        import av

        av.codec.Codec("libx264", "w")
        return True
    except Exception:  # no PyAV, or no encoder: the WebP fallback
        return False


def write_video(stem: Path, frames: np.ndarray, fps: float, metadata: dict[str, str],
                h264: bool | None = None) -> Path:
    """`frames` (uint8 [F, H, W, 3]) as `<stem>.mp4` (H.264, yuv420p) or, without an H.264 encoder (or with
    `h264=False`), `<stem>.webp`; returns the path written."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
    text = json.dumps(metadata, ensure_ascii=False)
    if h264 is None:
        h264 = h264_available()
    if h264:
        return write_atomic(stem.with_suffix(".mp4"), lambda tmp: _write_mp4(tmp, frames, fps, text))
    return write_atomic(stem.with_suffix(".webp"), lambda tmp: _write_webp(tmp, frames, fps, text))


def _write_mp4(path: Path, frames: np.ndarray, fps: float, text: str) -> None:
    from fractions import Fraction

    import av

    height, width = frames.shape[1:3]
    with av.open(str(path), mode="w", format="mp4") as container:
        container.metadata["comment"] = text
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        # yuv420p (what every player decodes) needs even sides; odd ones are padded by one pixel
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "17"}
        for frame in frames:
            if frame.shape[:2] != (stream.height, stream.width):
                frame = np.pad(frame, ((0, stream.height - height), (0, stream.width - width), (0, 0)), mode="edge")
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _write_webp(path: Path, frames: np.ndarray, fps: float, text: str) -> None:
    images = [Image.fromarray(frame) for frame in frames]
    exif = Image.Exif()
    exif[EXIF_DESCRIPTION] = text
    images[0].save(path, format="WEBP", save_all=True, append_images=images[1:], duration=round(1000 / fps),
                   loop=0, quality=90, exif=exif.tobytes())


def video_metadata(path: Path) -> dict[str, str]:
    """The metadata a sample video was written with ({} for a file without it, or unreadable)."""
    try:
        if path.suffix.lower() == ".mp4":
            import av

            with av.open(str(path)) as container:
                text = container.metadata.get("comment", "")
        else:
            with Image.open(path) as image:
                text = image.getexif().get(EXIF_DESCRIPTION, "")
        return json.loads(text) if text else {}
    except Exception:  # a damaged or foreign file: no metadata
        return {}
