"""benchmarks/async_flywheel.py's bounds on what async rollouts can gain: the engine-process layout's ceiling
(engine on one thread, trainer on the other cores until the rollout ends, then on all) and any schedule's."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ holds scripts, not an installed package

from benchmarks.async_flywheel import layout_ceiling, layout_step_s, overlap_bound, round_summary  # noqa: E402


def test_the_layout_step_is_the_rollout_then_the_rest_of_the_update_on_every_core():
    # A 1 s rollout while the trainer, at 4 s per update on the shared cores, gets through a quarter of it;
    # the other three quarters at 2 s per update on every core take 1.5 s.
    assert layout_step_s(1.0, 4.0, 2.0) == pytest.approx(2.5)
    # A rollout longer than the whole update on the shared cores: the trainer waits for it.
    assert layout_step_s(5.0, 4.0, 2.0) == pytest.approx(5.0)
    assert layout_step_s(4.0, 4.0, 2.0) == pytest.approx(4.0)


def test_the_layout_ceiling_is_below_any_overlap_when_threads_scale_sublinearly():
    # 2 cores; two threads make training 1.5x faster, not 2x: the layout's 2-thread tail costs core time.
    sync = {"rollout_s": 0.4, "train_s": 1.2, "step_s": 1.7}
    one_thread = {"rollout_s": 0.6, "train_s": 1.8, "step_s": 2.5}
    ceiling = layout_ceiling(sync, one_thread, one_thread)
    assert ceiling == pytest.approx(1.7 / (0.6 + (1 - 0.6 / 1.8) * 1.2))
    assert ceiling < overlap_bound(sync, one_thread, cores=2) == pytest.approx(1.7 / ((0.6 + 1.8) / 2))
    # With threads that scale perfectly the two bounds meet (the rollout ends inside the update).
    perfect = {"rollout_s": 0.8, "train_s": 2.4, "step_s": 3.3}
    assert layout_ceiling(sync, perfect, perfect) == pytest.approx(overlap_bound(sync, perfect, cores=2))


def _round(sync_steps_per_s: float, speedup: float, ceiling: float) -> dict:
    run = {"steps_per_s": sync_steps_per_s, "rollout_s": 0.2, "train_s": 0.8, "step_s": 1.0}
    single = {"rollout_s": 0.3, "train_s": 1.2, "step_s": 1.5}
    return {"runs": {"sync": run, "async": {**run, "steps_per_s": sync_steps_per_s * speedup}, "single": single,
                     "shared": single},
            "async_speedup": speedup, "async_speedup_ceiling": ceiling, "async_of_ceiling": speedup / ceiling,
            "async_speedup_any_overlap": 1.3}


def test_rounds_report_medians_of_each_rounds_own_ratio_with_their_spread():
    # Three rounds on a machine that drifts: the ratio is taken within each round, then the median.
    rounds = [_round(1.0, 0.80, 1.10), _round(0.7, 1.00, 1.05), _round(1.2, 0.90, 1.20)]
    out = round_summary(rounds)
    assert out["async_speedup"] == pytest.approx(0.90)
    assert (out["async_speedup_min"], out["async_speedup_max"]) == (pytest.approx(0.80), pytest.approx(1.00))
    assert out["async_speedup_ceiling"] == pytest.approx(1.10)
    # The median of the per-round ratios (0.727, 0.952, 0.75), not the ratio of the medians (0.818).
    assert out["async_of_ceiling"] == pytest.approx(0.75)
    assert out["async_of_ceiling_min"] == pytest.approx(0.8 / 1.1)
    assert out["sync_steps_per_s"] == pytest.approx(1.0)
    assert out["async_steps_per_s"] == pytest.approx(0.8)  # of 0.8, 0.7 and 1.08
    assert out["one_thread_train_s"] == pytest.approx(1.2)
    assert "shared_train_s" not in out  # on 2 cores the shared run is the one-thread run: not reported twice
