"""Group-relative advantages (GRPO), computed over all ranks.

Each prompt's G samples form a group; a sample's advantage is its reward's
distance from the group mean in units of the group std. Groups may span
ranks, so every rank gathers all rewards, computes the same global result and
keeps its own slice: the numbers do not depend on how many ranks there are.
"""

from __future__ import annotations

import torch

from flywheel.distributed import all_gather_cat, rank_and_world


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None,
                     eps: float = 1e-4, clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], usable [N]) for rewards [N] grouped by group_ids [N].

    Invalid samples (masked rewards) are left out of the group statistics and
    get no advantage; a group with no valid sample is dropped entirely. Groups
    with one valid sample have zero advantage (nothing to compare against).
    `usable` marks the samples that carry a training signal.
    """
    rewards = rewards.float()
    if valid is None:
        valid = torch.isfinite(rewards)
    valid = valid & torch.isfinite(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    w = valid.float()
    count = torch.zeros(n_groups, device=r.device).index_add_(0, group, w)
    total = torch.zeros(n_groups, device=r.device).index_add_(0, group, r)
    mean = total / count.clamp(min=1)
    sq = torch.zeros(n_groups, device=r.device).index_add_(0, group, w * (r - mean[group]) ** 2)
    std = torch.sqrt(sq / count.clamp(min=1))
    adv = (r - mean[group]) / (std[group] + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    adv = torch.where(valid, adv, torch.zeros_like(adv))
    return adv, valid


def distributed_group_advantages(local_rewards: torch.Tensor, local_group_ids: torch.Tensor,
                                 local_valid: torch.Tensor, eps: float = 1e-4,
                                 clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_advantages` over the samples of every rank; returns this rank's slice.

    Every rank must hold the same number of samples, laid out so that rank r
    holds global rows [r·n, (r+1)·n).
    """
    rank, _ = rank_and_world()
    n = local_rewards.shape[0]
    rewards = all_gather_cat(local_rewards.float())
    group_ids = all_gather_cat(local_group_ids.long())
    valid = all_gather_cat(local_valid.to(torch.uint8)).bool()
    adv, usable = group_advantages(rewards, group_ids, valid, eps=eps, clip=clip)
    return adv[rank * n:(rank + 1) * n], usable[rank * n:(rank + 1) * n]


def reward_advantages(scores: dict[str, torch.Tensor], weights: dict[str, float], total: torch.Tensor,
                      valid: torch.Tensor, group_ids: torch.Tensor, mode: str = "weighted_sum",
                      eps: float = 1e-4, clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], usable [N]) of a multi-reward batch under a combination mode.

    "weighted_sum": group-normalise the weighted total. "sum_of_advantages":
    group-normalise each scorer's raw scores on its own, then sum with the
    weights (clipping applies to the sum). Either way a sample any scorer
    masked is left out of every group statistic and gets no advantage, and a
    group with no valid sample is dropped.
    """
    if mode == "weighted_sum":
        return group_advantages(total, group_ids, valid, eps=eps, clip=clip)
    if mode != "sum_of_advantages":
        raise ValueError(f"reward combination mode {mode!r} is not known; valid modes: weighted_sum, "
                         "sum_of_advantages")
    adv = torch.zeros(total.shape[0], dtype=torch.float32, device=total.device)
    for name, weight in weights.items():
        per, _ = group_advantages(scores[name], group_ids, valid, eps=eps)
        adv = adv + weight * per
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return torch.where(valid, adv, torch.zeros_like(adv)), valid.clone()


def distributed_reward_advantages(batch, local_group_ids: torch.Tensor, eps: float = 1e-4,
                                  clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reward_advantages` of a `RewardBatch` over every rank's samples; returns this rank's slice."""
    if batch.mode == "weighted_sum":  # one gathered tensor is enough
        return distributed_group_advantages(batch.total, local_group_ids, batch.valid, eps=eps, clip=clip)
    rank, _ = rank_and_world()
    n = len(batch)
    gather = lambda t: all_gather_cat(t.float())  # noqa: E731
    valid = all_gather_cat(batch.valid.to(torch.uint8)).bool()
    scores = {name: gather(batch.scores[name]) for name in batch.scorer_ids}
    adv, usable = reward_advantages(scores, batch.weights, gather(batch.total), valid,
                                    all_gather_cat(local_group_ids.long()), mode=batch.mode, eps=eps, clip=clip)
    return adv[rank * n:(rank + 1) * n], usable[rank * n:(rank + 1) * n]
