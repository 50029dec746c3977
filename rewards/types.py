"""The reward protocol (`Scorer`) and the REWARD_BATCH unit (`RewardBatch`)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Scorer(Protocol):
    """Scores a batch of images against their prompts; one float per image.

    `images` is [B, C, H, W] float in [0, 1] on any device; the scorer moves it
    to its own device and is the only one to bring results to the host. The
    result is a float32 tensor [B] of raw scores; a row it cannot score is NaN
    (or inf), which the combiner masks and counts instead of treating as 0.

    Other outputs of a rollout reach a scorer only if it asks for them, with a
    class attribute, as extra keyword arguments of the same call (a scorer
    that declares nothing is called with the three arguments above, as ever):

    - `wants_audio = True`: `audio=` [B, channels, samples] float32 in [-1, 1]
      and `sample_rate=` (int, Hz).
    - `wants_video = True`: `videos=` [B, C, F, H, W] float in [0, 1] (the
      whole clips; `images` is then what image scorers get, e.g. the middle frame).

    A declaration rather than audio in the per-row metadata: metadata is JSON
    (it is logged and sent to remote scorers as text), a waveform is a tensor
    batch; and a declared need can be checked before the call, so a batch
    without audio given to an audio scorer is an error naming that scorer, not a
    KeyError deep inside it, and a reward set can say up front that it needs audio.

    `differentiable = True` (default False) says the score passes gradients to
    `images`: called with images that require grad, it returns scores whose
    graph reaches them (no no_grad, detach, uint8 or numpy round trip on the
    way). Reward-gradient recipes (trainers/draft.py) accept only such scorers.
    The scorer's own weights stay frozen; grad is only built when the images ask for it.
    """

    name: str

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32."""


def wants_audio(scorer: object) -> bool:
    """Whether `scorer` is to be called with `audio=` and `sample_rate=` (see `Scorer`)."""
    return bool(getattr(scorer, "wants_audio", False))


def is_differentiable(scorer: object) -> bool:
    """Whether `scorer` (an instance or its class) passes gradients to the images (see `Scorer`)."""
    return bool(getattr(scorer, "differentiable", False))


def wants_video(scorer: object) -> bool:
    """Whether `scorer` is to be called with `videos=` (see `Scorer`)."""
    return bool(getattr(scorer, "wants_video", False))


def scorer_inputs(name: str, scorer: object, images: torch.Tensor, audio: torch.Tensor | None,
                  sample_rate: int | None, videos: torch.Tensor | None) -> dict:
    """The keyword arguments `scorer` (called `name`) takes beside (images, prompts, metadata).

    ValueError naming the scorer when it asks for an input the batch lacks. `audio` and `videos`
    must have been checked (see `check_audio`); `videos` None with 5-D `images` means the images are the videos.
    """
    extra: dict = {}
    if wants_audio(scorer):
        if audio is None:
            raise ValueError(f"reward scorer {name!r} needs audio (wants_audio) but this batch has none: "
                             "generate with sound (a card that makes it, e.g. ltx2 with audio=True in the "
                             "request) or take the scorer out of the reward spec")
        extra.update(audio=audio, sample_rate=sample_rate)
    if wants_video(scorer):
        if videos is None and images.dim() != 5:
            raise ValueError(f"reward scorer {name!r} needs videos (wants_video) but this batch holds "
                             f"images {tuple(images.shape)}: use it with a video card")
        extra["videos"] = images if videos is None else videos
    return extra


# Rounding room on the [0, 1] pixel range (a decoder's clamp is exact; a client's own arithmetic may not be).
PIXEL_RANGE_SLACK = 1e-4


def check_pixel_range(name: str, pixels: torch.Tensor) -> None:
    """ValueError unless the finite values of `pixels` lie in [0, 1], the range every scorer reads (NaN marks a
    broken sample and is scored as masked). Images in [-1, 1] (a VAE's raw output) or [0, 255] would be scored
    without complaint, and wrongly."""
    finite = pixels.detach()
    finite = finite[torch.isfinite(finite)] if finite.is_floating_point() else finite
    if not finite.numel():
        return
    low, high = float(finite.min()), float(finite.max())
    if low < -PIXEL_RANGE_SLACK or high > 1 + PIXEL_RANGE_SLACK:
        raise ValueError(f"{name} must hold pixel values in [0, 1], got values in [{low:.4g}, {high:.4g}]: send "
                         f"them as the engine returns them ((x + 1) / 2 for a VAE's [-1, 1] output, x / 255 for "
                         f"8-bit pixels)")


def check_videos(videos: torch.Tensor, batch: int) -> None:
    """ValueError unless `videos` is a [batch, C, F, H, W] tensor."""
    if not isinstance(videos, torch.Tensor) or videos.dim() != 5 or videos.shape[0] != batch:
        shape = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
        raise ValueError(f"videos must be a tensor [B, C, F, H, W] with B = {batch} (the batch size), got {shape}")


def check_audio(audio: torch.Tensor, sample_rate: object, batch: int) -> int:
    """The sample rate as an int, if `audio` is a [batch, channels, samples] float tensor; ValueError otherwise."""
    if not isinstance(audio, torch.Tensor) or audio.dim() != 3 or audio.shape[0] != batch:
        shape = tuple(audio.shape) if isinstance(audio, torch.Tensor) else type(audio).__name__
        raise ValueError(f"audio must be a tensor [B, channels, samples] with B = {batch} (the batch size), "
                         f"got {shape}")
    if not audio.is_floating_point():
        raise ValueError(f"audio must be floating point in [-1, 1], got dtype {audio.dtype}")
    if audio.shape[1] < 1 or audio.shape[2] < 1:
        raise ValueError(f"audio has no samples: shape {tuple(audio.shape)}")
    try:  # operator.index: numpy and 0-d integer tensors are fine, 16000.0 is not
        rate = operator.index(sample_rate) if not isinstance(sample_rate, bool) else 0
    except TypeError:
        rate = 0
    if rate < 1:
        raise ValueError(f"audio needs its sample rate as a positive int (Hz), got {sample_rate!r}")
    return int(rate)


def _mean_std(values: torch.Tensor) -> tuple[float, float]:
    """Mean and population std of a 1-D tensor; NaN for an empty one (no valid rows)."""
    if values.numel() == 0:
        return math.nan, math.nan
    # correction=0: one valid row has std 0 rather than NaN, which keeps dashboards readable.
    mean, std = values.mean().item(), values.std(correction=0).item()
    if not (math.isfinite(mean) and math.isfinite(std)) and torch.isfinite(values).all():
        # Finite float32 scores near its limit (3.4e38) sum to inf in float32, and an inf mean stops a run: again
        # in float64, only then (every other batch keeps the numbers other float32 sums of it give).
        values = values.double()
        mean, std = values.mean().item(), values.std(correction=0).item()
    return mean, std


@dataclass
class RewardBatch:
    """Per-scorer scores, their validity, and the weighted total of one scored rollout batch.

    Tensors are float32 (bool for masks) on the host. Invalid rows are NaN in
    `scores` and in `total`, so a consumer that ignores `valid` fails loudly.
    """

    scores: dict[str, torch.Tensor]
    valid_per_scorer: dict[str, torch.Tensor]
    valid: torch.Tensor
    total: torch.Tensor
    weights: dict[str, float]
    scorer_ids: list[str]
    weight_version: int
    errors: dict[str, str] = field(default_factory=dict)
    mode: str = "weighted_sum"
    """how advantages combine the scorers: weighted_sum (of raw scores) or sum_of_advantages"""

    def __len__(self) -> int:
        """Batch size B."""
        return self.total.shape[0]

    @staticmethod
    def concat(parts: list["RewardBatch"]) -> "RewardBatch":
        """Join the batches of one reward set (scored in chunks) along the batch, in order."""
        first = parts[0]
        for p in parts[1:]:
            if p.scorer_ids != first.scorer_ids or p.weights != first.weights or p.mode != first.mode:
                raise ValueError(f"RewardBatch.concat needs parts of one reward set; got scorers {p.scorer_ids} "
                                 f"and {first.scorer_ids}")
            if p.weight_version != first.weight_version:
                raise ValueError(f"RewardBatch.concat got weight versions {p.weight_version} and "
                                 f"{first.weight_version}; a batch comes from one version")
        errors = {}
        for p in parts:
            for name, error in p.errors.items():
                errors.setdefault(name, error)
        return RewardBatch(
            scores={n: torch.cat([p.scores[n] for p in parts]) for n in first.scorer_ids},
            valid_per_scorer={n: torch.cat([p.valid_per_scorer[n] for p in parts]) for n in first.scorer_ids},
            valid=torch.cat([p.valid for p in parts]), total=torch.cat([p.total for p in parts]),
            weights=dict(first.weights), scorer_ids=list(first.scorer_ids), weight_version=first.weight_version,
            errors=errors, mode=first.mode)

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Flat metrics: mean/std of the total and of each scorer over valid rows, invalid counts."""
        out: dict[str, float] = {}
        out[f"{prefix}/mean"], out[f"{prefix}/std"] = _mean_std(self.total[self.valid])
        out[f"{prefix}/invalid"] = float((~self.valid).sum().item())
        for name in self.scorer_ids:
            ok = self.valid_per_scorer[name]
            out[f"{prefix}/{name}/mean"], out[f"{prefix}/{name}/std"] = _mean_std(self.scores[name][ok])
            out[f"{prefix}/{name}/invalid"] = float((~ok).sum().item())
        return out
