"""The AWM recipe end to end on the toy task: learning signal, exact resume with the EMA anchor, LoRA, the
launcher, --help, and the config checks."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flywheel.runs.config import ConfigError, parse_config
from flywheel.runs.rundir import read_metrics
from trainers.awm import ANCHOR_PREFIX, Config, ema_anchor, main, validate_config

from launched import run_process_group
from recipe_kill import checkpoint, dotted_keys, negate_advantages

ROOT = Path(__file__).resolve().parents[1]
# Two flow times per sample instead of six: a quarter of the default's training forwards.
QUICK = ["tracker=none", "eval.seeds=2", "train.timesteps_per_sample=2", "save_every=1000",
         "sample_every=1000"]
SMALL = ["data.prompts_per_step=4", "data.group_size=8"]
CHECKPOINTED = "recipe/" + ANCHOR_PREFIX  # where RecipeRun.save puts the recipe's tensors


def run(tmp_path, name, *overrides):
    result = main([f"run_dir={tmp_path / name}", *QUICK, *overrides])
    return result, read_metrics(tmp_path / name / "metrics.jsonl")








# ---- the learning signal --------------------------------------------------------------------


@pytest.mark.slow
def test_reward_and_judge_rise_and_negated_advantages_make_the_reward_fall(tmp_path, monkeypatch):
    """An honest control: the same run with the advantage sign flipped must go the other way."""
    steps = ["steps=12", "eval.every=12", "train.learning_rate=1e-3"]
    real, _ = run(tmp_path, "real", *steps)
    negate_advantages(monkeypatch)
    control, _ = run(tmp_path, "negated", *steps)
    base, final, worse = real["base"], real["final"], control["final"]
    assert control["base"]["eval/reward/mean"] == base["eval/reward/mean"]  # same seed, same start
    assert final["eval/reward/mean"] > base["eval/reward/mean"] + 0.15
    assert final["eval/judge/digit_svc/mean"] > base["eval/judge/digit_svc/mean"] + 0.05
    assert worse["eval/reward/mean"] < base["eval/reward/mean"] - 0.05


# ---- metrics, the launcher ------------------------------------------------------------------


def test_accelerate_launch_runs_and_writes_the_shared_metric_keys(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = run_process_group([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
                          "trainers/awm.py", "steps=2",
                          "eval.every=2", f"run_dir={tmp_path / 'launched'}", *QUICK, *SMALL, "eval.seeds=1",
                          "train.kl_beta=0.01"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "launched" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["weight_version"] for r in rows] == [0, 0, 1]  # the version that made each step's rollouts
    assert [r["weight_version_after"] for r in rows[1:]] == [1, 2]  # one optimizer step (and sync) per rollout
    for key in ("reward/mean", "loss", "policy_loss", "ref_mse", "anchor_mse", "matching_error", "matching_error/positive",
                "matching_error/negative", "t/mean", "grad_norm", "anchor/decay", "time/train_s", "time/wall_s"):
        assert all(key in r for r in rows[1:]), key
    assert rows[1]["ref_mse"] == 0.0 and rows[2]["ref_mse"] > 0.0  # the policy starts at the reference, then leaves it
    # The anchor starts at the weights: the first step's anchor term is 0; the decay ramps 0.001 a step.
    assert rows[1]["anchor_mse"] == 0.0
    assert [r["anchor/decay"] for r in rows[1:]] == pytest.approx([0.001, 0.002])
    for row in (rows[0], rows[2]):
        assert "eval/reward/mean" in row and "eval/judge/digit_svc/mean" in row
    assert json.loads((tmp_path / "launched" / "run.json").read_text()) == {"recipe": "awm", "card": "toy-digits"}
    saved = checkpoint(tmp_path / "launched", 2)
    anchor = {k[len(CHECKPOINTED):] for k in saved if k.startswith(CHECKPOINTED)}
    assert anchor and anchor == {k for k in saved if not k.startswith("recipe/")}


def test_help_lists_every_key():
    out = subprocess.run([sys.executable, "trainers/awm.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    keys = dotted_keys(Config)
    assert "train.anchor_beta" in keys and "sampling.sampler" in keys and "train.learning_rate" in keys
    missing = [k for k in keys if k not in out.stdout]
    assert not missing, missing


# ---- LoRA ---------------------------------------------------------------------------------------


def test_lora_trains_only_the_adapter_and_its_anchor(tmp_path):
    from engine import load_model

    _, rows = run(tmp_path, "lora", "model.finetune=lora", "train.learning_rate=1e-3", "steps=2", "eval.every=2",
                  "save_every=2", "train.kl_beta=0.01", *SMALL)
    saved = checkpoint(tmp_path / "lora", 2)
    trained = {k: v for k, v in saved.items() if not k.startswith("recipe/")}
    assert trained and all("lora_" in k for k in trained)
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in trained.items())
    assert {k[len(CHECKPOINTED):] for k in saved if k.startswith(CHECKPOINTED)} == trained.keys()
    base = load_model("toy-digits").transformer.state_dict()
    assert all(k.replace(".base_layer", "") in base or "lora_" in k for k in trained)
    # LoRA B starts at zero: the adapted model is the reference (the adapter switched off), so the first KL is 0.
    assert rows[1]["ref_mse"] == 0.0 and rows[2]["ref_mse"] > 0.0
    # The toy card has no diffusers pipeline: lora/ holds peft's tensors, the trained adapter (it was not written).
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "lora" / "lora" / "adapter_model.safetensors"))
    assert exported.keys() and all("lora_" in k for k in exported)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in exported.items())


# ---- config checks ------------------------------------------------------------------------------


def config_problems(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(Config, list(overrides)))
    return str(err.value)


def test_defaults_are_valid_and_sample_with_the_ode():
    cfg = parse_config(Config, [])
    validate_config(cfg)
    assert cfg.sampling.sampler == "ode" and cfg.model.card == "toy-digits" and cfg.run_dir == "runs/awm-toy"


@pytest.mark.parametrize("override, named", [
    ("train.kl_beta=-0.1", "train.kl_beta=-0.1: must be >= 0"),
    ("train.anchor_beta=-1", "train.anchor_beta=-1"),
    ("train.anchor_decay=1.0", "train.anchor_decay=1.0: must be in [0, 1)"),
    ("train.anchor_decay_ramp=-0.5", "train.anchor_decay_ramp=-0.5"),
    # A decay of 0 at every step resets the anchor to the weights after each: with one optimizer step a
    # step its term was exactly 0 (anchor_mse 0.0 at every step), and the run reported success.
    ("train.anchor_decay=0", "train.anchor_decay=0 with train.anchor_beta=1 and one optimizer step a rollout: the "
                             "anchor's decay is 0 at every step"),
    ("train.anchor_decay_ramp=0", "train.anchor_decay_ramp=0 with train.anchor_beta=1 and one optimizer step"),
    ("train.ghuber_power=0", "train.ghuber_power=0"),
    ("train.timesteps_per_sample=0", "train.timesteps_per_sample=0"),
    ("train.timestep_fraction=0", "train.timestep_fraction=0"),
    ("train.uniform_t_min=1.0", "train.uniform_t_min=1.0"),
    ("train.advantage_max=0", "train.advantage_max=0"),
    ("train.learning_rate=nan", "train.learning_rate=nan: must be a finite number"),
    # 4 steps, fraction 0.9, step 0 skipped: step indices 1..2, two eligible steps for six strata.
    ("sampling.steps=4", "train.timesteps_per_sample=6 needs at least 6 eligible steps, but a 4-step rollout"),
    ("rollout.asynchronous=true", "rollout.asynchronous=true: AWM trains on-policy"),
])
def test_each_bad_field_is_named_with_what_is_valid(override, named):
    assert named in config_problems(override)


def test_all_problems_are_reported_at_once_and_feasible_strata_pass():
    message = config_problems("steps=0", "train.kl_beta=-1", "sampling.steps=3")
    assert "steps=0" in message and "train.kl_beta=-1" in message and "3-step rollout" in message
    # Uniform time sampling needs no strata of the schedule; advantage_max=null keeps the advantages.
    validate_config(parse_config(Config, ["sampling.steps=3", "train.time_sampling=uniform",
                                          "train.advantage_max=null"]))
    validate_config(parse_config(Config, ["sampling.steps=7", "train.skip_first_step=false"]))  # indices 0..5
    # With several optimizer steps a rollout the later ones see the weights move away from a decay-0 anchor.
    validate_config(parse_config(Config, ["train.anchor_decay=0", "train.minibatch_size=32"]))


def test_a_checkpoint_without_an_anchor_is_refused_when_the_anchor_is_on():
    from flywheel.recipe.policy import Policy

    layer = torch.nn.Linear(2, 1)
    policy = Policy(None, list(layer.named_parameters()), None, {})
    tc = Config().train
    assert ema_anchor(policy, dataclasses.replace(tc, anchor_beta=0.0), {}) is None
    with pytest.raises(ValueError, match="holds no EMA anchor"):
        ema_anchor(policy, tc, {"sampling_policy/weight": torch.zeros(1, 2)})
    saved = {ANCHOR_PREFIX + "weight": torch.full((1, 2), 3.0), ANCHOR_PREFIX + "bias": torch.full((1,), -1.0)}
    anchor = ema_anchor(policy, tc, saved)
    assert torch.equal(anchor.shadow["weight"], torch.full((1, 2), 3.0))
    assert not torch.equal(layer.weight.detach(), anchor.shadow["weight"])  # the weights are left alone


# ---- shipped configs ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*_awm.yaml")), ids=lambda p: p.name)
def test_shipped_awm_configs_are_valid(path):
    validate_config(parse_config(Config, ["--config", str(path)]))


def test_toy_config_is_the_default_run_written_out():
    assert parse_config(Config, ["--config", str(ROOT / "configs" / "toy_awm.yaml")]) == parse_config(Config, [])
    assert parse_config(Config, []).steps == 35  # eval/diversity still >= half the base's (docs/recipes/awm.md)
