"""Combination modes and masking: NaN and raising scorers are masked all the way to the advantages."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.advantages import group_advantages, reward_advantages
from flywheel.rollout_collector import Flywheel
from flywheel.prompts import PromptItem, PromptSampler
from rewards import RewardBatch, RewardSet
from rewards.registry import register, unregister

GROUP = 4
PROMPTS = [PromptItem("zero", {"digit": 0}), PromptItem("one", {"digit": 1}), PromptItem("two", {"digit": 2})]


class Brightness:
    """Mean pixel value x scale; NaN on rows of the prompts in `nan_prompts`."""

    def __init__(self, scale: float = 1.0, nan_prompts: tuple[str, ...] = (), nan_rows: tuple[int, ...] = ()):
        self.scale, self.nan_prompts, self.nan_rows = scale, nan_prompts, nan_rows

    def __call__(self, images, prompts, metadata):
        out = images.float().mean(dim=(1, 2, 3)) * self.scale
        for i, p in enumerate(prompts):
            if p in self.nan_prompts or i in self.nan_rows:
                out[i] = float("nan")
        return out


class Raises:
    def __call__(self, images, prompts, metadata):
        raise RuntimeError("scorer crashed")


@pytest.fixture
def scorers():
    names = {"bright": lambda **kw: Brightness(**kw), "raises": lambda **kw: Raises()}
    for name, factory in names.items():
        register(name, factory, replace=True)
    yield
    for name in names:
        unregister(name)


def make_flywheel(engine, reward_set, **kwargs) -> Flywheel:
    return Flywheel(engine, reward_set, PromptSampler(PROMPTS, prompts_per_step=3, seed=0),
                    GROUP,
                    request_kwargs=dict(steps=3, sampler="sde", noise_level=0.7), seed=1, **kwargs)


def test_sum_of_advantages_is_the_weighted_sum_of_per_reward_advantages():
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    a = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
    b = torch.tensor([100.0, 300.0, 200.0, 10.0, 20.0, 30.0])  # a much larger raw scale
    valid = torch.ones(6, dtype=torch.bool)
    weights = {"a": 1.0, "b": 0.5}
    total = a + 0.5 * b
    adv, usable = reward_advantages({"a": a, "b": b}, weights, total, valid, group_ids, mode="sum_of_advantages")
    expected = group_advantages(a, group_ids)[0] + 0.5 * group_advantages(b, group_ids)[0]
    torch.testing.assert_close(adv, expected)
    assert usable.all()
    # The weighted sum of raw scores is dominated by b; the sum of advantages is not.
    ws, _ = reward_advantages({"a": a, "b": b}, weights, total, valid, group_ids, mode="weighted_sum")
    torch.testing.assert_close(ws, group_advantages(total, group_ids)[0])
    assert torch.argmax(ws[:3]) == 1 and torch.argmax(adv[:3]) == 2
    with pytest.raises(ValueError, match="sum_of_advantages"):
        reward_advantages({"a": a}, {"a": 1.0}, a, valid, group_ids, mode="product")


def test_unknown_mode_is_an_error_naming_the_valid_ones():
    with pytest.raises(ValueError, match="weighted_sum, sum_of_advantages"):
        RewardSet("jpeg_compressibility", mode="max")


def _normalised(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO's group advantage of one group's rewards, written out: (r - mean) / (population std + 1e-4)."""
    r = rewards.double()
    return (r - r.mean()) / (r.std(correction=0) + 1e-4)


@pytest.mark.parametrize("mode", ["weighted_sum", "sum_of_advantages"])
def test_nan_and_exceptions_are_masked_through_to_the_advantages(toy_engine, scorers, mode):
    # "bright" is NaN on every sample of prompt "one" (a whole group) and on local row 1.
    reward_set = RewardSet("bright:1.0,jpeg_compressibility:0.2", mode=mode,
                           scorer_kwargs={"bright": {"nan_prompts": ("one",), "nan_rows": (1,)}})
    batch = make_flywheel(toy_engine, reward_set).collect(step=0)
    prompts = batch.trajectory.prompts
    dead = torch.tensor([p == "one" for p in prompts])
    dead[1] = True
    assert batch.rewards.mode == mode
    assert torch.equal(batch.rewards.valid, ~dead) and torch.equal(batch.usable, ~dead)
    assert (batch.advantages[dead] == 0).all() and torch.isnan(batch.rewards.total[dead]).all()
    assert batch.metrics["reward/bright/invalid"] == float(dead.sum())
    assert batch.metrics["reward/jpeg_compressibility/invalid"] == 0.0
    # Per-scorer means and stds over valid rows are in the metrics.
    bright = batch.rewards.scores["bright"][~dead]
    assert batch.metrics["reward/bright/mean"] == pytest.approx(bright.mean().item())
    assert batch.metrics["reward/bright/std"] == pytest.approx(bright.std(correction=0).item())
    # The groups, from the row layout alone: prompts_per_step (3) prompts, each one's GROUP samples in
    # consecutive rows. The data agree: each block holds one prompt, and the three blocks three prompts.
    gids = torch.arange(3 * GROUP) // GROUP
    blocks = [set(prompts[g * GROUP:(g + 1) * GROUP]) for g in range(3)]
    assert all(len(b) == 1 for b in blocks) and len(set.union(*blocks)) == 3
    assert torch.equal(batch.group_ids.cpu(), gids)
    # The remaining samples are normalised among the valid members of their own group only:
    # (r - group mean) / (population std + 1e-4), computed here in float64.
    weights = {"bright": 1.0, "jpeg_compressibility": 0.2}
    checked = 0
    for g in range(3):
        members = (gids == g) & ~dead
        if members.sum() < 2:
            continue
        if mode == "weighted_sum":
            expected = _normalised(batch.rewards.total[members])
        else:
            expected = sum(w * _normalised(batch.rewards.scores[n][members]) for n, w in weights.items())
        torch.testing.assert_close(batch.advantages[members].double(), expected, rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked == 2  # the groups of "zero" and "two"; "one" is all masked


@pytest.mark.parametrize("mode", ["weighted_sum", "sum_of_advantages"])
def test_a_raising_scorer_masks_its_batch_and_every_group_is_dropped(toy_engine, scorers, mode):
    reward_set = RewardSet("bright:1.0,raises:0.5", mode=mode)
    batch = make_flywheel(toy_engine, reward_set).collect(step=0)
    assert not batch.rewards.valid.any() and not batch.usable.any()
    assert (batch.advantages == 0).all()  # dropped, and nothing to train on; not zeros posing as data
    assert "scorer crashed" in batch.rewards.errors["raises"]
    assert batch.metrics["reward/raises/invalid"] == 3 * GROUP and batch.metrics["reward/bright/invalid"] == 0
    assert math.isnan(batch.metrics["reward/mean"])
    assert batch.metrics["reward/usable"] == 0.0


def test_reward_batch_concat_keeps_order_and_refuses_mixed_sets(scorers):
    reward_set = RewardSet("bright", scorer_kwargs={"bright": {"nan_rows": (0,)}})
    images = torch.rand(4, 1, 8, 8)
    whole = reward_set.score(images, ["x"] * 4, None, weight_version=2)
    parts = [reward_set.score(images[:2], ["x"] * 2, None, 2), reward_set.score(images[2:], ["x"] * 2, None, 2)]
    joined = RewardBatch.concat(parts)
    assert torch.equal(joined.valid, torch.tensor([False, True, False, True]))  # row 0 of each chunk
    torch.testing.assert_close(joined.scores["bright"][1:2], whole.scores["bright"][1:2])
    with pytest.raises(ValueError, match="weight versions"):
        RewardBatch.concat([parts[0], reward_set.score(images[:2], ["x"] * 2, None, 3)])
