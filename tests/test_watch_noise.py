"""benchmarks/watch_noise.py's figures on fabricated evaluations (no model runs here)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ holds scripts, not an installed package

from benchmarks import watch_noise as wn  # noqa: E402


def evaluation(typicality_3: float, svc_3: float, reward: float = 0.5) -> dict[str, float]:
    """One evaluation's metrics: one class (3) under two judges, with the summary keys that are not classes."""
    return {"eval/reward/mean": reward, "eval/reward/3": reward,
            "eval/judge/digit_typicality/mean": typicality_3, "eval/judge/digit_typicality/3": typicality_3,
            "eval/judge/digit_typicality/min_class": typicality_3,
            "eval/judge/digit_svc/mean": svc_3, "eval/judge/digit_svc/3": svc_3,
            "eval/judge/digit_svc/min_class": svc_3}


def test_class_series_are_the_per_class_keys_only():
    series = wn.class_series([evaluation(0.5, 0.9), evaluation(0.3, 0.9)])
    assert series == {"digit_typicality/3": [0.5, 0.3], "digit_svc/3": [0.9, 0.9]}


def test_noise_figures_golden():
    evals = [evaluation(t, s) for t, s in ((0.5, 0.90), (0.3, 0.92), (0.45, 0.88))]
    figures = wn.noise_figures(evals, class_tolerance=0.1)
    # sd of a class mean: typicality stdev(0.5, 0.3, 0.45) = sqrt(0.021667 / 2) = 0.10408, svc stdev(0.90, 0.92,
    # 0.88) = 0.02; the median of the two series is their mean, 0.06204.
    assert figures["sd_median"] == pytest.approx(0.06204, abs=1e-5)
    # Differences: typicality 0.2, 0.05, -0.15 and svc -0.02, 0.02, 0.04; signed and mirrored, their population std.
    typ = statistics.pstdev([0.2, 0.05, -0.15, -0.2, -0.05, 0.15])
    svc = statistics.pstdev([-0.02, 0.02, 0.04, 0.02, -0.02, -0.04])
    assert figures["drop_sd_median"] == pytest.approx((typ + svc) / 2)
    # Of the 6 differences typicality's 0.2 and -0.15 are over 0.1 in size.
    assert figures["over_tolerance"] == pytest.approx(2 / 6)
    assert figures["class_series"] == 2


def test_noise_figures_refuse_evaluations_without_classes():
    with pytest.raises(ValueError, match="per-class judge means"):
        wn.noise_figures([{"eval/reward/mean": 0.5}] * 3, class_tolerance=0.1)


def test_false_alarms_count_evaluations_where_the_rising_replay_fired():
    # A judge that never moves never fires, whatever the order.
    assert wn.false_alarm_rate([evaluation(0.5, 0.9, r) for r in (0.9, 0.1, 0.5)], orders=5) == 0.0
    # Two values 0.3 apart: in every order the watch fires at the evaluations where 0.2 follows a 0.5 (previous
    # or best), and never after a 0.2 alone. With reward rising, 0.5, 0.2, 0.2 fires twice (best 0.5 both times).
    evals = [evaluation(0.5, 0.9), evaluation(0.2, 0.9), evaluation(0.2, 0.9)]
    rate = wn.false_alarm_rate(evals, orders=40)
    # Orders (of 3 distinct positions): 0.5 first -> 2 firings of 2; 0.5 second -> 1 of 2; 0.5 last -> 0 of 2.
    assert rate == pytest.approx(0.5, abs=0.1)
    assert wn.false_alarm_rate(evals, orders=40) == rate  # seeded: the same shuffles each time


def test_rising_replaces_every_reward_by_a_ramp():
    out = wn.rising([evaluation(0.5, 0.9, 0.8), evaluation(0.5, 0.9, 0.1)])
    assert [e["eval/reward/mean"] for e in out] == [0.0, 1.0] and out[1]["eval/reward/3"] == 1.0
    assert out[1]["eval/judge/digit_svc/3"] == 0.9
