"""Videos of video-model rollouts: MP4 files, frames for image scorers, and grids.

Rollouts of a video card decode to [B, C, F, H, W] in [0, 1]. Image reward
models take [B, C, H, W]; `MiddleFrameRewards` scores each video's middle frame
(the frame farthest from the causal VAE's first-frame artefacts, and one
scorer call per video rather than F).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def is_video(x: torch.Tensor) -> bool:
    """True for a batch of videos [B, C, F, H, W]."""
    return x.dim() == 5


def middle_frame(videos: torch.Tensor) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, C, H, W], the frame at F // 2."""
    if not is_video(videos):
        raise ValueError(f"videos must have shape [B, C, F, H, W], got {tuple(videos.shape)}")
    return videos[:, :, videos.shape[2] // 2]


def video_to_uint8(video: torch.Tensor) -> np.ndarray:
    """One video [C, F, H, W] in [0, 1] to frames [F, H, W, 3] uint8 (grey is repeated to RGB)."""
    if video.dim() != 4:
        raise ValueError(f"a video must have shape [C, F, H, W], got {tuple(video.shape)}")
    x = torch.nan_to_num(video.detach().to("cpu", torch.float32), nan=0.0).clamp(0.0, 1.0)
    x = (x * 255.0).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
    if x.shape[-1] == 1:
        x = np.repeat(x, 3, axis=-1)
    return np.ascontiguousarray(x)


def write_mp4(video: torch.Tensor, path: str | Path, fps: int = 16) -> Path:
    """Write one video [C, F, H, W] in [0, 1] as an H.264 MP4 (imageio + imageio-ffmpeg); returns the path."""
    import imageio.v2 as imageio

    frames = video_to_uint8(video)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".partial.mp4")
    # macro_block_size=1: keep the size as it is (H.264 only needs it even; the engine's sizes are).
    with imageio.get_writer(str(tmp), fps=fps, codec="libx264", macro_block_size=1, pixelformat="yuv420p",
                            ffmpeg_log_level="error") as writer:
        for frame in frames:
            writer.append_data(frame)
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def read_mp4(path: str | Path) -> np.ndarray:
    """Frames [F, H, W, 3] uint8 of an MP4 file."""
    import imageio.v2 as imageio

    with imageio.get_reader(str(path), format="ffmpeg") as reader:
        return np.stack(list(reader.iter_data()))  # len(reader) is inf for ffmpeg streams


class MiddleFrameRewards:
    """A reward set for videos: scores each video's middle frame; images pass through unchanged."""

    def __init__(self, rewards):
        self.rewards = rewards

    def score(self, images: torch.Tensor, *args, **kwargs):
        return self.rewards.score(middle_frame(images) if is_video(images) else images, *args, **kwargs)

    def __getattr__(self, name):  # everything else (names, weights, repr) is the wrapped set's
        return getattr(self.rewards, name)

    def __repr__(self) -> str:
        return f"MiddleFrameRewards({self.rewards!r})"
