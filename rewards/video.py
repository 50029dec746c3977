"""Video versions of image scorers: the mean of an image scorer over K evenly spaced frames of each video.

`pickscore_video`, `clip_score_video` and `aesthetic_video` load the same local
folders as their image versions (rewards.clip) and declare `wants_video`, so a
RewardSet hands them the whole clips [B, C, F, H, W] (see rewards.types); the
image the other scorers get (the middle frame) is ignored.

The K frames are the centres of K equal spans of the clip, frame
floor((2i + 1)·F / 2K) for i = 0..K-1: K = 1 is the middle frame that image
scorers see (flywheel.video.middle_frame), and no K picks the first frame,
which a causal video VAE draws worst.
"""

from __future__ import annotations

import math

import torch


def frame_indices(frames: int, k: int) -> list[int]:
    """The K frame indices taken from a clip of `frames` frames (all of them when K >= frames)."""
    if frames < 1:
        raise ValueError(f"a video needs at least one frame, got {frames}")
    if k >= frames:
        return list(range(frames))
    return [(2 * i + 1) * frames // (2 * k) for i in range(k)]


def check_frames(value: object, key: str = "frames") -> int:
    """An integer K >= 1; ValueError naming `key` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an integer >= 1 (frames taken from each video), got {value!r}")
    return value


def sample_frames(videos: torch.Tensor, k: int) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, K', C, H, W], the K' = min(K, F) frames of `frame_indices`."""
    if videos.dim() != 5:
        raise ValueError(f"videos must have shape [B, C, F, H, W], got {tuple(videos.shape)}")
    index = torch.tensor(frame_indices(videos.shape[2], k), device=videos.device)
    return videos.index_select(2, index).transpose(1, 2)


class FrameMean:
    """A video scorer: the mean of an image scorer's scores over K frames of each video.

    The image scorer is called once on all B·K frames (prompt and metadata repeated per
    frame). A frame the image scorer cannot score (NaN) makes its video NaN, which the
    combiner masks: a mean over the frames that happened to score would be a different reward.
    """

    wants_video = True

    def __init__(self, scorer, name: str, frames: int = 4):
        self.scorer, self.name, self.frames = scorer, name, check_frames(frames)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict], *,
                 videos: torch.Tensor) -> torch.Tensor:
        """Raw scores [B] float32 on the host: the mean of the image scorer over K frames of each video."""
        frames = sample_frames(videos, self.frames)
        batch, k = frames.shape[:2]
        repeated_prompts = [p for p in prompts for _ in range(k)]
        repeated_meta = [m for m in metadata for _ in range(k)]
        scores = torch.as_tensor(self.scorer(frames.flatten(0, 1), repeated_prompts, repeated_meta))
        if scores.shape != (batch * k,):
            raise ValueError(f"{self.name}: the image scorer returned shape {tuple(scores.shape)} for "
                             f"{batch * k} frames")
        scores = scores.detach().float().cpu().view(batch, k)
        # A non-finite frame poisons its video's mean (NaN), never silently drops out of it.
        return torch.where(torch.isfinite(scores).all(1), scores.mean(1), torch.full((batch,), math.nan))


def _video_of(module: str, attr: str, name: str):
    """A factory of the video version of the image scorer `module.attr`: kwargs go to it, but `frames`."""

    def factory(frames: int = 4, **kwargs) -> FrameMean:
        import importlib

        check_frames(frames)
        return FrameMean(getattr(importlib.import_module(module), attr)(**kwargs), name, frames)

    def check_args(frames: int = 4, **kwargs) -> None:
        """The check before work (`rewards.registry.check_scorer`): the frames, then the image scorer's own."""
        import importlib

        check_frames(frames)
        getattr(importlib.import_module(module), attr).check_args(**kwargs)

    factory.__qualname__ = f"video({module}.{attr})"
    factory.check_args = check_args
    return factory


clip_score_video = _video_of("rewards.clip", "ClipScore", "clip_score_video")
pickscore_video = _video_of("rewards.clip", "PickScore", "pickscore_video")
aesthetic_video = _video_of("rewards.clip", "Aesthetic", "aesthetic_video")
