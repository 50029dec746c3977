"""The DiffusionNFT recipe end to end on the toy task: config checks, learning signal, exact resume, LoRA, launch."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flywheel.recipe.session import RECIPE_TENSOR_PREFIX
from flywheel.runs.config import ConfigError, apply_overrides, parse_config
from flywheel.runs.rundir import read_metrics
from trainers.nft import Config, main, validate_config

from launched import run_process_group
from recipe_kill import checkpoint, dotted_keys, negate_advantages

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["tracker=none", "eval.seeds=2", "save_every=1000", "sample_every=1000"]
# A small batch (4 prompts x 8) and few denoising steps: seconds per step on one thread.
SMALL = ["data.prompts_per_step=4", "data.group_size=8", "sampling.steps=6"]


def run(tmp_path, name, *overrides):
    result = main([f"run_dir={tmp_path / name}", *QUICK, *overrides])
    return result, read_metrics(tmp_path / name / "metrics.jsonl")




def config_problems(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(Config, list(overrides)))
    return str(err.value)






# ---- config -----------------------------------------------------------------------------------


def test_help_lists_every_key_with_its_doc():
    out = subprocess.run([sys.executable, str(ROOT / "trainers" / "nft.py"), "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    keys = list(dotted_keys(Config))
    assert {"train.beta", "train.eta_rate", "train.kl_beta", "train.learning_rate", "sampling.sampler"} <= set(keys)
    for key in keys:
        assert f"  {key}: " in out.stdout, key
    assert "sampling.sampler: Literal['sde', 'cps', 'ode'] = 'ode'" in out.stdout  # the ODE by default


def test_unknown_key_is_an_error_naming_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        parse_config(Config, ["train.betta=0.5"])
    assert "train.betta" in str(err.value) and "train.beta" in str(err.value)


@pytest.mark.parametrize("override, named", [
    ("sampling.guidance_scale=4.5", "sampling.guidance_scale=4.5: must be 1"),
    ("train.beta=0", "train.beta=0.0: must be > 0"),
    ("train.eta_max=1.5", "train.eta_max=1.5: must be in [0, 1]"),
    ("train.eta_rate=-0.1", "train.eta_rate=-0.1: must be >= 0"),
    ("train.eta_flat_steps=-1", "train.eta_flat_steps=-1: must be an integer >= 0"),
    ("train.kl_beta=-1", "train.kl_beta=-1.0: must be >= 0"),
    ("train.timesteps_per_sample=11", "train.timesteps_per_sample=11: must be in [1, sampling.steps=10]"),
    ("train.timesteps_per_sample=0", "train.timesteps_per_sample=0"),
    ("rollout.asynchronous=true", "rollout.asynchronous=true with this recipe (its engine serves a policy other than the "
                            "trained one)"),
    ("rollout.backend=ray", "rollout.backend=ray with this recipe"),
    ("train.learning_rate=nan", "train.learning_rate=nan: must be a finite number"),
    ("train.downsample_fraction=0", "train.downsample_fraction=0.0: must be in (0, 1]"),
    ("train.downsample_fraction=1.5", "train.downsample_fraction=1.5: must be in (0, 1]"),
])
def test_each_bad_field_is_named_with_what_is_valid(override, named):
    assert named in config_problems(override)


def test_a_down_sampling_that_keeps_every_sample_of_a_group_is_refused():
    # Groups of 2: at least 2 are kept, so any fraction would be ignored. Groups of 4 at 0.5 keep 2.
    assert ("train.downsample_fraction=0.5 keeps every sample of a group of data.group_size=2 (at least 2 are "
            "kept), so it would be ignored") in config_problems("data.group_size=2", "train.downsample_fraction=0.5")
    validate_config(parse_config(Config, ["data.group_size=4", "train.downsample_fraction=0.5"]))


def test_all_problems_come_at_once_and_before_the_run_dir_is_touched(tmp_path):
    message = config_problems("train.beta=-1", "steps=0", "rollout.asynchronous=true")
    assert "train.beta=-1.0" in message and "steps=0" in message and "rollout.asynchronous=true" in message
    with pytest.raises(ConfigError):
        main([f"run_dir={tmp_path / 'r'}", "tracker=none", "train.beta=0"])
    assert not (tmp_path / "r").exists()
    # Uniform flow times are not tied to the rollout grid: more of them than denoising steps is fine.
    validate_config(parse_config(Config, ["train.time_sampling=uniform", "train.timesteps_per_sample=12"]))


def test_beta_where_theta_old_is_theta_at_every_loss_term_is_refused(monkeypatch):
    # eta_max 0 with one optimizer step an update: v_old = v_theta at every term, where the gradient does not
    # depend on beta (tests/test_nft_loss.py), so a beta set there would be ignored.
    message = config_problems("train.eta_max=0", "train.beta=2")
    assert "train.beta=2 with train.eta_max=0 and one optimizer step per update" in message
    assert "set train.eta_max > 0 or train.updates_per_rollout > 1" in message
    numbers = ["--config", str(ROOT / "configs" / "toy_numbers_nft.yaml")]  # ships eta_max 0
    assert "train.beta=0.5 with train.eta_max=0" in config_problems(*numbers, "train.beta=0.5")
    # Where beta acts, it is taken: eta_max > 0, or several optimizer steps an update (theta moves away from
    # theta_old after the first), from updates_per_rollout or from minibatches of each process's rows.
    for acting in (["train.eta_max=0.5"], ["train.updates_per_rollout=2", "train.minibatch_size=64"],
                   ["train.minibatch_size=32"]):
        validate_config(parse_config(Config, [*numbers, "train.beta=2", *acting]))
    validate_config(parse_config(Config, [*numbers, "train.beta=1"]))  # the default, written out
    # Two processes of 64 rows each at minibatch 64: one optimizer step each, so beta is ignored again.
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "train.beta=2 with train.eta_max=0" in config_problems(*numbers, "train.beta=2", "train.minibatch_size=64")
    monkeypatch.setenv("WORLD_SIZE", "1")
    validate_config(parse_config(Config, [*numbers, "train.beta=2", "train.minibatch_size=64"]))


def test_the_shipped_configs_parse_and_the_default_run_is_configs_toy_nft():
    defaults = parse_config(Config, [])
    assert parse_config(Config, ["--config", str(ROOT / "configs" / "toy_nft.yaml")]) == defaults
    assert (defaults.steps, defaults.train.kl_beta) == (55, 0.03)  # no reward hacking (docs/recipes/nft.md)
    validate_config(defaults)
    numbers = parse_config(Config, ["--config", str(ROOT / "configs" / "toy_numbers_nft.yaml")])
    validate_config(numbers)
    assert numbers.model.card == "toy-numbers" and numbers.reward.scorers.startswith("number_alignment")
    # That it agrees with GRPO's on the task and budget: tests/test_time_to_target.py, for every recipe.


# ---- the run ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_reward_and_judge_rise_and_negated_advantages_make_the_reward_fall(tmp_path, monkeypatch):
    """An honest control: the same run with the flywheel's advantages negated (so r = 1 - r) goes the other way."""
    args = ["steps=14", "eval.every=14", "data.prompts_per_step=4", "train.learning_rate=1e-3"]
    real, _ = run(tmp_path, "real", *args)
    negate_advantages(monkeypatch)
    control, _ = run(tmp_path, "negated", *args)
    base = real["base"]["eval/reward/mean"]
    base_judge = real["base"]["eval/judge/digit_svc/mean"]
    assert control["base"]["eval/reward/mean"] == base  # same seed, same start
    # Measured on one thread: reward 0.53 -> 0.79 (judge 0.59 -> 0.78), and 0.53 -> 0.11 with the sign flipped.
    assert real["final"]["eval/reward/mean"] > base + 0.2
    assert real["final"]["eval/judge/digit_svc/mean"] > base_judge + 0.1
    assert control["final"]["eval/reward/mean"] < base - 0.2


def test_rows_carry_the_versions_of_the_sampling_policy_and_the_soft_update(tmp_path):
    # eta = min(0.3·(i + 1), 0.5) after step i (0-based; the released code's schedule, one step later than
    # min(0.3·i, 0.5)): the sampling policy lags the trained one from the first soft update on.
    _, rows = run(tmp_path, "keys", *SMALL, "steps=3", "eval.every=3", "train.eta_rate=0.3",
                  "train.timesteps_per_sample=2")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["weight_version"] for r in rows] == [0, 0, 1, 2]  # the version that made each step's rollouts
    assert [r["nft/eta"] for r in rows[1:]] == [0.3, 0.5, 0.5]
    # Step 1 rolls out the trained weights and takes one optimizer step after all its forwards: v_theta = v_old.
    assert rows[1]["nft/old_deviation"] == 0.0
    # Step 1's soft update already keeps 0.3 of the old policy (eta 0.3): from step 2 on, v_old lags v_theta.
    assert rows[2]["nft/old_deviation"] > 0.0 and rows[3]["nft/old_deviation"] > 0.0
    for key in ("loss", "grad_norm", "nft/r_mean", "nft/trained_samples", "reward/mean", "sync/total_s"):
        assert all(key in r for r in rows[1:]), key
    assert rows[1]["nft/trained_samples"] == 32.0  # every sample of 4 x 8 has a valid reward
    assert "eval/reward/mean" in rows[3] and "eval/judge/digit_svc/mean" in rows[3]
    assert json.loads((tmp_path / "keys" / "run.json").read_text())["recipe"] == "nft"


def test_lora_trains_only_the_adapter_and_its_sampling_policy_is_an_adapter_too(tmp_path):
    from engine import load_model

    _, rows = run(tmp_path, "lora", *SMALL, "model.finetune=lora", "train.learning_rate=1e-3", "steps=2",
                  "eval.every=2", "save_every=2", "train.kl_beta=0.01", "train.timesteps_per_sample=2")
    saved = checkpoint(tmp_path / "lora", 2)
    assert saved and all("lora_" in k for k in saved)
    trained = {k for k in saved if not k.startswith(RECIPE_TENSOR_PREFIX)}
    assert {RECIPE_TENSOR_PREFIX + k for k in trained} == set(saved) - trained  # theta_old: the same adapter names
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in saved.items())
    base = load_model("toy-digits").transformer.state_dict()
    assert all(k.replace(".base_layer", "") in base or "lora_" in k for k in trained)
    # LoRA B starts at zero: the adapted model is the reference at the first forward, so the first KL is 0.
    assert rows[1]["ref_mse"] == 0.0 and rows[2]["ref_mse"] > 0.0


def test_accelerate_launch_runs_the_recipe(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = run_process_group([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
                          "trainers/nft.py", "steps=2",
                          "eval.every=2", f"run_dir={tmp_path / 'launched'}", *QUICK, *SMALL,
                          "train.timesteps_per_sample=2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "launched" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/reward/mean" in rows[2]
    assert "eval reward: base" in out.stdout


# Registers "half_masked": digit_alignment on every sample, except that rank 0 masks the first half of each batch it
# scores (a NaN reward), so the two processes keep different numbers of samples when down-sampling.
RANK_MASKED_RECIPE = """
import os, runpy, sys, torch
from rewards import registry

def half_masked(**kwargs):
    inner = registry.get("digit_alignment")
    def score(images, prompts, metadata):
        out = inner(images, prompts, metadata).clone()
        if os.environ.get("RANK", "0") == "0":
            out[: len(out) // 2] = float("nan")
        return out
    return score

registry.register("half_masked", half_masked)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_two_processes_that_keep_different_numbers_of_samples_take_the_same_optimizer_steps(tmp_path):
    # Rank 0 masks half its rewards, so PODS keeps fewer of its rows than rank 1 keeps of its own. Had the
    # minibatches followed the kept rows, the ranks would all-reduce at different minibatches (a hang, or a
    # gradient averaged with the wrong one); they keep the full update's count (4 of 8 rows each: 4 steps).
    wrapper = tmp_path / "masked_nft.py"
    wrapper.write_text(RANK_MASKED_RECIPE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29541",
           str(wrapper), str(ROOT / "trainers" / "nft.py"), f"run_dir={tmp_path / 'two'}", *QUICK, "steps=2",
           "eval.every=1000", "data.prompts_per_step=2", "data.group_size=8", "sampling.steps=4",
           "reward.scorers=half_masked:1.0", "train.downsample_fraction=0.5", "train.minibatch_size=2",
           "train.gradient_accumulation_steps=1", "train.timesteps_per_sample=1"]
    # The run takes about 10 s; the minibatches of the kept rows alone hung until this timeout.
    out = run_process_group(cmd, cwd=ROOT, env=env, timeout=180, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/optimizer_steps"] == 4 for r in rows[1:])
    # Rank 0 keeps 2 of the 4 valid rows of its group, rank 1 4 of its 8: the logged value is the ranks' mean.
    assert all(r["reward/invalid"] == 2 and r["nft/trained_samples"] == 3 for r in rows[1:])
    assert all(math.isfinite(r["loss"]) for r in rows[1:])


def test_guided_rollouts_are_refused_and_sde_rollouts_train(tmp_path):
    # The recipe takes samples from any sampler (ODE by default); only guidance is refused, up front.
    with pytest.raises(ConfigError, match="sampling.guidance_scale=2.0: must be 1"):
        validate_config(apply_overrides(parse_config(Config, []), ["sampling.guidance_scale=2"]))
    _, rows = run(tmp_path, "sde", *SMALL, "steps=1", "eval.every=1", "sampling.sampler=sde",
                  "train.timesteps_per_sample=1")
    assert rows[1]["grad_norm"] > 0 and rows[1]["weight_version"] == 0


# ---- memory: theta_old is the trained tensors' size, and there is one transformer ------------------


def recipe_objects(tmp_path, monkeypatch, name, *overrides):
    """What main builds (the rollouts and the algorithm), stopped before training."""
    import trainers.nft as nft_module

    built = {}

    def capture(run, rollouts, algorithm):
        built.update(rollouts=rollouts, algorithm=algorithm)
        run.dir.release()
        return {}

    monkeypatch.setattr(nft_module, "train", capture)
    main([f"run_dir={tmp_path / name}", *QUICK, *SMALL, *overrides])
    return built["rollouts"], built["algorithm"]


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_nft_holds_no_second_transformer_and_theta_old_is_the_trained_tensors_only(tmp_path, monkeypatch, finetune):
    rollouts, nft = recipe_objects(tmp_path, monkeypatch, finetune, f"model.finetune={finetune}")
    theta_old = nft.state_dict()
    try:
        policy = rollouts.policy
        transformer = policy.transformer
        # Rollouts and evaluation run the trained module itself: no engine holds a copy of the model.
        assert rollouts.engine.model.transformer is transformer
        assert rollouts.eval_engine.model.transformer is transformer
        trained = dict(policy.named_params)
        assert theta_old.keys() == trained.keys()
        assert all(theta_old[n].shape == p.shape and theta_old[n].data_ptr() != p.data_ptr()
                   for n, p in trained.items())
        model_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
        trained_bytes = sum(p.numel() * p.element_size() for p in trained.values())
        assert sum(t.numel() * t.element_size() for t in theta_old.values()) == trained_bytes
        if finetune == "lora":
            assert all("lora_" in n for n in theta_old) and trained_bytes < 0.2 * model_bytes
        else:
            assert trained_bytes == model_bytes

        # Rollouts sample theta_old, swapped in by the loop (nft.serving_weights): the module sees other sampling
        # weights during a rollout and holds the trained ones again after it.
        weights_now = {n: p.detach().clone() for n, p in trained.items()}
        moved = {n: w + 0.01 for n, w in theta_old.items()}
        expected = {n: w.clone() for n, w in moved.items()}  # `moved` holds the trained values while swapped in
        seen = []
        hook = transformer.register_forward_pre_hook(
            lambda module, args: seen.append(all(torch.equal(p, expected[n]) for n, p in policy.named_params)))
        try:
            nft.sampling.weights = moved
            with nft.serving_weights():
                rollouts.collect(0, trainer_version=rollouts.version)
        finally:
            hook.remove()
        assert seen and all(seen)
        assert all(torch.equal(p, weights_now[n]) for n, p in policy.named_params)
        assert all(torch.equal(moved[n], expected[n]) for n in moved)
    finally:
        rollouts.close()
