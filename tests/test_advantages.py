"""Group advantages: statistics, masking, and the same numbers on 1 and 2 ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from flywheel.advantages import group_advantages

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


def test_masked_samples_are_left_out_and_empty_groups_dropped():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 5.0, 7.0, float("nan"), float("nan")])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    valid = torch.tensor([True, False, True, True, False, False, False])
    adv, usable = group_advantages(rewards, groups, valid)
    assert usable.tolist() == [True, False, True, True, False, False, False]
    torch.testing.assert_close(adv[[0, 2]], torch.tensor([-1.0, 1.0]), atol=1e-3, rtol=0)
    assert adv[3] == 0  # one valid sample: nothing to compare against
    assert torch.isfinite(adv).all() and (adv[~usable] == 0).all()


def test_clip_and_interleaved_group_ids():
    rewards = torch.tensor([0.0, 100.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([5, 5, 5, 5, 5, 5, 5, 5])
    adv, _ = group_advantages(rewards, groups, clip=2.0)
    assert adv.max() == 2.0
    a, _ = group_advantages(torch.tensor([1.0, 9.0, 2.0, 8.0]), torch.tensor([3, 7, 3, 7]))
    torch.testing.assert_close(a, torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-3, rtol=0)


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
