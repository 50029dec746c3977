"""Group advantages: statistics, masking, and the same numbers on 1 and 2 ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import itertools

import pytest

from flywheel.advantages import (flat_group_count, group_advantages, kept_per_group, max_variance_subset,
                                  reward_advantages)

ROOT = Path(__file__).resolve().parents[1]


def test_group_advantages_match_a_direct_computation():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, usable = group_advantages(rewards, groups)
    for g in (0, 1):
        r = rewards[groups == g]
        expected = (r - r.mean()) / (r.std(correction=0) + 1e-4)
        torch.testing.assert_close(adv[groups == g], expected)
    assert usable.all()


def test_finite_rewards_near_float32s_limit_give_the_advantages_of_any_scale():
    """Group statistics in float64: rewards up to 1.2e38 are finite float32, but their squared deviations are
    not, and in float32 every advantage came out NaN (the run then stopped on "the gradient norm is nan")."""
    base = torch.tensor([1.0, 2.0, 3.0, 4.0, 2.0, 2.0, 5.0, 7.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    huge = base * 3e37
    assert torch.isfinite(huge).all()
    adv, usable = group_advantages(huge, groups)
    # (r - mean) / std in each group: group 0 is [-3, -1, 1, 3] / sqrt(5), group 1 [-2, -2, 1, 3] / sqrt(4.5).
    expected = torch.tensor([-3, -1, 1, 3, -2, -2, 1, 3]) / torch.tensor([5.0] * 4 + [4.5] * 4).sqrt()
    torch.testing.assert_close(adv, expected)
    assert adv.dtype == torch.float32 and usable.all()
    adv_global, _ = group_advantages(huge, groups, global_std=True)
    assert torch.isfinite(adv_global).all()


def test_masked_samples_are_left_out_and_empty_groups_dropped():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 5.0, 7.0, float("nan"), float("nan")])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    valid = torch.tensor([True, False, True, True, False, False, False])
    adv, usable = group_advantages(rewards, groups, valid)
    # Group 1 keeps one valid sample: nothing to compare against, so no signal and out of the loss.
    assert usable.tolist() == [True, False, True, False, False, False, False]
    torch.testing.assert_close(adv[[0, 2]], torch.tensor([-1.0, 1.0]), atol=1e-3, rtol=0)
    assert adv[3] == 0
    assert torch.isfinite(adv).all() and (adv[~usable] == 0).all()


def test_clip_and_interleaved_group_ids():
    rewards = torch.tensor([0.0, 100.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([5, 5, 5, 5, 5, 5, 5, 5])
    adv, _ = group_advantages(rewards, groups, clip=2.0)
    assert adv.max() == 2.0
    a, _ = group_advantages(torch.tensor([1.0, 9.0, 2.0, 8.0]), torch.tensor([3, 7, 3, 7]))
    torch.testing.assert_close(a, torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-3, rtol=0)


def test_groups_with_one_reward_value_get_exactly_zero_and_leave_the_loss():
    # fp32 means of 16 copies of 0.987654 are off by an ulp: (r - mean) / (0 + eps) was 1.8e-3, not 0.
    rewards = torch.cat([torch.full((16,), 0.987654), torch.linspace(0, 1, 16)])
    groups = torch.arange(32) // 16
    adv, usable = group_advantages(rewards, groups)
    assert torch.equal(adv[:16], torch.zeros(16)) and not usable[:16].any()
    assert usable[16:].all() and adv[16:].abs().sum() > 10
    assert flat_group_count(groups, torch.ones(32, dtype=torch.bool), usable) == 1
    # sum_of_advantages: a group flat in one scorer still trains on the other.
    scores = {"a": rewards, "b": torch.cat([torch.linspace(0, 1, 16), torch.full((16,), 0.5)])}
    adv2, usable2 = reward_advantages(scores, {"a": 1.0, "b": 1.0}, rewards, torch.ones(32, dtype=torch.bool),
                                      groups, mode="sum_of_advantages")
    assert usable2.all()
    torch.testing.assert_close(adv2[:16], group_advantages(scores["b"][:16], groups[:16])[0])


def test_global_std_normalises_by_the_std_of_the_whole_step():
    """Flow-GRPO's sample.global_std: group means, one population std over every valid reward."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0, float("nan")])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    adv, usable = group_advantages(rewards, groups, global_std=True)
    # By hand: means 2 and 11; the 6 valid rewards have mean 6.5 and population std sqrt(24.25).
    std = (sum((x - 6.5) ** 2 for x in [1, 2, 3, 10, 10, 13]) / 6) ** 0.5
    expected = torch.tensor([-1.0, 0.0, 1.0, -1.0, -1.0, 2.0, 0.0]) / (std + 1e-4)
    torch.testing.assert_close(adv, expected)
    assert usable.tolist() == [True] * 6 + [False]


WORKER = r"""
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
from flywheel.advantages import distributed_group_advantages
rank, world = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(0)
rewards = torch.rand(24, generator=g)
rewards[5] = float("nan")
groups = torch.arange(24) // 8  # groups of 8: group 1 spans rows 8..15, across the rank boundary at 12
n = 24 // world
sl = slice(rank * n, (rank + 1) * n)
adv, usable = distributed_group_advantages(rewards[sl], groups[sl], torch.isfinite(rewards[sl]), clip=5.0)
parts = [torch.empty_like(adv) for _ in range(world)]
dist.all_gather(parts, adv)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(torch.cat(parts).tolist(), f)
dist.destroy_process_group()
"""


def test_distributed_advantages_equal_single_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "adv.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
                    str(script), str(out)], check=True, env=env, cwd=tmp_path, timeout=120,
                   capture_output=True)
    two_ranks = torch.tensor(json.loads(out.read_text()))
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g)
    rewards[5] = float("nan")
    one_rank, _ = group_advantages(rewards, torch.arange(24) // 8, torch.isfinite(rewards), clip=5.0)
    assert torch.equal(two_ranks, one_rank)


# ---- PODS' max-variance down-sampling ---------------------------------------------------------------------


def test_max_variance_subset_golden_values():
    # Group 0: the two lowest and two highest (variance 0.1525); group 1, skewed: one top and three bottom
    # ({0, 0, 0, 10}: 18.75) beats two and two ({0, 0, 1, 10}: 17.19) and any other split.
    values = torch.tensor([0.1, 0.9, 0.5, 0.2, 0.8, 0.85, 0.3, 0.95, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 10.0])
    groups = torch.arange(16) // 8
    kept = max_variance_subset(values, groups, 0.5)
    assert kept.nonzero().flatten().tolist() == [0, 1, 3, 7, 8, 9, 10, 15]


@pytest.mark.parametrize("seed", range(6))
def test_max_variance_subset_is_the_best_subset_of_every_group(seed):
    # Against all C(n, m) subsets: the kept ones have the largest variance, m of the group's candidates.
    gen = torch.Generator().manual_seed(seed)
    sizes = [5, 7, 8]
    groups = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    values = torch.randn(len(groups), generator=gen).round(decimals=1)  # ties too
    candidates = torch.rand(len(groups), generator=gen) > 0.15
    fraction = [0.3, 0.5, 0.75][seed % 3]
    kept = max_variance_subset(values, groups, fraction, candidates)
    assert not (kept & ~candidates).any()
    for g in range(len(sizes)):
        rows = ((groups == g) & candidates).nonzero().flatten().tolist()
        m = kept_per_group(len(rows), fraction)
        chosen = kept[groups == g].sum().item()
        assert chosen == m
        best = max(float(values[list(c)].double().var(unbiased=False)) for c in itertools.combinations(rows, m))
        got = float(values[kept & (groups == g)].double().var(unbiased=False))
        assert got == pytest.approx(best, abs=1e-12)


def test_kept_per_group_rounds_and_keeps_at_least_two():
    assert [kept_per_group(16, f) for f in (0.75, 0.5, 0.625, 0.01, 1.0)] == [12, 8, 10, 2, 16]
    assert kept_per_group(1, 0.5) == 1 and kept_per_group(0, 0.5) == 0
