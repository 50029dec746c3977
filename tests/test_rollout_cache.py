"""Cached training rollouts (sampling.cache_threshold / early_exit): the adaptive loop of engine/adaptive.py on
the rollouts of the recipes that train no per-step log-probs (nft, awm, dpo), and on GRPO's only after its SDE
window.

What is checked: the rollouts call the model fewer times; each cached row is the one the adaptive loop gives
that request (the loop's documented guarantee: the request run alone within 1e-5; threshold 0 = the plain loop
bit for bit); the images stay close to the plain loop's; GRPO's stochastic steps (their latents and log-probs)
are the plain loop's bit for bit; a bad threshold is refused by name before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from engine import Engine, load_model
from flywheel.rollout_collector import Flywheel
from flywheel.prompts import PromptSampler, load_prompts
from flywheel.recipe.sections import EvalConfig, SamplingConfig, eval_request_kwargs, rollout_request_kwargs
from flywheel.runs.config import ConfigError, parse_config
from flywheel.runs.rundir import read_metrics
from rewards import RewardSet

TINY = ["tracker=none", "steps=2", "eval.every=2", "data.prompts_per_step=2", "data.group_size=4",
        "eval.seeds=1", "save_every=1000", "sample_every=1000", "threads=1"]


@pytest.fixture(scope="module")
def toy():
    return load_model("toy-digits")


def collect(model, **sampling) -> tuple:
    """Step 0's rollouts of a toy-digits flywheel (4 prompts x 4 samples) with these sampling settings."""
    engine = Engine(model)
    wheel = Flywheel(engine, RewardSet("digit_alignment"), PromptSampler(load_prompts("toy-digits"), 4, seed=0), 4,
                     request_kwargs=rollout_request_kwargs(SamplingConfig(**sampling)), seed=0)
    return wheel.collect(0), engine.stats()


# ---- decoupled recipes: every step of an ODE rollout may be skipped ---------------------------


def test_an_ode_rollout_with_a_threshold_calls_the_model_less_and_stays_close(toy):
    plain, plain_stats = collect(toy, sampler="ode")
    cached, stats = collect(toy, sampler="ode", cache_threshold=0.15)
    calls = cached.trajectory.steps_computed
    assert "rollout/model_calls" not in plain.metrics  # the plain loop's rows carry no such key
    assert cached.metrics["rollout/model_calls"] == pytest.approx(float(calls.float().mean()))
    assert int(calls.max()) <= 10 and float(calls.float().mean()) < 8  # fewer model calls than the 10 steps
    assert stats["engine/steps_computed"] < plain_stats["engine/steps_computed"]
    # Close to the plain images (README: 0.15 moves the toy eval reward by +0.008), and not equal to them.
    change = (cached.trajectory.images - plain.trajectory.images).abs().mean()
    assert 0 < float(change) < 0.02
    assert (cached.rewards.total - plain.rewards.total).abs().mean() < 0.05


def test_each_cached_row_is_what_the_adaptive_loop_gives_that_request_alone(toy):
    cached, _ = collect(toy, sampler="ode", cache_threshold=0.15)
    engine = Engine(toy)
    wheel = Flywheel(engine, RewardSet("digit_alignment"), PromptSampler(load_prompts("toy-digits"), 4, seed=0), 4,
                     request_kwargs=rollout_request_kwargs(SamplingConfig(sampler="ode", cache_threshold=0.15)))
    items = wheel.sampler.batch(0)
    from flywheel.rollout_collector import sample_seed

    for row in (0, 5, 15):
        alone = engine.generate([wheel._request(items[row // 4], sample_seed(0, 0, row))])
        torch.testing.assert_close(cached.trajectory.latents[row, -1], alone.latents[0, -1], rtol=0, atol=1e-5)
        assert int(alone.steps_computed[0]) == int(cached.trajectory.steps_computed[row])


def test_threshold_zero_is_the_plain_rollout_bit_for_bit(toy):
    assert rollout_request_kwargs(SamplingConfig(cache_threshold=0.0)) == rollout_request_kwargs(SamplingConfig())
    plain, _ = collect(toy, sampler="ode")
    again, _ = collect(toy, sampler="ode", cache_threshold=0.0)
    assert torch.equal(plain.trajectory.latents, again.trajectory.latents)


def test_evaluation_keeps_its_own_setting():
    """The rollouts' cache and early exit never reach the evaluation samples (eval.cache_threshold)."""
    sampling = SamplingConfig(sampler="ode", cache_threshold=0.3, early_exit=0.05)
    merged = {**rollout_request_kwargs(sampling), **eval_request_kwargs(sampling, EvalConfig())}
    assert merged["cache_threshold"] == 0.0 and merged["early_exit"] is None


# ---- GRPO: only the ODE steps after the SDE window ---------------------------------------------


def test_grpo_window_steps_are_never_skipped(toy):
    window = dict(sampler="sde", noise_level=0.7, sde_window=(0, 4))
    plain, _ = collect(toy, **window)
    cached, _ = collect(toy, **window, cache_threshold=0.3)
    # The trained steps (0..3): their states and log-probs are the plain loop's bit for bit.
    assert torch.equal(cached.trajectory.latents[:, :5], plain.trajectory.latents[:, :5])
    assert torch.equal(cached.trajectory.log_probs[:, :4], plain.trajectory.log_probs[:, :4])
    calls = cached.trajectory.steps_computed
    assert int(calls.min()) >= 4 + 1  # the window's 4 calls, and the first ODE step after it has no cache yet
    assert float(calls.float().mean()) < 10  # the ODE tail was thinned
    assert not torch.equal(cached.trajectory.latents[:, -1], plain.trajectory.latents[:, -1])


def test_grpo_without_an_ode_tail_is_refused_and_mixgrpo_turns_the_cache_off_where_its_window_ends_last():
    from trainers.grpo import Config, validate_config, window_request

    with pytest.raises(ConfigError, match="sampling.cache_threshold / early_exit with sampling.sampler=sde"):
        validate_config(parse_config(Config, ["sampling.cache_threshold=0.15"]))
    validate_config(parse_config(Config, ["sampling.cache_threshold=0.15", "sampling.sde_window=[0,6]"]))
    cfg = parse_config(Config, ["sampling.cache_threshold=0.15", "train.variant=mixgrpo",
                                "train.window_shift_every=1", "train.window_stride=2"])
    validate_config(cfg)
    assert window_request(cfg, 0, 0) == {"sde_window": (0, 4)}  # an ODE tail: the rollout's cache stays on
    assert window_request(cfg, 3, 0) == {"sde_window": (6, 10), "cache_threshold": 0.0, "early_exit": None}
    with pytest.raises(ConfigError, match="train.flash_compress with sampling.cache_threshold"):
        validate_config(parse_config(Config, ["sampling.cache_threshold=0.15", "train.variant=mixgrpo",
                                              "train.flash_compress=0.4"]))


# ---- config checks, before any work -----------------------------------------------------------


@pytest.mark.parametrize("key, value, message", [
    ("sampling.cache_threshold", "1.5", r"sampling.cache_threshold.*must be in \[0, 1\]"),
    ("sampling.cache_threshold", "-0.1", r"sampling.cache_threshold.*must be in \[0, 1\]"),
    ("sampling.early_exit", "0", r"sampling.early_exit.*must be in \(0, 1\]"),
    ("sampling.early_exit", "2", r"sampling.early_exit.*must be in \(0, 1\]"),
])
def test_a_bad_setting_is_refused_by_name_before_anything_is_written(tmp_path, key, value, message):
    from trainers.nft import main

    with pytest.raises(ConfigError, match=message):
        main([f"run_dir={tmp_path / 'run'}", *TINY, f"{key}={value}"])
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["nft", "awm", "dpo"])
def test_a_decoupled_recipe_trains_on_cached_rollouts(tmp_path, recipe):
    import importlib

    main = importlib.import_module(f"trainers.{recipe}").main
    main([f"run_dir={tmp_path / recipe}", *TINY, "sampling.cache_threshold=0.3", "sampling.early_exit=0.05"])
    rows = read_metrics(tmp_path / recipe / "metrics.jsonl")
    trained = [r for r in rows if "rollout/model_calls" in r]
    assert len(trained) == 2 and all(r["rollout/model_calls"] < 10 for r in trained)
    assert all(r["train/optimizer_steps"] >= 1 for r in trained)
