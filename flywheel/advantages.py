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
                     eps: float = 1e-4, clip: float | None = None,
                     global_std: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], usable [N]) for rewards [N] grouped by group_ids [N].

    A sample's advantage is (r - mean of its group) / (std + eps): the std of its
    group, or with `global_std` the std of every valid reward of the batch
    (Flow-GRPO's `sample.global_std`). Both are population stds (ddof 0).

    Invalid samples (masked rewards) are left out of the group statistics and
    get no advantage; a group with no valid sample is dropped entirely. A group
    whose valid rewards are all equal (one valid sample, or a saturated reward)
    has nothing to compare: its advantages are exactly 0, not the float residue
    of (r - mean) / (0 + eps), and its samples are not usable, so they stay out
    of the loss's denominator (Flow-GRPO drops zero-advantage samples the same
    way). `usable` marks the samples that carry a training signal.
    """
    adv, usable = _group_advantages(rewards.float(), group_ids, valid, eps, clip, global_std)
    if not torch.isfinite(adv).all():
        # Finite float32 rewards near its limit (3.4e38), whose sums or squares overflow in float32: every
        # advantage came out NaN and the run stopped at "the gradient norm is nan". Again in float64, only then,
        # so that every other batch keeps float32's numbers bit for bit.
        adv, usable = _group_advantages(rewards.double(), group_ids, valid, eps, clip, global_std)
    return adv.float(), usable


def _group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None, eps: float,
                      clip: float | None, global_std: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_advantages` in the dtype of `rewards`."""
    if valid is None:
        valid = torch.isfinite(rewards)
    valid = valid & torch.isfinite(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    w = valid.to(r.dtype)
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, group, w)
    total = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, group, r)
    mean = total / count.clamp(min=1)
    if global_std:
        n_valid = w.sum().clamp(min=1)
        std = torch.sqrt((w * (r - (w * r).sum() / n_valid) ** 2).sum() / n_valid).expand(n_groups)
    else:
        sq = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, group, w * (r - mean[group]) ** 2)
        std = torch.sqrt(sq / count.clamp(min=1))
    adv = (r - mean[group]) / (std[group] + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    usable = valid & group_has_spread(r, group, valid, n_groups)
    adv = torch.where(usable, adv, torch.zeros_like(adv))
    return adv, usable


def group_has_spread(rewards: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per sample [N]: whether the valid rewards of its group (dense ids in [0, n_groups)) are not all equal."""
    inf = torch.full((n_groups,), float("inf"), dtype=rewards.dtype, device=rewards.device)
    low = inf.scatter_reduce(0, group, torch.where(valid, rewards, inf[group]), "amin")
    high = (-inf).scatter_reduce(0, group, torch.where(valid, rewards, -inf[group]), "amax")
    return (high > low)[group]


def flat_group_count(group_ids: torch.Tensor, valid: torch.Tensor, usable: torch.Tensor) -> int:
    """Groups with at least one valid sample but no usable one: every valid reward equal (zero std)."""
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    has_valid = torch.zeros(n_groups, dtype=torch.bool, device=group.device).index_put_((group,), valid.bool(),
                                                                                       accumulate=True)
    has_usable = torch.zeros(n_groups, dtype=torch.bool, device=group.device).index_put_((group,), usable.bool(),
                                                                                        accumulate=True)
    return int((has_valid & ~has_usable).sum())


def distributed_group_advantages(local_rewards: torch.Tensor, local_group_ids: torch.Tensor,
                                 local_valid: torch.Tensor, eps: float = 1e-4, clip: float | None = None,
                                 global_std: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_advantages` over the samples of every rank; returns this rank's slice.

    Every rank must hold the same number of samples, laid out so that rank r
    holds global rows [r·n, (r+1)·n).
    """
    rank, _ = rank_and_world()
    n = local_rewards.shape[0]
    rewards = all_gather_cat(local_rewards.float())
    group_ids = all_gather_cat(local_group_ids.long())
    valid = all_gather_cat(local_valid.to(torch.uint8)).bool()
    adv, usable = group_advantages(rewards, group_ids, valid, eps=eps, clip=clip, global_std=global_std)
    return adv[rank * n:(rank + 1) * n], usable[rank * n:(rank + 1) * n]


def reward_advantages(scores: dict[str, torch.Tensor], weights: dict[str, float], total: torch.Tensor,
                      valid: torch.Tensor, group_ids: torch.Tensor, mode: str = "weighted_sum",
                      eps: float = 1e-4, clip: float | None = None,
                      global_std: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], usable [N]) of a multi-reward batch under a combination mode.

    "weighted_sum": group-normalise the weighted total. "sum_of_advantages":
    group-normalise each scorer's raw scores on its own, then sum with the
    weights (clipping applies to the sum); a sample is usable when any scorer's
    rewards vary within its group. Either way a sample any scorer masked is left
    out of every group statistic and gets no advantage, and a group with no
    valid sample is dropped.
    """
    if mode == "weighted_sum":
        return group_advantages(total, group_ids, valid, eps=eps, clip=clip, global_std=global_std)
    if mode == "gdpo":  # per-scorer validity (its scores' NaNs), see gdpo_advantages
        return gdpo_advantages(scores, weights, group_ids, clip=clip)
    if mode != "sum_of_advantages":
        raise ValueError(f"reward combination mode {mode!r} is not known; valid modes: weighted_sum, "
                         "sum_of_advantages, gdpo")
    adv = torch.zeros(total.shape[0], dtype=torch.float32, device=total.device)
    usable = torch.zeros_like(valid, dtype=torch.bool)
    for name, weight in weights.items():
        per, per_usable = group_advantages(scores[name], group_ids, valid, eps=eps, global_std=global_std)
        adv = adv + weight * per
        usable |= per_usable
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    usable &= valid
    return torch.where(usable, adv, torch.zeros_like(adv)), usable


def distributed_reward_advantages(batch, local_group_ids: torch.Tensor, eps: float = 1e-4,
                                  clip: float | None = None,
                                  global_std: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`reward_advantages` of a `RewardBatch` over every rank's samples; returns this rank's slice."""
    if batch.mode == "weighted_sum":  # one gathered tensor is enough
        return distributed_group_advantages(batch.total, local_group_ids, batch.valid, eps=eps, clip=clip,
                                            global_std=global_std)
    rank, _ = rank_and_world()
    n = len(batch)
    gather = lambda t: all_gather_cat(t.float())  # noqa: E731
    valid = all_gather_cat(batch.valid.to(torch.uint8)).bool()
    scores = {name: gather(batch.scores[name]) for name in batch.scorer_ids}
    adv, usable = reward_advantages(scores, batch.weights, gather(batch.total), valid,
                                    all_gather_cat(local_group_ids.long()), mode=batch.mode, eps=eps, clip=clip,
                                    global_std=global_std)
    return adv[rank * n:(rank + 1) * n], usable[rank * n:(rank + 1) * n]


GDPO_STD_FLOOR = 1e-6


def gdpo_group_normalise(scores: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, n_groups: int,
                         floor: float = GDPO_STD_FLOOR) -> torch.Tensor:
    """(r - group mean) / max(group population std, floor) over the valid rows of each group; 0 elsewhere.

    Float64: the later batch normalisation divides by a std that can be small.
    """
    w = valid.double()
    r = torch.where(valid, scores.double(), torch.zeros_like(scores, dtype=torch.float64))
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, group, w).clamp(min=1)
    mean = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, group, r) / count
    sq = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, group, w * (r - mean[group]) ** 2)
    std = torch.sqrt(sq / count).clamp(min=floor)
    return torch.where(valid, (r - mean[group]) / std[group], torch.zeros_like(r))


def gdpo_advantages(scores: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                    clip: float | None = None, floor: float = GDPO_STD_FLOOR) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], usable [N]) by GDPO (Group reward-Decoupled normalisation Policy Optimization).

    1. Each scorer's scores are normalised within each group: (r - mean) / max(std, floor),
       population std over the rows it scored (Flow-Factory's floor is 1e-6).
    2. The normalised scores are summed with the weights.
    3. The sum is normalised over the batch: (s - mean) / max(std, floor) over the rows kept.

    A scorer's NaN rows (it failed, or does not apply to that sample) are left out of its own
    group statistics and add 0 to the sum, which is what a scorer with no spread in a group adds;
    a row that no scorer scored gets no advantage. Flow-Factory has no such rows: its reward
    processor asserts that every reward scored every sample. A group in which no scorer's scores
    vary carries no signal: its rows are not usable and their advantage is exactly 0 (as in
    `group_advantages`), though the batch normalisation would shift them off 0.
    """
    names = list(weights)
    if not names:
        raise ValueError("gdpo needs at least one scorer")
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    combined = torch.zeros(group.shape[0], dtype=torch.float64, device=group.device)
    scored_any = torch.zeros(group.shape[0], dtype=torch.bool, device=group.device)
    spread = torch.zeros_like(scored_any)
    for name in names:
        ok = torch.isfinite(scores[name]).to(group.device)
        values = scores[name].to(group.device)
        combined += weights[name] * gdpo_group_normalise(values, group, ok, n_groups, floor)
        scored_any |= ok
        spread |= ok & group_has_spread(torch.where(ok, values, torch.zeros_like(values)).float(), group, ok,
                                        n_groups)
    kept = combined[scored_any]
    if kept.numel():
        mean = kept.mean()
        std = kept.std(correction=0).clamp(min=floor)
        combined = (combined - mean) / std
    adv = combined.float()
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    usable = scored_any & spread
    return torch.where(usable, adv, torch.zeros_like(adv)), usable


def kept_per_group(size: int, fraction: float) -> int:
    """How many of a group's `size` candidates max-variance down-sampling keeps: round(fraction·size), at least 2
    (one sample has no variance to maximise), at most size."""
    return min(size, max(2, round(fraction * size)))


def max_variance_subset(values: torch.Tensor, group_ids: torch.Tensor, fraction: float,
                        candidates: torch.Tensor | None = None) -> torch.Tensor:
    """PODS' max-variance down-sampling (Xu et al., arXiv 2504.13818): per group, the m = `kept_per_group(n,
    fraction)` of its n candidates whose `values` have the largest variance; a mask [N].

    Such a subset is always the i largest and m - i smallest values for some i (the paper's result, which gives it
    an O(n log n) algorithm), so each group sorts once and tries the m + 1 splits, a variance each (cheap for
    groups of tens); ties go to the smallest i and the stable sort, so the result is deterministic.
    `values` are rewards or, equivalently within a group, advantages (an affine map of them). Samples that are not
    `candidates` (masked rewards) are never kept and do not count in n.
    """
    keep = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    candidates = torch.ones_like(keep) if candidates is None else candidates.bool().to(values.device)
    group_ids = group_ids.to(values.device)
    for g in torch.unique(group_ids):
        rows = ((group_ids == g) & candidates).nonzero().flatten()
        if len(rows) == 0:
            continue
        m = kept_per_group(len(rows), fraction)
        order = rows[torch.argsort(values[rows].double(), stable=True)]
        ranked = values[order].double()
        best, best_i = None, 0
        for i in range(m + 1):  # i from the top, m - i from the bottom
            chosen = torch.cat([ranked[:m - i], ranked[len(ranked) - i:]])
            variance = float(chosen.var(unbiased=False))
            if best is None or variance > best + 1e-12:
                best, best_i = variance, i
        keep[order[:m - best_i]] = True
        keep[order[len(order) - best_i:]] = True
    return keep
