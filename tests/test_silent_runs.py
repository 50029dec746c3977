"""Issue 22, items 2 and 3: a run that trains nothing says so and exits non-zero after saving; steps without an
optimizer step are said and counted in every recipe; lora/ is the trained adapter and lora_ema/ the average, and
an average that never moved is warned about."""

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flywheel.cli import NOTHING_TRAINED_EXIT, NothingTrainedError
from flywheel.recipe.ema import first_ema_move, train_ema_decay
from flywheel.recipe.sections import EMAConfig, OptimConfig
from flywheel.recipe.session import _all_lora_b_zero
from flywheel.runs.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["tracker=none", "eval.seeds=1", "data.prompts_per_step=2", "data.group_size=4", "sampling.steps=4",
        "sample_every=1000", "eval.every=1000"]


@pytest.fixture
def tiny(tmp_path):
    """TINY with two evaluation prompts (the built-in held-out set has 40): evaluations are cheap."""
    path = tmp_path / "eval_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"the number {d}", "digit": d}) + "\n" for d in (3, 7)))
    return [*TINY, f"data.eval_prompts={path}"]


# Runs a recipe's script after registering the constant scorer "half" and, with POISON=N set, an AdamW step that
# leaves an inf in the first weight from the N-th step on (what a bad learning rate or batch does).
WRAPPED_RECIPE = textwrap.dedent("""
    import os, runpy, sys, torch
    from rewards import registry
    registry.register("half", lambda **_: (lambda images, prompts, metadata: torch.full((len(prompts),), 0.5)))
    if os.environ.get("POISON"):
        original, calls = torch.optim.AdamW.step, []

        def poisoned(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            calls.append(1)
            if len(calls) >= int(os.environ["POISON"]):
                with torch.no_grad():
                    self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
            return out

        torch.optim.AdamW.step = poisoned
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def run_wrapped(recipe: str, args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WRAPPED_RECIPE, str(ROOT / "trainers" / f"{recipe}.py"), *args],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_scorer_that_gives_every_image_half_ends_with_0_of_3_steps_and_exit_3_after_saving(tmp_path, tiny):
    """The acceptance case of issue 22 from the command line: a constant scorer, every group flat."""
    run_dir = tmp_path / "flat"
    out = run_wrapped("grpo", [f"run_dir={run_dir}", *tiny, "steps=3", "reward.scorers=half:1.0"])
    assert out.returncode == NOTHING_TRAINED_EXIT == 3, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 0 of 3 steps moved the weights (3 skipped: every group's rewards were equal")
    assert "Traceback" not in out.stderr
    for step in (1, 2, 3):  # each skipped step said on the progress bar, with why
        assert f"warning: step {step} took no optimizer step: every group's rewards were equal" in out.stderr
    # Everything written as usual before the exit: every row, the final checkpoint, the final evaluation.
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["train/skipped_steps"] for r in rows[1:]] == [1, 2, 3]
    assert [r["train/optimizer_steps"] for r in rows[1:]] == [0, 0, 0]
    assert rows[-1]["weight_version"] == 0 and "eval/reward/mean" in rows[-1]
    assert (run_dir / "checkpoints" / "step_000003" / "manifest.json").is_file()
    assert "eval reward: base 0.500 -> final 0.500" in out.stdout


@pytest.mark.slow
def test_groups_that_stay_flat_stop_the_run_at_max_flat_steps_with_the_message_and_the_newest_checkpoint(
        tmp_path, tiny):
    """A run whose every group is flat step after step trains nothing and will not (its weights do not move):
    it stops at reward.max_flat_steps with one message (no traceback), exit 1, naming the newest checkpoint."""
    run_dir = tmp_path / "flat"
    out = run_wrapped("nft", [f"run_dir={run_dir}", *tiny, "steps=8", "save_every=2", "reward.scorers=half:1.0",
                              "reward.max_flat_steps=3"])
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    error, kept = out.stderr.strip().splitlines()[-2:]
    assert error.startswith("error: step 3: every group's rewards were equal in each of the last 3 steps "
                            "(reward.max_flat_steps=3; reward mean 0.5): the policy gives every sample")
    assert kept == (f"the newest checkpoint is {run_dir / 'checkpoints' / 'step_000002'}; continue from it after "
                    f"the change with `python {ROOT / 'trainers' / 'nft.py'} resume={run_dir}`")
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]  # step 3 stopped unlogged


@pytest.mark.slow
def test_a_weight_gone_inf_ends_the_command_with_the_guards_message_and_the_newest_checkpoint(tmp_path, tiny):
    run_dir = tmp_path / "inf"
    out = run_wrapped("grpo", [f"run_dir={run_dir}", *tiny, "steps=4", "save_every=1"], POISON="3")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    error, kept = out.stderr.strip().splitlines()[-2:]
    assert error.startswith("error: step 3: weight ") and "holds NaN or inf after the optimizer step" in error
    assert kept.startswith(f"the newest checkpoint is {run_dir / 'checkpoints' / 'step_000002'};")


@pytest.mark.slow
def test_a_run_with_some_skipped_steps_ends_with_n_of_m_and_returns(tmp_path, tiny, monkeypatch, capfd):
    """The first step's groups made flat (no usable sample), the second trains: 1 of 2, a warning, no error."""
    import flywheel.rollout_collector

    original, calls = flywheel.rollout_collector.distributed_reward_advantages, []

    def first_flat(*args, **kwargs):
        adv, usable = original(*args, **kwargs)
        calls.append(1)
        return (torch.zeros_like(adv), torch.zeros_like(usable)) if len(calls) == 1 else (adv, usable)

    monkeypatch.setattr(flywheel.rollout_collector, "distributed_reward_advantages", first_flat)
    from trainers.grpo import main

    result = main([f"run_dir={tmp_path / 'partial'}", *tiny, "steps=2"])
    assert result["trained_steps"] == 1 and result["steps"] == 2
    err = capfd.readouterr().err
    assert "warning: step 1 took no optimizer step: every group's rewards were equal" in err
    assert "warning: step 2 took no optimizer step" not in err
    assert ("warning: 1 of 2 steps moved the weights (1 skipped: every group's rewards were equal (flat "
            "groups: no advantage to learn from))") in err
    rows = read_metrics(tmp_path / "partial" / "metrics.jsonl")
    assert [r["train/optimizer_steps"] for r in rows[1:]] == [0, 1]
    assert [r["weight_version_after"] for r in rows[1:]] == [0, 1]


def test_dpo_reports_a_step_without_a_pair_as_skipped(tmp_path, tiny):
    """DPO's update can take no optimizer step with usable groups (no pair over the margin): it says so too.
    (A JPEG-size reward declares no range, so the margin of 5 kB is not refused up front; the tiny images' sizes
    differ by far less.)"""
    from trainers.dpo import main

    with pytest.raises(NothingTrainedError, match=r"^0 of 1 steps moved the weights \(1 skipped: no preference "
                                                  r"pair \(no group had a reward gap over train.pair_margin=5.0\)\)"):
        main([f"run_dir={tmp_path / 'dpo'}", *tiny, "steps=1", "train.pair_margin=5.0",
              "reward.scorers=jpeg_compressibility:1.0"])
    rows = read_metrics(tmp_path / "dpo" / "metrics.jsonl")
    assert rows[-1]["dpo/no_pair"] == 1.0 and rows[-1]["train/optimizer_steps"] == 0
    assert (tmp_path / "dpo" / "checkpoints" / "step_000001").is_dir()


def test_dpo_refuses_a_pair_margin_no_reward_gap_can_reach_before_writing(tmp_path, tiny):
    """digit_alignment lies in [0, 1], so at weight 1 no two samples differ by 1 or more: every step would have
    no pair. Refused before the run directory exists; just under the span is accepted."""
    from flywheel.config.parsing import ConfigError
    from trainers.dpo import main

    with pytest.raises(ConfigError, match=r"train.pair_margin=1: no pair can have a reward gap over it, since "
                                          r"reward.scorers=digit_alignment:1.0 spans at most 1 .*"
                                          r"use 0 <= train.pair_margin < 1$"):
        main([f"run_dir={tmp_path / 'dpo'}", *tiny, "steps=1", "train.pair_margin=1",
              "reward.scorers=digit_alignment:1.0"])
    assert not (tmp_path / "dpo").exists()


def test_gradient_steps_count_the_optimizer_steps_they_take():
    """What grpo, nft, awm and dpo report as train/optimizer_steps: one per completed accumulation group."""
    from accelerate import Accelerator

    from flywheel.recipe.update import GradientSteps

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for accumulation, expected in ((1, 4), (2, 2), (4, 1)):
        oc = OptimConfig(minibatch_size=2, gradient_accumulation_steps=accumulation)
        grads = GradientSteps(Accelerator(cpu=True), model, optimizer, list(model.named_parameters()), oc, step=0)
        for m, rows in enumerate(grads.minibatches(8)):
            with grads.microstep(m, last_of_minibatch=True):
                grads.backward(model(torch.ones(len(rows), 2)).sum())
            grads.maybe_step(m)
        assert grads.metrics()["train/optimizer_steps"] == expected


def test_first_ema_move_is_the_schedules_first_step():
    for start, every in ((0, 8), (0, 1), (3, 8), (1, 2), (0, 5)):
        oc = EMAConfig(enabled=True, start_step=start, update_every=every)
        assert first_ema_move(oc) == next(s for s in range(1, 100) if train_ema_decay(s, oc) is not None)


def test_an_adapter_whose_every_lora_b_is_zero_is_found():
    zero = {"a.lora_A.default.weight": torch.ones(2, 2), "a.lora_B.default.weight": torch.zeros(2, 2),
            "b.lora_B.default.weight": torch.zeros(3, 2)}
    assert _all_lora_b_zero(zero)
    assert not _all_lora_b_zero({**zero, "b.lora_B.default.weight": torch.tensor([[0.0, 1e-9]] * 3)})
    assert not _all_lora_b_zero({"w": torch.zeros(2)})  # no LoRA at all: nothing to say


def test_an_ema_that_never_moved_is_warned_about(tmp_path, tiny, capfd):
    """ema.enabled moving every 8 steps in a 1-step run: the evaluated average is the starting weights, said."""
    from trainers.grpo import main

    main([f"run_dir={tmp_path / 'ema'}", *tiny, "steps=1", "ema.enabled=true"])
    captured = capfd.readouterr()
    # Said once before the run too, while it can still be changed.
    before = ("warning: ema.update_every=8 with ema.start_step=0 and steps=1: the EMA average will never move, so "
              "every evaluation will be the weights the run starts from; set ema.update_every <= 1 "
              "or ema.start_step >= 1 to evaluate training")
    assert captured.err.count(before) == 1
    assert captured.err.index(before) < captured.err.index("warning: the EMA average never moved")
    assert ("warning: the EMA average never moved: it moves after every ema.update_every=8-th step "
            "from ema.start_step=0, and this run has steps=1; the evaluation use the weights the run started from "
            "(lower ema.update_every, or take the trained weights: model.safetensors of the last checkpoint in "
            f"{tmp_path / 'ema' / 'checkpoints'}, whose 'ema/' tensors are the average)") in captured.err
    # A full fine-tune has no lora/ to point at (the message once said "take lora/" for every run).
    assert "lora/" not in captured.err and "lora_ema/" not in captured.err and not (tmp_path / "ema" / "lora").exists()
    assert "(of the EMA average)" in captured.out


def test_the_average_knows_whether_it_moved():
    from flywheel.recipe.ema import WeightEMA

    weights = [("w", torch.ones(3))]
    ema = WeightEMA(weights)
    ema.update(weights, 0.5)  # the weights it started from: nothing moved
    ema.update([("w", torch.full((3,), 2.0))], 1.0)  # decay 1 keeps the average
    assert not ema.moved
    ema.update([("w", torch.full((3,), 2.0))], 0.5)
    assert ema.moved and torch.equal(ema.shadow["w"], torch.full((3,), 1.5))
    loaded = WeightEMA(weights)
    loaded.load_state_dict({"w": torch.ones(3)})
    assert loaded.moved  # a checkpoint's average: its history is not known, so no warning is made up


@pytest.mark.slow
def test_the_issues_sd3_lora_with_an_ema_every_8_steps_exports_the_trained_adapter_and_warns(tmp_path, capfd):
    """configs/sd3_pickscore.yaml's EMA (every 8 steps) after 2 steps, on a tiny SD3: lora/ is the trained
    adapter (it moved), lora_ema/ the untouched average (every lora_B zero), and the run says so."""
    from safetensors.torch import load_file

    from recipe_kill import tiny_sd3_lora_ema_args
    from trainers.grpo import main

    run_dir = tmp_path / "run"
    main(tiny_sd3_lora_ema_args(tmp_path, run_dir))
    lora_b = lambda folder: [t for k, t in load_file(str(run_dir / folder / "pytorch_lora_weights.safetensors"))
                             .items() if "lora_B" in k]
    assert any(t.any() for t in lora_b("lora"))
    assert lora_b("lora_ema") and not any(t.any() for t in lora_b("lora_ema"))
    captured = capfd.readouterr()
    assert (f"warning: the EMA average never moved: it moves after every ema.update_every=8-th step "
            f"from ema.start_step=0, and this run has steps=2; {run_dir / 'lora_ema'} and the evaluation use "
            "the weights the run started from") in captured.err
    assert f"{run_dir / 'lora'}: the trained adapter\n" in captured.out


# A factor of each recipe's loss set near zero: the gradient falls under AdamW's eps, every optimizer step only
# rounds the weights (train/update_rel 0 or about 1e-20), and the run used to exit 0 with its starting weights.
UNMOVED = {"grpo": ["advantage.clip_max=1e-30"], "nft": ["advantage.clip_max=1e-30"],
           "draft": ["train.reward_scale=1e-30"], "dpo": ["train.beta=1e-30"],
           "grpo-lora": ["model.finetune=lora", "model.lora_alpha=1e-20"]}


@pytest.mark.parametrize("case", sorted(UNMOVED))
def test_optimizer_steps_that_only_round_the_weights_count_as_training_nothing(case, tmp_path, tiny, capfd):
    recipe = case.split("-")[0]
    main = importlib.import_module(f"trainers.{recipe}").main
    run_dir = tmp_path / case
    with pytest.raises(NothingTrainedError) as err:
        main([f"run_dir={run_dir}", *tiny, "steps=2", "train.kl_beta=0", "train.weight_decay=0", *UNMOVED[case]])
    assert str(err.value).startswith("0 of 2 steps moved the weights (2 skipped: its optimizer step moved the "
                                     "weights by under 1e-07 of their size (train/update_rel) beyond weight decay")
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["train/optimizer_steps"] > 0 for r in rows[1:]] == [True, True]  # the optimizer did step
    assert all(r["train/update_rel"] < 1e-7 for r in rows[1:])
    assert [r["train/skipped_steps"] for r in rows[1:]] == [1, 2]
    err_text = capfd.readouterr().err
    assert "warning: step 1 moved no weight: train/update_rel=" in err_text


@pytest.mark.parametrize("case", ["draft", "grpo", "nft"])
def test_steps_that_only_weight_decay_moves_count_as_training_nothing(case, tmp_path, tiny, capfd):
    """With the shipped weight decay (lr 1e-3 x 1e-4 for DRaFT: every weight shrinks by 1e-7 of itself a step),
    a loss scaled to nothing moved the weights by 1.2e-7 a step, just over the threshold: the run exited 0 with
    the base's evaluation. The decay's share is taken off before the comparison."""
    main = importlib.import_module(f"trainers.{case}").main
    run_dir = tmp_path / case
    with pytest.raises(NothingTrainedError, match="0 of 2 steps moved the weights"):
        main([f"run_dir={run_dir}", *tiny, "steps=2", "train.kl_beta=0", "train.weight_decay=0.1",
              *UNMOVED[case]])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert all(r["train/update_rel"] >= 1e-7 for r in rows[1:])  # over the bare threshold: the decay's motion
    assert "of which weight decay alone" in capfd.readouterr().err


def test_a_step_that_moves_the_weights_is_not_counted_as_unmoved(tmp_path, tiny):
    from trainers.nft import main

    summary = main([f"run_dir={tmp_path / 'run'}", *tiny, "steps=2"])
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert summary["trained_steps"] == 2 and all(r["train/update_rel"] > 1e-6 for r in rows[1:])


def _nan_at_call(module, name: str, at: int, monkeypatch):
    """Patch module.name (a generate call) so that its `at`-th call returns a trajectory whose first image and
    latent are NaN: what a forward that overflowed gives."""
    original, calls = getattr(module, name), []

    def generate(*args, **kwargs):
        traj = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == at:
            traj.images[0].fill_(float("nan"))
            traj.latents[0].fill_(float("nan"))
        return traj

    monkeypatch.setattr(module, name, generate)


def test_nan_rollout_samples_stop_the_run_naming_the_rollout_not_the_rewards(tmp_path, tiny, monkeypatch):
    import flywheel.rollout_collector
    from flywheel.guards import NonFiniteError
    from trainers.nft import main

    _nan_at_call(flywheel.rollout_collector, "generate_in_order", 2, monkeypatch)
    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"^step 2: 1 of the step's rollout samples hold NaN or inf; the weights "
                                             r"are finite \(checked after every optimizer step\), so the forward "
                                             r"overflowed"):
        main([f"run_dir={run_dir}", *tiny, "steps=3", "save_every=1"])
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1]  # step 1 kept, nothing of 2
    assert (run_dir / "checkpoints" / "step_000001" / "manifest.json").is_file()


def test_nan_evaluation_samples_stop_the_run_naming_the_samples(tmp_path, tiny, monkeypatch):
    import flywheel.recipe.rollouts
    from engine import Engine
    from flywheel.guards import NonFiniteError
    from trainers.nft import main

    original_generate, original_eval, evals = Engine.generate, flywheel.recipe.rollouts.eval_samples, []

    def evaluating(*args, **kwargs):
        evals.append("running")
        try:
            return original_eval(*args, **kwargs)
        finally:
            evals[-1] = "done"

    def generate(self, *args, **kwargs):
        traj = original_generate(self, *args, **kwargs)
        if evals[-1:] == ["running"] and len(evals) == 2:  # the step-1 evaluation (the first is the base one)
            traj.images[0].fill_(float("nan"))
        return traj

    monkeypatch.setattr(flywheel.recipe.rollouts, "eval_samples", evaluating)
    monkeypatch.setattr(Engine, "generate", generate)
    with pytest.raises(NonFiniteError, match=r"^the evaluation's samples hold NaN or inf \(1 of 2\)"):
        main([f"run_dir={tmp_path / 'run'}", *tiny, "steps=2", "eval.every=1"])
