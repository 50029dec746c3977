"""eval.stop_on_hacking=N and best/ in a real toy run, with the hacking watch scripted to fire.

The watch itself is tested in tests/test_hacking_watch.py; here it fires at
chosen evaluations so that the run's reaction (stop, keep best/ and the last
good checkpoint, say why) is checked on a real GRPO run of a few steps.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from flywheel.hacking_watch import HackingWatch, Signal, WatchResult
from flywheel.recipe.best import read_best
from flywheel.recipe.hacking_stop import HackingStop
from flywheel.runs.config import ConfigError
from flywheel.runs.rundir import read_metrics
from trainers.grpo import main

TINY = ["tracker=none", "eval.seeds=1", "data.prompts_per_step=2", "data.group_size=4",
        "sampling.steps=4", "train.timestep_fraction=0.5", "sample_every=1000", "eval.every=1", "save_every=1",
        "keep_checkpoints=1", "model.finetune=lora", "train.learning_rate=1e-3"]


@pytest.fixture
def tiny(tmp_path):
    """TINY with ten evaluation prompts, one a digit (the built-in held-out set has 40): evaluations are cheap."""
    path = tmp_path / "eval_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"the number {d}", "digit": d}) + "\n" for d in range(10)))
    return [*TINY, f"data.eval_prompts={path}"]


def scripted_watch(monkeypatch, fires_at: set[int]):
    """The session's HackingWatch, firing exactly at the evaluations of `fires_at` (a real one runs beside it)."""

    class Scripted(HackingWatch):
        def observe(self, metrics, step=None):
            super().observe(metrics, step)
            if step in fires_at:
                signal = Signal("digit_svc", "3", 0.9, 0.5, 0.5, 0.9, 0)
                self.last = WatchResult((signal,), new=True)
            else:
                self.last = WatchResult()
            return self.last

    monkeypatch.setattr("flywheel.recipe.session.HackingWatch", Scripted)


# ---- the counter --------------------------------------------------------------------------------


def test_hacking_stop_counts_consecutive_signals_and_holds_pruning_while_they_fire():
    stop = HackingStop(2)
    stop.observe({"eval/hacking_warning": 0.0})
    stop.saved(10)
    assert stop.keep_last(1) == 1 and not stop.should_stop
    stop.observe({"eval/hacking_warning": 1.0})
    assert stop.keep_last(1) is None and not stop.should_stop  # step 20's checkpoint must not prune step 10's
    stop.saved(20)
    stop.observe({"eval/hacking_warning": 0.0})  # a clean evaluation resets the streak
    assert stop.streak == 0
    stop.observe({"eval/hacking_warning": 1.0})
    stop.observe({"eval/hacking_warning": 1.0})
    assert stop.should_stop and stop.last_good_checkpoint == 10
    # The state a checkpoint carries brings the count back on resume.
    again = HackingStop(2, stop.state())
    assert again.should_stop and again.last_good_checkpoint == 10
    assert "stopped at step 40" in stop.reason(40, 10, 0.9, "runs/x/checkpoints")
    assert "runs/x/checkpoints/step_000010" in stop.reason(40, 10, 0.9, "runs/x/checkpoints")
    off = HackingStop(0)
    off.observe({"eval/hacking_warning": 1.0})
    assert not off.should_stop and off.keep_last(3) == 3  # off: the run and its pruning are as before
    with pytest.raises(ValueError, match="stop_on_hacking"):
        HackingStop(-1)


def test_stop_on_hacking_is_checked_with_the_config():
    with pytest.raises(ConfigError, match=r"eval.stop_on_hacking=-1: must be an integer >= 0"):
        main(["tracker=none", "eval.stop_on_hacking=-1"])


# ---- a real run ---------------------------------------------------------------------------------


def test_run_stops_after_n_flagged_evaluations_keeping_best_and_the_last_good_checkpoint(tmp_path, monkeypatch,
                                                                                         capsys, tiny):
    scripted_watch(monkeypatch, fires_at={3, 4})
    run_dir = tmp_path / "run"
    result = main([f"run_dir={run_dir}", *tiny, "steps=8", "eval.stop_on_hacking=2"])
    out = capsys.readouterr().out
    rows = read_metrics(run_dir / "metrics.jsonl")
    # The run ended after the second flagged evaluation (step 4), normally, and said why on its last line.
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["eval/hacking_warning"] for r in rows] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert "stopped at step 4" in result["stopped"] and "eval.stop_on_hacking=2" in result["stopped"]
    assert out.strip().splitlines()[-1] == result["stopped"]
    # The last good checkpoint (step 2) survived keep_checkpoints=1, beside the flagged steps' ones.
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith("."))
    assert ckpts == ["step_000002", "step_000003", "step_000004"]
    assert "checkpoints/step_000002" in result["stopped"]
    # best/: the highest reward of the unflagged evaluations 0-2, with that step's weights and LoRA.
    rewards = {r["step"]: r["eval/reward/mean"] for r in rows}
    expected = max((0, 1, 2), key=lambda s: (rewards[s], -s))
    info = read_best(run_dir)
    assert info["step"] == expected and info["reward"] == pytest.approx(rewards[expected])
    assert info["lora"] is True and info["ema"] is False
    assert rows[-1]["eval/best_step"] == expected
    weights = load_file(str(run_dir / "best" / "weights.safetensors"))
    assert weights and all("lora_" in k for k in weights)
    assert load_file(str(run_dir / "best" / "lora" / "adapter_model.safetensors"))
    if expected == 2:  # the checkpoint of that step holds the same trained tensors
        saved = load_file(str(run_dir / "checkpoints" / "step_000002" / "model.safetensors"))
        assert all(torch.equal(weights[k], saved[k]) for k in weights)
    state = json.loads((run_dir / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["hacking_streak"] == 2 and state["last_good_checkpoint"] == 2


def test_a_run_stopped_between_saves_checkpoints_the_step_it_stopped_at_and_resumes_from_it(tmp_path, monkeypatch,
                                                                                           tiny):
    """save_every beyond the stop: the stop once ended without any checkpoint, the trained weights lost and
    resume refused ("nothing to resume from")."""
    scripted_watch(monkeypatch, fires_at={1, 2})
    run_dir = tmp_path / "run"
    result = main([f"run_dir={run_dir}", *tiny, "steps=8", "save_every=1000", "eval.stop_on_hacking=2"])
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith("."))
    assert ckpts == ["step_000002"]
    assert "no checkpoint was saved before the signals" in result["stopped"]
    assert result["stopped"].endswith(f"the weights it stopped with are in {run_dir / 'checkpoints'}/step_000002")
    monkeypatch.undo()
    resumed = main([f"resume={run_dir}", "steps=3"])
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    assert "stopped" not in resumed


def test_without_the_option_a_flagged_run_goes_on_and_best_skips_the_flagged_evaluations(tmp_path, monkeypatch,
                                                                                          tiny):
    scripted_watch(monkeypatch, fires_at={1, 2})
    run_dir = tmp_path / "run"
    result = main([f"run_dir={run_dir}", *tiny, "steps=2", "save_every=1000"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert "stopped" not in result and [r["step"] for r in rows] == [0, 1, 2]
    # Every evaluation after the base one was flagged: best/ holds the base weights (step 0).
    assert read_best(run_dir)["step"] == 0
    base = load_file(str(run_dir / "best" / "weights.safetensors"))
    assert all(float(v.abs().sum()) == 0.0 for k, v in base.items() if "lora_B" in k)  # LoRA B starts at 0
