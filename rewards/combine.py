"""Multi-reward combination: run each scorer, mask failures, and form the weighted total."""

from __future__ import annotations

import logging
from typing import Any

import torch

from rewards.registry import REMOTE, get, parse_spec_targets
from rewards.remote import check_seconds
from rewards.types import (RewardBatch, Scorer, check_audio, check_pixel_range, check_videos, scorer_inputs,
                           wants_audio, wants_video)

logger = logging.getLogger(__name__)

# weighted_sum: advantages of sum_k w_k·r_k (one group normalisation);
# sum_of_advantages: sum_k w_k·A_k with each reward normalised in its group first, so a reward
# with a large raw scale cannot drown the others (Flow-Factory / MixGRPO style).
# gdpo: each reward normalised in its group, the weighted sum normalised over the batch (GDPO; Flow-Factory's
# default); a sample a scorer did not score trains on the others (flywheel.advantages.gdpo_advantages).
MODES = ("weighted_sum", "sum_of_advantages", "gdpo")


class RewardSet:
    """The scorers of a reward spec with their weights; `score` turns images into a `RewardBatch`."""

    def __init__(self, spec: str | dict | list, scorer_kwargs: dict[str, dict[str, Any]] | None = None,
                 mode: str = "weighted_sum", remote_timeout_s: float | None = None,
                 remote_budget_s: float | None = None):
        """Build (once) every scorer named in `spec`; `scorer_kwargs[name]` goes to that scorer's factory.

        `mode` says how the trainer turns the scores into advantages (see MODES).
        `remote_timeout_s` / `remote_budget_s` (None: the client's defaults) go to every
        `remote:<url>` scorer as `timeout_s` (wall clock of one HTTP call) and `budget_s`
        (wall clock of one batch, retries included); its own `scorer_kwargs` entry wins.
        """
        if mode not in MODES:
            raise ValueError(f"reward combination mode {mode!r} is not known; valid modes: {', '.join(MODES)}")
        # Checked even without a remote entry: a bad config value is an error wherever it is unused today.
        remote_defaults = {key: check_seconds(setting, value) for key, setting, value in
                           (("timeout_s", "remote_timeout_s", remote_timeout_s),
                            ("budget_s", "remote_budget_s", remote_budget_s)) if value is not None}
        self.mode = mode
        entries = parse_spec_targets(spec)  # (name, what get() builds, weight): "ocr=remote:<url>" is named ocr
        pairs, targets = [(n, w) for n, _, w in entries], {n: t for n, t, _ in entries}
        scorer_kwargs = dict(scorer_kwargs or {})
        names = [n for n, _ in pairs]
        extra = sorted(set(scorer_kwargs) - set(names))
        if extra:
            raise ValueError(f"scorer_kwargs names scorers not in the spec: {', '.join(extra)}; "
                             f"spec has: {', '.join(names)}")
        self.weights: dict[str, float] = dict(pairs)
        self.scorer_ids: list[str] = names
        # Built here and kept: a scorer that loads weights loads them once per RewardSet.
        self.scorers: dict[str, Scorer] = {
            n: get(targets[n], **{**(remote_defaults if targets[n].startswith(REMOTE) else {}),
                                  **scorer_kwargs.get(n, {})})
            for n in names}

    def __repr__(self) -> str:
        body = ", ".join(f"{n}:{w:g}" for n, w in self.weights.items())
        return f"RewardSet({body}" + (f", mode={self.mode}" if self.mode != "weighted_sum" else "") + ")"

    @property
    def wants_audio(self) -> bool:
        """Whether a scorer of this set needs the rollouts' audio (generate with sound for it)."""
        return any(wants_audio(s) for s in self.scorers.values())

    @property
    def wants_video(self) -> bool:
        """Whether a scorer of this set needs whole videos (not only the frame image scorers see)."""
        return any(wants_video(s) for s in self.scorers.values())

    def _inputs(self, images: torch.Tensor, audio: torch.Tensor | None, sample_rate: int | None,
                videos: torch.Tensor | None) -> dict[str, dict[str, Any]]:
        """The extra keyword arguments of each scorer's call; ValueError naming a scorer whose input is missing.

        An error, not a masked batch: a missing input is a mismatch between the reward spec and what the
        model generates, which no later batch fixes.
        """
        check_pixel_range("RewardSet.score's images", images)
        if audio is not None:
            sample_rate = check_audio(audio, sample_rate, images.shape[0])
        elif sample_rate is not None:
            raise ValueError("RewardSet.score got a sample_rate but no audio; pass both or neither")
        if videos is not None:
            check_videos(videos, images.shape[0])
            check_pixel_range("RewardSet.score's videos", videos)
        return {name: scorer_inputs(name, scorer, images, audio, sample_rate, videos)
                for name, scorer in self.scorers.items()}

    def _run(self, name: str, images: torch.Tensor, prompts: list[str], metadata: list[dict],
             extra: dict[str, Any]) -> tuple[torch.Tensor, str | None]:
        """One scorer's raw scores as host float32 [B], or all-NaN and the error text if it failed."""
        batch = images.shape[0]
        try:
            raw = self.scorers[name](images, prompts, metadata, **extra)
            raw = torch.as_tensor(raw).detach()
            if raw.shape != (batch,):
                raise ValueError(f"returned shape {tuple(raw.shape)}, expected ({batch},)")
            return raw.to(device="cpu", dtype=torch.float32), None
        except Exception as exc:  # a broken scorer masks its rows; it must not kill the run
            error = f"{type(exc).__name__}: {exc}"
            logger.warning("reward scorer %r failed on a batch of %d; masking all its rows: %s", name, batch, error)
            return torch.full((batch,), float("nan")), error

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None,
              weight_version: int, *, audio: torch.Tensor | None = None, sample_rate: int | None = None,
              videos: torch.Tensor | None = None) -> RewardBatch:
        """Score a batch of images [B, C, H, W] in [0, 1] rolled out with weights `weight_version`.

        `audio` [B, channels, samples] in [-1, 1] with its `sample_rate`, and `videos` [B, C, F, H, W]
        (when `images` are frames taken from them), go to the scorers that ask for them (see `Scorer`).
        """
        batch = images.shape[0]
        metadata = [{} for _ in range(batch)] if metadata is None else list(metadata)
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(f"got {batch} images, {len(prompts)} prompts and {len(metadata)} metadata dicts; "
                             "they must be the same length")
        inputs = self._inputs(images, audio, sample_rate, videos)
        scores, valid_per_scorer, errors = {}, {}, {}
        valid = torch.ones(batch, dtype=torch.bool)
        total = torch.zeros(batch, dtype=torch.float32)
        for name in self.scorer_ids:
            raw, error = self._run(name, images, prompts, metadata, inputs[name])
            if error is not None:
                errors[name] = error
            ok = torch.isfinite(raw)
            scores[name] = torch.where(ok, raw, torch.full_like(raw, float("nan")))  # inf -> NaN too
            valid_per_scorer[name] = ok
            valid &= ok
            total += self.weights[name] * torch.where(ok, raw, torch.zeros_like(raw))
        overflow = valid & ~torch.isfinite(total)  # finite scores whose weighted sum passes float32's range
        if overflow.any():
            logger.warning("reward total of row(s) %s is not finite (scores near float32's limit, 3.4e38, times "
                           "their weights); masking them", overflow.nonzero().flatten().tolist())
            valid &= ~overflow
        # NaN, not 0, on invalid rows: a consumer that ignores the mask fails loudly.
        total = torch.where(valid, total, torch.full_like(total, float("nan")))
        return RewardBatch(scores=scores, valid_per_scorer=valid_per_scorer, valid=valid, total=total,
                           weights=dict(self.weights), scorer_ids=list(self.scorer_ids),
                           weight_version=int(weight_version), errors=errors, mode=self.mode)
