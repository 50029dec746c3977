"""best/: the evaluation with the highest eval reward among those where the hacking watch did not fire.

Unit tests of the selection and the atomic swap on fabricated metrics; the
recipe end to end (a real toy run, the watch scripted) is in
tests/test_stop_on_hacking.py, which also checks best/ there.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from flywheel.recipe.best import BEST_STEP_METRIC, BestCheckpoint, eligible, read_best


def writer(value: float):
    """A `write(folder)` that saves one tensor holding `value`."""

    def write(folder):
        save_file({"w": torch.tensor([value])}, str(folder / "weights.safetensors"))
        return {"ema": False}

    return write


def held(run_dir) -> float:
    return float(load_file(str(run_dir / "best" / "weights.safetensors"))["w"])


def test_eligible_needs_a_finite_reward_and_no_watch_signal():
    assert eligible({"eval/reward/mean": 0.7, "eval/hacking_warning": 0.0}) == 0.7
    assert eligible({"eval/reward/mean": 0.7}) == 0.7  # a card without judges: no watch, nothing fires
    assert eligible({"eval/reward/mean": 0.9, "eval/hacking_warning": 1.0}) is None
    assert eligible({"eval/reward/mean": float("nan")}) is None
    assert eligible({"eval/hacking_warning": 0.0}) is None
    assert eligible({"eval/reward/mean": True}) is None


def test_best_is_the_highest_reward_without_a_signal_and_moves_only_when_beaten(tmp_path):
    best = BestCheckpoint(tmp_path)
    assert best.step is None and best.metrics() == {BEST_STEP_METRIC: -1.0}
    evals = [  # step, reward, watch fired
        (0, 0.48, 0), (10, 0.70, 0), (20, 0.85, 0), (30, 0.97, 1),  # the highest reward, but flagged
        (40, 0.85, 0),  # a tie does not replace
        (50, 0.80, 0), (60, 0.90, 0), (70, 0.99, 1)]
    moved = [best.consider(s, {"eval/reward/mean": r, "eval/hacking_warning": float(w)}, writer(float(s)))
             for s, r, w in evals]
    assert moved == [True, True, True, False, False, False, True, False]
    assert best.step == 60 and held(tmp_path) == 60.0
    assert read_best(tmp_path) == {"step": 60, "reward": 0.90, "ema": False}
    assert best.metrics() == {BEST_STEP_METRIC: 60.0}
    # No temporary folder is left behind.
    assert sorted(os.listdir(tmp_path)) == ["best"]


def test_a_resumed_run_keeps_the_best_so_far(tmp_path):
    first = BestCheckpoint(tmp_path)
    first.consider(20, {"eval/reward/mean": 0.9}, writer(20.0))
    again = BestCheckpoint(tmp_path)  # the resumed run reads best/best.json back
    assert again.step == 20
    assert not again.consider(30, {"eval/reward/mean": 0.85}, writer(30.0))
    assert again.consider(40, {"eval/reward/mean": 0.95}, writer(40.0)) and held(tmp_path) == 40.0


def test_a_failed_write_leaves_the_previous_best_untouched(tmp_path):
    best = BestCheckpoint(tmp_path)
    best.consider(10, {"eval/reward/mean": 0.5}, writer(10.0))

    def broken(folder):
        save_file({"w": torch.tensor([99.0])}, str(folder / "weights.safetensors"))
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        best.consider(20, {"eval/reward/mean": 0.9}, broken)
    assert best.step == 10 and held(tmp_path) == 10.0 and read_best(tmp_path)["step"] == 10
    assert sorted(os.listdir(tmp_path)) == ["best"]


def test_a_swap_killed_between_its_renames_is_put_back(tmp_path):
    best = BestCheckpoint(tmp_path)
    best.consider(10, {"eval/reward/mean": 0.5}, writer(10.0))
    # The kill: best/ moved aside to .best.old, the new folder not yet in place (a half-built .best.tmp).
    os.replace(tmp_path / "best", tmp_path / ".best.old")
    (tmp_path / ".best.tmp").mkdir()
    resumed = BestCheckpoint(tmp_path)
    assert resumed.step == 10 and held(tmp_path) == 10.0
    assert sorted(os.listdir(tmp_path)) == ["best"]


def test_best_json_is_what_compare_reads(tmp_path):
    best = BestCheckpoint(tmp_path)
    best.consider(5, {"eval/reward/mean": 0.6}, lambda folder: {"ema": True, "lora": True})
    assert json.loads((tmp_path / "best" / "best.json").read_text()) == {"step": 5, "reward": 0.6, "ema": True,
                                                                          "lora": True}
