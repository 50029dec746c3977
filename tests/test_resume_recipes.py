"""Exact resume, one contract for every recipe: a run killed by SIGKILL after its step-2 checkpoint and resumed
gives the metrics, trainer state and checkpointed tensors of the uninterrupted run, bit for bit.

Each recipe runs with the settings that make its own state matter across the kill (an optimizer that steps
twice a rollout, a sampling policy or an anchor that lags the weights); `check` asserts that this state was
live, so the equality is not the trivial one of a state nobody reads. Resume checks that test something else
stay beside their feature: test_grpo_variants (MixGRPO's windows and the guard), test_ema (the train.ema
average), test_faults_async (async rollouts), test_workflows_rl (a workflow's stages).
"""

import importlib
import json

import pytest
import torch
from safetensors.torch import load_file

from flywheel.recipe.session import RECIPE_TENSOR_PREFIX
from flywheel.runs.rundir import read_metrics

from recipe_kill import checkpoint, kill_after_checkpoint, without_timings

STEPS = 4  # two steps after the checkpoint the kill waits for: the run cannot finish before it is killed
QUICK = ["tracker=none", "eval.seeds=2", "sample_every=1000"]
SMALL = ["data.prompts_per_step=4", "data.group_size=8"]


def toy_digits_sha256() -> str:
    """The fingerprint of the toy-digits training prompts the checkpoints record."""
    from flywheel.prompts import PromptSampler, load_prompts

    return PromptSampler(load_prompts("toy-digits"), 4).fingerprint()


def check_grpo(rows, at_kill):
    assert all(r["kl"] > 0 for r in rows[2:])  # the policy has moved from the reference by the resumed steps


def check_nft(rows, at_kill):
    # eta = 0.4 after the second step: the checkpoint at step 2 holds a sampling policy unlike the trained one.
    sampling = {k[len(RECIPE_TENSOR_PREFIX):]: v for k, v in at_kill.items() if k.startswith(RECIPE_TENSOR_PREFIX)}
    assert sampling and all(name in at_kill for name in sampling)
    assert any(not torch.equal(v, at_kill[name]) for name, v in sampling.items())  # theta_old != theta
    assert [r["nft/eta"] for r in rows[1:]] == [0.4, 0.5, 0.5, 0.5]  # min(0.4·(i + 1), eta_max = 0.5)


def check_awm(rows, at_kill):
    # A fast-rising anchor decay (0.1, 0.2, 0.3, ...): the EMA is then not the weights, and a resume that
    # restarted it from the resumed weights would change anchor_mse, the loss and every weight after.
    assert any(k.startswith(RECIPE_TENSOR_PREFIX) for k in at_kill)
    assert [r["anchor/decay"] for r in rows[1:]] == pytest.approx([0.1, 0.2, 0.3, 0.3])
    assert all(r["anchor_mse"] > 0 for r in rows[2:])  # the anchor term is live after the first step


def check_dpo(rows, at_kill):
    # Two pairs a minibatch: two optimizer steps a rollout, so the optimizer state carries across the resume.
    assert [r["train/optimizer_steps"] for r in rows[1:]] == [2] * STEPS
    assert [r["weight_version_after"] for r in rows[1:]] == list(range(1, STEPS + 1))  # one sync per update


def check_draft(rows, at_kill):
    # ReFL (its steps drawn per sample) with the EMA anchor, checkpointed beside the weights.
    assert any(k.startswith(RECIPE_TENSOR_PREFIX) for k in at_kill)
    assert rows[STEPS]["anchor_mse"] > 0  # the anchor lags the weights once its decay is above 0


# recipe -> (its overrides, what must have been live for the resume to be a real test)
RECIPES = {
    "grpo": (["train.timestep_fraction=0.5", *SMALL, "eval.every=3"], check_grpo),
    "nft": (["sampling.steps=6", *SMALL, "eval.every=3", "train.eta_rate=0.4", "train.timesteps_per_sample=2"],
            check_nft),
    "awm": (["train.timesteps_per_sample=2", *SMALL, "eval.every=3", "train.anchor_decay_ramp=0.1",
             "train.kl_beta=0.01"], check_awm),
    "dpo": ([*SMALL, "eval.every=4", "train.minibatch_size=2", "train.time_sampling=uniform"], check_dpo),
    "draft": (["sampling.steps=6", *SMALL, "eval.every=2", "train.mode=refl", "train.anchor_beta=1",
               "train.anchor_decay_ramp=0.2"], check_draft),
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_kill_and_resume_gives_the_metrics_state_and_tensors_of_an_uninterrupted_run(tmp_path, recipe):
    main = importlib.import_module(f"trainers.{recipe}").main
    overrides, check = RECIPES[recipe]
    args = [*QUICK, *overrides, f"steps={STEPS}", "save_every=2"]
    straight = tmp_path / "straight"
    main([f"run_dir={straight}", *args])

    interrupted = tmp_path / "interrupted"
    kill_after_checkpoint(recipe, interrupted, args)
    assert not (interrupted / "checkpoints" / f"step_{STEPS:06d}").exists()
    at_kill = checkpoint(interrupted, 2)

    resumed = main([f"resume={interrupted}"])  # nothing but the run directory: its config comes from there
    assert resumed["run_dir"] == str(interrupted)
    rows = read_metrics(interrupted / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert without_timings(rows) == without_timings(read_metrics(straight / "metrics.jsonl"))
    check(rows, at_kill)

    # Every trainer-state field equals the uninterrupted run's and holds what the steps imply: one weight
    # version a step, 4 prompts a step of the 80 toy-digits training prompts, nothing skipped.
    final = f"checkpoints/step_{STEPS:06d}/trainer_state.json"
    state = json.loads((interrupted / final).read_text())
    assert state == json.loads((straight / final).read_text())
    assert state == {"step": STEPS, "weight_version": STEPS,
                     "data_position": {"epoch": 0, "index_in_epoch": 4 * STEPS}, "skipped_steps": 0,
                     "masked_run": 0, "flat_run": 0, "data_sha256": toy_digits_sha256()}
    # Every file of the last checkpoint (the weights with the recipe's own tensors, the optimizer's state and
    # hyperparameters) is the uninterrupted run's, but the manifest (its checksums follow the files, and it
    # records when it was written) and the RNG files: they hold the process's global generators, which no
    # recipe seeds or draws from (rollouts draw from per-request generators), so the straight run's are
    # pytest's and the resumed run's the killed process's.
    ours, theirs = interrupted / final.rsplit("/", 1)[0], straight / final.rsplit("/", 1)[0]
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    compared = [p for p in sorted(theirs.iterdir()) if p.name not in ("manifest.json", "rng.json", "rng.safetensors")]
    assert {"model.safetensors", "optimizer.safetensors", "optimizer.json"} <= {p.name for p in compared}
    for path in sorted(p for p in compared if p.suffix == ".json"):
        assert json.loads((ours / path.name).read_text()) == json.loads(path.read_text()), path.name
    for path in (p for p in compared if p.suffix == ".safetensors"):
        expected, got = load_file(str(path)), load_file(str(ours / path.name))
        assert expected.keys() == got.keys(), path.name
        for name, value in expected.items():
            assert torch.equal(value, got[name]), (path.name, name)
