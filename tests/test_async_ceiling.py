"""benchmarks/async_flywheel.py's bounds on what async rollouts can gain: the engine-process layout's ceiling
(engine on one thread, trainer on the other cores until the rollout ends, then on all) and any schedule's."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ holds scripts, not an installed package

from benchmarks.async_flywheel import layout_ceiling, layout_step_s, overlap_bound  # noqa: E402


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
