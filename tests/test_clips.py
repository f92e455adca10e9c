"""Reading clips (toolkit/data/clips.py) on clips generated here whose frame k shows gray level 20 k: frame counts and
rates, frame selection by count and by fps, short clips refused by name or looped, a still image as a one-frame
clip, a corrupt clip named."""

from __future__ import annotations

import pytest
from helpers import shown, write_gif, write_mp4
from PIL import Image

from toolkit.data.clips import ClipError, ClipInfo, clip_info, frame_indices, read_frames

FRAMES, FPS, SIZE = 12, 10, 32  # helpers.write_mp4's defaults


def test_a_container_clips_count_rate_and_frames(tmp_path):
    clip = write_mp4(tmp_path / "clip.mp4")
    info = clip_info(clip)
    assert info == ClipInfo(FRAMES, FPS, SIZE, SIZE)
    assert shown(read_frames(clip, frame_indices(info, 5))) == [0, 1, 2, 3, 4]
    # at 5 fps a 10 fps clip gives every other frame; at 4 fps the frame on screen every 2.5 source frames
    assert shown(read_frames(clip, frame_indices(info, 5, fps=5))) == [0, 2, 4, 6, 8]
    assert frame_indices(info, 4, fps=4) == [0, 2, 5, 7]
    assert read_frames(clip, [3, 3, 1]).shape == (3, SIZE, SIZE, 3)


def test_a_short_clip_is_refused_by_name_or_looped(tmp_path):
    info = clip_info(write_mp4(tmp_path / "short.mp4", frames=6))
    with pytest.raises(ClipError, match=r"short.mp4: 6 frames at 10 fps give 3 frames at 5 fps, but num_frames is 5 "
                                        r"\(set datasets\[\]\.short_clips: loop"):
        frame_indices(info, 5, fps=5, name="short.mp4")
    assert frame_indices(info, 9, short="loop") == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert shown(read_frames(tmp_path / "short.mp4", frame_indices(info, 5, fps=5, short="loop"))) == [0, 2, 4, 0, 2]


def test_gif_frames_and_rate_and_a_still_image_as_one_frame(tmp_path):
    gif = write_gif(tmp_path / "anim.gif")
    info = clip_info(gif)
    assert (info.frames, info.fps) == (6, 20.0)
    assert shown(read_frames(gif, frame_indices(info, 3, fps=10))) == [0, 2, 4]
    still = tmp_path / "still.png"
    Image.new("RGB", (SIZE, 16), (60, 60, 60)).save(still)
    info = clip_info(still)
    assert (info.frames, info.width, info.height) == (1, SIZE, 16)
    frames = read_frames(still, frame_indices(info, 4, fps=8))
    assert frames.shape == (4, 16, SIZE, 3) and shown(frames) == [3, 3, 3, 3]


def test_a_corrupt_clip_is_named(tmp_path):
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    with pytest.raises(ClipError, match="unreadable clip .*broken.mp4"):
        clip_info(broken)
    with pytest.raises(ClipError, match="unreadable clip .*broken.mp4"):
        read_frames(broken, [0])
    clip = write_mp4(tmp_path / "clip.mp4", frames=4)
    with pytest.raises(ClipError, match=r"clip.mp4: has no frame 6 \(it ended after 4 frames\)"):
        read_frames(clip, [0, 6])
