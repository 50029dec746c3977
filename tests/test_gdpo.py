"""GDPO aggregation (reward.aggregation=gdpo): per-reward group normalisation, weighted sum, batch normalisation."""

import math

import pytest
import torch

from flywheel.advantages import distributed_reward_advantages, gdpo_advantages, group_advantages, reward_advantages
from flywheel.runs.config import ConfigError, parse_config
from rewards import RewardSet
from trainers.grpo import Config, main, validate_config

NAN = float("nan")
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])


def test_gdpo_golden_values():
    # Group 0: a = 1, 2, 3 and b = 0, 0, 1; group 1: a constant (no signal), b = 2, 4, 6. Worked by hand:
    # a -> [-1.224745, 0, 1.224745 | 0, 0, 0]; b -> [-0.707107, -0.707107, 1.414214 | -1.224745, 0, 1.224745]
    # a + 0.5 b = [-1.578298, -0.353553, 1.931852 | -0.612372, 0, 0.612372], batch mean 0, std 1.087664.
    scores = {"a": torch.tensor([1.0, 2, 3, 5, 5, 5]), "b": torch.tensor([0.0, 0, 1, 2, 4, 6])}
    adv, usable = gdpo_advantages(scores, {"a": 1.0, "b": 0.5}, GROUPS)
    golden = torch.tensor([-1.451087, -0.325058, 1.776145, -0.563016, 0.0, 0.563016])
    assert torch.allclose(adv, golden, atol=2e-6)
    assert usable.all()  # group 1 varies in b
    # The same through reward_advantages and the (one-process) distributed path of a RewardBatch.
    adv2, _ = reward_advantages(scores, {"a": 1.0, "b": 0.5}, scores["a"] + 0.5 * scores["b"],
                                torch.ones(6, dtype=torch.bool), GROUPS, mode="gdpo")
    assert torch.equal(adv2, adv)


def test_gdpo_std_is_floored_at_1e_6_not_added():
    # A spread of 1e-7: the population std 0.5e-7 is floored to 1e-6, so the normalised values are +-0.05
    # (with std + eps they would be ~ +-0.0005, with no floor +-1). The second group gives the batch its scale.
    scores = {"a": torch.tensor([0.0, 1e-7, 0.0, 1.0]), "b": torch.tensor([0.0, 0.0, 0.0, 2.0])}
    groups = torch.tensor([0, 0, 1, 1])
    adv, _ = gdpo_advantages(scores, {"a": 1.0, "b": 0.0}, groups)
    # Before batch normalisation: [-0.05, 0.05, -1, 1]; population std sqrt((2·0.0025 + 2)/4) = 0.707990.
    assert torch.allclose(adv, torch.tensor([-0.05, 0.05, -1.0, 1.0]) / 0.707990, atol=1e-5)


def test_gdpo_one_reward_is_the_group_advantage_and_its_weight_cancels():
    torch.manual_seed(0)
    r = torch.rand(12)
    groups = torch.arange(12) // 4
    plain, _ = group_advantages(r, groups, eps=0.0)
    for weight in (1.0, 0.1, 7.0):
        adv, usable = gdpo_advantages({"a": r}, {"a": weight}, groups)
        # Each group's normalised rewards have mean 0 and variance 1, so the batch normalisation is the identity.
        assert torch.allclose(adv, plain, atol=1e-5) and usable.all()


def test_gdpo_scale_of_one_reward_cannot_drown_the_other():
    """The weighted sum lets a reward with a 1000x scale decide the order; GDPO keeps the other one's say."""
    a = torch.tensor([0.0, 1.0, 0.0, 1.0])  # the reward on a small scale
    b = torch.tensor([0.0, 0.0, 2.0, 1.0]) * 10000  # on a 10000x scale, and blind to what a sees in 0 vs 1
    groups = torch.zeros(4, dtype=torch.long)
    weighted, _ = group_advantages(a + b, groups)
    gdpo, _ = gdpo_advantages({"a": a, "b": b}, {"a": 1.0, "b": 1.0}, groups)
    assert weighted[1] < weighted[0] + 1e-3  # a's preference for sample 1 over 0 is lost in b's scale
    assert gdpo[1] > gdpo[0] + 0.5  # but not in GDPO: a alone tells 0 and 1 apart


def test_gdpo_a_reward_missing_on_some_samples_is_left_out_of_its_statistics():
    # b does not apply to rows 2 and 5 (NaN): its group statistics use the other rows, it adds 0 there,
    # and those rows still train on a. Row 6 has neither reward: no advantage.
    scores = {"a": torch.tensor([1.0, 2, 3, 5, 6, 7, NAN]), "b": torch.tensor([0.0, 2, NAN, 1, 3, NAN, NAN])}
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    adv, usable = gdpo_advantages(scores, {"a": 1.0, "b": 1.0}, groups)
    s = 1.224745
    combined = torch.tensor([-s - 1, 0 + 1, s + 0, -s - 1, 0 + 1, s + 0])  # a normalised + b normalised (b: -1, 1 or 0)
    expected = (combined - combined.mean()) / combined.std(correction=0)
    assert torch.allclose(adv[:6], expected, atol=1e-5)
    assert adv[6] == 0 and not usable[6] and usable[:6].all()


def test_gdpo_a_group_without_spread_is_not_usable_and_gets_exactly_zero():
    scores = {"a": torch.tensor([1.0, 1, 0, 2]), "b": torch.tensor([3.0, 3, 0, 1])}
    adv, usable = gdpo_advantages(scores, {"a": 1.0, "b": 1.0}, torch.tensor([0, 0, 1, 1]), clip=0.9)
    assert usable.tolist() == [False, False, True, True]
    assert adv[:2].tolist() == [0.0, 0.0]
    assert adv[2:].tolist() == pytest.approx([-0.9, 0.9])  # clipped: the group's +-1 after batch normalisation is +-1.414


def test_gdpo_is_a_reward_set_mode_and_a_config_value():
    rewards = RewardSet("digit_alignment:1.0,jpeg_compressibility:0.1", mode="gdpo")
    images = torch.rand(4, 1, 8, 8)
    batch = rewards.score(images, ["the digit 3", "the digit 3", "the digit 5", "the digit 5"], None, 0)
    assert batch.mode == "gdpo"
    adv, _ = distributed_reward_advantages(batch, torch.tensor([0, 0, 1, 1]))
    direct, _ = gdpo_advantages(batch.scores, batch.weights, torch.tensor([0, 0, 1, 1]))
    assert torch.equal(adv, direct)
    cfg = parse_config(Config, ["reward.aggregation=gdpo", "advantage.global_std=true"])
    with pytest.raises(ConfigError, match="global_std.*gdpo"):
        validate_config(cfg)
    with pytest.raises(ConfigError, match="gdpo"):
        parse_config(Config, ["reward.aggregation=gdpx"])


def test_gdpo_grpo_run_trains(tmp_path):
    result = main([f"run_dir={tmp_path / 'g'}", "tracker=none", "steps=2", "eval.every=2", "eval.seeds=1",
                   "data.prompts_per_step=2", "data.group_size=4", "save_every=1000", "sample_every=1000",
                   "reward.scorers=digit_alignment:1.0,jpeg_compressibility:0.1", "reward.aggregation=gdpo"])
    assert math.isfinite(result["final"]["eval/reward/mean"])


@pytest.mark.parametrize("mode", ["gdpo", "sum_of_advantages"])
def test_an_aggregation_over_one_scorer_is_warned_as_doing_nothing(mode, capfd):
    """One scorer: gdpo's and sum_of_advantages' advantages are weighted_sum's up to a constant, which AdamW's step
    does not see (a run with it matched the default to 6 digits, without a word)."""
    validate_config(parse_config(Config, [f"reward.aggregation={mode}"]))
    assert (f"warning: reward.aggregation={mode} with one scorer (digit_alignment:1.0): it combines several "
            "scorers' advantages") in capfd.readouterr().err
    validate_config(parse_config(Config, [f"reward.aggregation={mode}",
                                          "reward.scorers=digit_alignment:1.0,jpeg_compressibility:0.1"]))
    validate_config(parse_config(Config, []))
    assert "reward.aggregation" not in capfd.readouterr().err
