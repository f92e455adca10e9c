"""Sample videos (toolkit/run/video.py): written as H.264 mp4 or, without an encoder, animated WebP, with their
frames, rate and metadata readable back by the clip reader; report.html plays them in its grid."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit.data.clips import clip_info, read_frames
from toolkit.run.report import build_report, sample_grid
from toolkit.run.video import h264_available, video_metadata, write_video


def frames(count: int = 9, height: int = 32, width: int = 48) -> np.ndarray:
    """Gray frames, frame k at level 20 k: each frame tells its index after a lossy encode."""
    return np.stack([np.full((height, width, 3), 20 * k, np.uint8) for k in range(count)])


@pytest.mark.parametrize("h264", [True, False], ids=["mp4", "webp"])
def test_a_sample_video_keeps_its_frames_rate_and_metadata(tmp_path, h264):
    if h264 and not h264_available():
        pytest.skip("this PyAV has no H.264 encoder")
    path = write_video(tmp_path / "step_000000005_0", frames(), 12.0, {"prompt": "a cat", "seed": "7"}, h264=h264)
    assert path.name == ("step_000000005_0.mp4" if h264 else "step_000000005_0.webp")
    info = clip_info(path)
    assert (info.frames, info.width, info.height) == (9, 48, 32)
    assert info.fps == pytest.approx(12.0, rel=0.02)
    back = read_frames(path, list(range(9)))
    assert [round(float(frame.mean()) / 20) for frame in back] == list(range(9))
    assert video_metadata(path) == {"prompt": "a cat", "seed": "7"}
    assert not list(tmp_path.glob(".*tmp"))  # written atomically: no temporary file left


def test_odd_sides_are_padded_for_h264(tmp_path):
    if not h264_available():
        pytest.skip("this PyAV has no H.264 encoder")
    path = write_video(tmp_path / "odd", frames(5, 33, 47), 8.0, {})
    info = clip_info(path)
    assert (info.width, info.height) == (48, 34)


def test_report_plays_sample_videos_with_their_prompts(tmp_path):
    samples = tmp_path / "samples"
    write_video(samples / "step_000000002_0", frames(5), 8.0, {"prompt": "a rolling ball"})
    write_video(samples / "step_000000004_0", frames(5), 8.0, {"prompt": "a rolling ball"}, h264=False)
    grid = sample_grid(tmp_path, last_step=None)
    assert "step 2" in grid and "step 4" in grid and "a rolling ball" in grid
    if h264_available():
        assert '<video src="data:video/mp4;base64,' in grid and 'title="samples/step_000000002_0.mp4" autoplay loop muted' in grid
    assert '<img src="data:image/webp;base64,' in grid and 'title="samples/step_000000004_0.webp"' in grid
    assert "<video" in build_report(tmp_path) or not h264_available()
