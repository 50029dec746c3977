"""The online Diffusion-DPO recipe end to end on the toy task: learning signal and its swapped-pair control,
exact resume after kill -9, LoRA's reference, the launcher, --help, the config checks and the shipped configs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.runs.config import ConfigError, parse_config
from flywheel.runs.rundir import read_metrics
from trainers.dpo import Config, main, validate_config

from recipe_kill import checkpoint, dotted_keys
from launched import run_process_group

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["tracker=none", "eval.seeds=2", "save_every=1000", "sample_every=1000"]
SMALL = ["data.prompts_per_step=4", "data.group_size=8"]


def run(tmp_path, name, *overrides):
    result = main([f"run_dir={tmp_path / name}", *QUICK, *overrides])
    return result, read_metrics(tmp_path / name / "metrics.jsonl")








# ---- the learning signal --------------------------------------------------------------------


@pytest.mark.slow
def test_reward_and_judge_rise_and_swapped_pairs_make_the_reward_fall(tmp_path):
    """An honest control: the same run with every pair reversed (loser trained as the winner) must go the other way."""
    steps = ["steps=10", "eval.every=10"]
    real, rows = run(tmp_path, "real", *steps)
    control, swapped_rows = run(tmp_path, "swapped", *steps, "train.swap_pairs=true")
    base, final, worse = real["base"], real["final"], control["final"]
    assert control["base"]["eval/reward/mean"] == base["eval/reward/mean"]  # same seed, same start
    assert final["eval/reward/mean"] > base["eval/reward/mean"] + 0.15
    assert final["eval/judge/digit_svc/mean"] > base["eval/judge/digit_svc/mean"] + 0.05
    assert worse["eval/reward/mean"] < base["eval/reward/mean"] - 0.1
    assert all(r["dpo/pairs"] == 8 for r in rows[1:])  # best_worst: one pair per group, 8 groups


# ---- metrics, LoRA's reference, the launcher --------------------------------------------------


@pytest.mark.slow
def test_accelerate_launch_with_lora_writes_the_shared_metric_keys(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = run_process_group([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
                          "trainers/dpo.py", "steps=2",
                          "eval.every=2", "save_every=2", f"run_dir={tmp_path / 'launched'}", *QUICK, *SMALL,
                          "eval.seeds=1", "model.finetune=lora", "train.learning_rate=1e-3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "launched" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["weight_version"] for r in rows] == [0, 0, 1]  # the version that made each step's rollouts
    assert [r["weight_version_after"] for r in rows[1:]] == [1, 2]  # 4 pairs, one minibatch: one step each
    for key in ("reward/mean", "loss", "ref_mse", "dpo/implicit_acc", "dpo/implicit_margin", "dpo/pairs",
                "dpo/groups_used", "dpo/reward_gap", "dpo/no_pair", "dpo/error_w", "dpo/ref_error_l", "t/mean",
                "grad_norm", "time/train_s", "time/wall_s"):
        assert all(key in r for r in rows[1:]), key
    # LoRA B starts at zero: the policy is the reference (the adapter switched off) until the first step.
    assert rows[1]["ref_mse"] == 0.0 and rows[1]["loss"] == pytest.approx(0.693147, abs=1e-6)
    assert rows[1]["dpo/implicit_acc"] == 0.0 and rows[2]["ref_mse"] > 0.0
    for row in (rows[0], rows[2]):
        assert "eval/reward/mean" in row and "eval/judge/digit_svc/mean" in row
    assert json.loads((tmp_path / "launched" / "run.json").read_text()) == {"recipe": "dpo", "card": "toy-digits"}
    trained = checkpoint(tmp_path / "launched", 2)
    assert trained and all("lora_" in k for k in trained)
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in trained.items())


def test_help_lists_every_key():
    out = subprocess.run([sys.executable, "trainers/dpo.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    keys = dotted_keys(Config)
    assert "train.beta" in keys and "train.pairing" in keys and "train.swap_pairs" in keys
    missing = [k for k in keys if k not in out.stdout]
    assert not missing, missing


# ---- config checks ------------------------------------------------------------------------------


def config_problems(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(Config, list(overrides)))
    return str(err.value)


def test_defaults_are_valid_and_sample_with_the_ode():
    cfg = parse_config(Config, [])
    validate_config(cfg)
    assert cfg.sampling.sampler == "ode" and cfg.model.card == "toy-digits" and cfg.run_dir == "runs/dpo-toy"
    assert cfg.train.pairing == "best_worst" and not cfg.train.swap_pairs
    # What keeps the toy default from gaming its reward (docs/recipes/dpo.md): the velocity pull on every row and
    # evaluation of the EMA. No other recipe turns the EMA on by default.
    assert (cfg.train.kl_beta, cfg.train.kl_rows) == (1.0, "all")
    assert cfg.ema.enabled and cfg.ema.decay == 0.85


@pytest.mark.parametrize("override, named", [
    ("train.beta=0", "train.beta=0.0: must be > 0"),
    ("train.beta=-5", "train.beta=-5"),
    ("train.pair_margin=-0.1", "train.pair_margin=-0.1: must be >= 0"),
    ("train.timesteps_per_pair=0", "train.timesteps_per_pair=0: must be an integer in [1, 1000]"),
    ("train.beta=inf", "train.beta=inf: must be a finite number"),
    ("train.kl_beta=-0.5", "train.kl_beta=-0.5: must be >= 0"),
    ("train.kl_beta=nan", "train.kl_beta=nan: must be a finite number"),
    ("train.gradient_accumulation_steps=2", "the number of pairs (so of minibatches) changes from step to step"),
    ("train.updates_per_rollout=2", "train.updates_per_rollout=2"),
    ("reward.aggregation=sum_of_advantages", "reward.aggregation=sum_of_advantages: DPO ranks samples by their total reward"),
    ("rollout.asynchronous=true", "rollout.asynchronous=true"),
])
def test_each_bad_field_is_named_with_what_is_valid(override, named):
    assert named in config_problems(override)


@pytest.mark.parametrize("scorers, margin, refused", [
    ("digit_alignment:1.0", 1.0, True), ("digit_alignment:1.0", 0.99, False),
    ("digit_alignment:2.0", 1.5, False), ("digit_alignment:2.0", 2.0, True),
    # |weight| x (high - low) summed: 0.5 x 2 (a cosine) + 2 x 1 = 3
    ("clip_score:0.5,ocr:-2.0", 2.9, False), ("clip_score:0.5,ocr:-2.0", 3.0, True),
    ("jpeg_compressibility:1.0", 100.0, False),  # no declared range: no bound to check against
    ("digit_alignment:1.0,jpeg_compressibility:1.0", 100.0, False),
])
def test_a_pair_margin_at_or_over_the_rewards_span_is_refused(scorers, margin, refused):
    try:
        validate_config(parse_config(Config, [f"reward.scorers={scorers}", f"train.pair_margin={margin}"]))
        problems = ""
    except ConfigError as err:  # other keys may be named too (clip_score's weights folder): only this one counts
        problems = str(err)
    assert ("no pair can have a reward gap over it" in problems) is refused


def test_kl_beta_zero_alone_is_the_papers_loss():
    """The default pull is on every row (kl_rows=all); kl_beta=0 turns it off without touching kl_rows."""
    cfg = parse_config(Config, ["train.kl_beta=0"])
    validate_config(cfg)
    assert cfg.train.kl_rows == "all" and cfg.train.kl_beta == 0.0


def test_unknown_choices_and_all_problems_at_once():
    with pytest.raises(ConfigError, match="train.pairing"):
        parse_config(Config, ["train.pairing=top_k"])
    with pytest.raises(ConfigError, match="train.time_sampling"):
        parse_config(Config, ["train.time_sampling=cosine"])
    message = config_problems("steps=0", "train.beta=0", "train.pair_margin=-1")
    assert "steps=0" in message and "train.beta=0" in message and "train.pair_margin=-1" in message
    validate_config(parse_config(Config, ["train.updates_per_rollout=1", "train.pairing=all_pairs"]))


def test_minibatch_size_counts_pairs_so_any_size_is_valid():
    # The row recipes refuse a minibatch that does not divide a step's rows; DPO's counts pairs, whose number
    # changes each step, so 7 (128 rows, 16 pairs) is valid here while GRPO refuses it.
    from trainers.grpo import Config as GRPOConfig, validate_config as validate_grpo
    validate_config(parse_config(Config, ["train.minibatch_size=7"]))
    with pytest.raises(ConfigError, match="train.minibatch_size=7 does not divide the 128 rows"):
        validate_grpo(parse_config(GRPOConfig, ["train.minibatch_size=7"]))


# ---- shipped configs ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*_dpo.yaml")), ids=lambda p: p.name)
def test_shipped_dpo_configs_are_valid(path):
    validate_config(parse_config(Config, ["--config", str(path)]))


def test_toy_config_is_the_default_run_written_out():
    assert parse_config(Config, ["--config", str(ROOT / "configs" / "toy_dpo.yaml")]) == parse_config(Config, [])
