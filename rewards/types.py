"""The reward protocol (`Scorer`) and the REWARD_BATCH unit (`RewardBatch`)."""

from __future__ import annotations

import math
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
    """

    name: str

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32."""


def _mean_std(values: torch.Tensor) -> tuple[float, float]:
    """Mean and population std of a 1-D tensor; NaN for an empty one (no valid rows)."""
    if values.numel() == 0:
        return math.nan, math.nan
    # correction=0: one valid row has std 0 rather than NaN, which keeps dashboards readable.
    return values.mean().item(), values.std(correction=0).item()


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
