"""Video helpers: MP4 round trip, middle-frame scoring of videos, video logging to trackers."""

import numpy as np
import pytest
import torch

from flywheel.runs.tracking import log_videos
from flywheel.video import MiddleFrameRewards, middle_frame, read_mp4, video_to_uint8, write_mp4


def smooth_video(frames=5, size=16):
    """A video whose brightness ramps over time and space (compresses well, survives H.264)."""
    ramp = torch.linspace(0.1, 0.9, size)
    frame = ramp[None, :].expand(size, size)
    return torch.stack([torch.stack([frame * (0.5 + 0.1 * f)] * 3) for f in range(frames)], dim=1)  # [3, F, H, W]


def test_mp4_round_trip_keeps_shape_and_content(tmp_path):
    video = smooth_video()
    path = write_mp4(video, tmp_path / "sub" / "v.mp4", fps=8)
    assert path.is_file() and not list(tmp_path.glob("sub/*.partial.mp4"))
    frames = read_mp4(path)
    assert frames.shape == (5, 16, 16, 3) and frames.dtype == np.uint8
    expected = video_to_uint8(video).astype(np.float32)
    assert np.abs(frames.astype(np.float32) - expected).mean() < 4.0  # lossy codec, but the same picture
    with pytest.raises(ValueError, match=r"\[C, F, H, W\]"):
        write_mp4(torch.rand(2, 3, 5, 16, 16), tmp_path / "bad.mp4")


def test_middle_frame_rewards_score_the_middle_frame_of_videos():
    seen = []

    class Recorder:
        names = ["jpeg_compressibility"]

        def score(self, images, prompts, metadata, version):
            seen.append(images)
            return images.flatten(1).mean(1)

    videos = torch.rand(2, 3, 5, 8, 8)
    rewards = MiddleFrameRewards(Recorder())
    out = rewards.score(videos, ["a", "b"], [{}, {}], 0)
    assert torch.equal(seen[0], videos[:, :, 2]) and torch.equal(seen[0], middle_frame(videos))
    assert torch.allclose(out, videos[:, :, 2].flatten(1).mean(1))
    images = torch.rand(2, 3, 8, 8)
    rewards.score(images, ["a", "b"], [{}, {}], 0)
    assert seen[1] is images  # images pass through
    assert rewards.names == ["jpeg_compressibility"]  # the wrapped set's attributes
    with pytest.raises(ValueError, match="B, C, F, H, W"):
        middle_frame(images)


def test_log_videos_reaches_tensorboard_as_a_frame_strip(tmp_path):
    logged = []

    class Writer:
        def add_image(self, tag, image, step, dataformats):
            logged.append((tag, image.shape, step, dataformats))

    class Tracker:
        name = "tensorboard"
        writer = Writer()

    class Accelerator:
        trackers = [Tracker()]

    path = write_mp4(smooth_video(frames=5), tmp_path / "v.mp4")
    log_videos(Accelerator(), "eval/videos", [path], step=7)
    assert logged == [("eval/videos/0", (16, 5 * 16, 3), 7, "HWC")]
