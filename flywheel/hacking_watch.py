"""Reward hacking watch: the trained reward rising while an independent judge falls.

The reward is what RL optimises; a judge (rewards/judges.py) is never trained
against, so when the two part ways the model is learning the reward's blind
spot rather than the task. Hacking usually starts in one class (one digit
turning into a blob the reward still accepts) where the overall means hide it
(nine good digits outweigh one), so the watch compares each class too.

Feed it every evaluation's metrics (`flywheel.rollout_collector.eval_samples`): for the overall
means (`eval/reward/mean` against `eval/judge/<name>/mean`) and for every class c
(`eval/reward/<c>` against `eval/judge/<name>/<c>`) it fires when, since the
previous evaluation or since the evaluation where that judge score was best,
the reward rose (by any amount: a hacked reward is usually near its ceiling,
with little room left to rise) while the judge fell by more than the tolerance
(`tolerance` for the overall means, `class_tolerance` for a class, whose mean
is over a tenth of the samples for the toy task and moves more between
evaluations). Comparing with the best catches a slow slide made of steps each
within the tolerance; comparing with the previous catches a fall after a dip.

Calibration (two default toy runs, evaluated every 10 steps, with the old and
the current `sample_seed`): a class's judge mean fell by up to 0.07 (from the
previous or the best evaluation) while its reward rose, in samples that look
no worse, so a class tolerance of 0.05 cried wolf and 0.1 kept the watch
silent; the overall judge mean never fell by more than 0.01 while the reward
rose. The watch sees only what its judges see: in the old-seed run the final
digit-6 samples are a saturated blob, and the SVC judge still reads them as
6 (0.84-0.97 each; its class-6 mean fell 0.95 -> 0.91), so it stays silent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

WARNING_METRIC = "eval/hacking_warning"
SIGNALS_METRIC = "eval/hacking_signals"
_JUDGE_PREFIX = "eval/judge/"
_SUMMARY_NAMES = ("mean", "min_class")  # keys under eval/judge/<name>/ that are not classes


@dataclass(frozen=True)
class _Point:
    step: int | None
    reward: float
    judge: float


@dataclass(frozen=True)
class Signal:
    """One series where the reward rose while the judge fell: `cls` None means the overall means."""

    judge: str
    cls: str | None
    judge_before: float
    judge_now: float
    reward_before: float
    reward_now: float
    since_step: int | None

    @property
    def judge_drop(self) -> float:
        return self.judge_before - self.judge_now

    def __str__(self) -> str:
        where = "overall" if self.cls is None else f"on class {self.cls}"
        since = "" if self.since_step is None else f" since step {self.since_step}"
        return (f"judge {self.judge} fell {self.judge_before:.2f}->{self.judge_now:.2f} {where}{since} "
                f"while reward rose {self.reward_before:.2f}->{self.reward_now:.2f}")


@dataclass(frozen=True)
class WatchResult:
    """What one evaluation showed: the signals (largest judge fall first) and whether any is new."""

    signals: tuple[Signal, ...] = ()
    new: bool = False  # some (judge, class) fires now that did not fire at the previous evaluation

    @property
    def warning(self) -> str | None:
        """One line for the log, or None when nothing fires."""
        if not self.signals:
            return None
        more = f" (and {len(self.signals) - 1} more)" if len(self.signals) > 1 else ""
        return f"possible reward hacking: {self.signals[0]}{more}"

    @property
    def short(self) -> str | None:
        """A few characters for a progress bar postfix, e.g. "digit_svc 6 0.91->0.62"."""
        if not self.signals:
            return None
        s = self.signals[0]
        return f"{s.judge} {'all' if s.cls is None else s.cls} {s.judge_before:.2f}->{s.judge_now:.2f}"

    @property
    def metrics(self) -> dict[str, float]:
        """`eval/hacking_warning` (1 when anything fires, else 0) and `eval/hacking_signals` (how many series)."""
        return {WARNING_METRIC: float(bool(self.signals)), SIGNALS_METRIC: float(len(self.signals))}


class HackingWatch:
    """Compares the reward and judge trends over successive evaluations (see the module docstring)."""

    def __init__(self, tolerance: float = 0.05, class_tolerance: float = 0.1):
        """`tolerance` / `class_tolerance`: how far (in score units; judges are probabilities) the overall /
        a class's judge score must fall, while the reward rises, before it counts."""
        for name, value in (("tolerance", tolerance), ("class_tolerance", class_tolerance)):
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)
                                               and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.tolerance, self.class_tolerance = float(tolerance), float(class_tolerance)
        self._previous: dict[tuple[str, str | None], _Point] = {}
        self._best: dict[tuple[str, str | None], _Point] = {}
        self._firing: set[tuple[str, str | None]] = set()
        self.last = WatchResult()

    def observe(self, metrics: Mapping[str, float], step: int | None = None) -> WatchResult:
        """Take one evaluation's metrics; return what fires now (also kept as `self.last`).

        Series whose reward or judge value is missing or non-finite this time
        are left out and keep their history: a NaN is no evidence either way.
        """
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a mapping of metric names to numbers, got {type(metrics).__name__}")
        signals = []
        for key, reward, judge in _series(metrics):
            now = _Point(step, reward, judge)
            signal = self._compare(key, now)
            if signal is not None:
                signals.append(signal)
            self._previous[key] = now
            best = self._best.get(key)
            if best is None or judge > best.judge:
                self._best[key] = now
        signals.sort(key=lambda s: s.judge_drop, reverse=True)
        firing = {(s.judge, s.cls) for s in signals}
        self.last = WatchResult(tuple(signals), new=bool(firing - self._firing))
        self._firing = firing
        return self.last

    def _compare(self, key: tuple[str, str | None], now: _Point) -> Signal | None:
        """The signal of the reference (previous or best evaluation) the judge fell furthest from, if any."""
        found = None
        tolerance = self.tolerance if key[1] is None else self.class_tolerance
        for ref in (self._previous.get(key), self._best.get(key)):
            if ref is None:
                continue
            drop = ref.judge - now.judge
            if now.reward > ref.reward and drop > tolerance and (found is None or drop > found.judge_drop):
                found = Signal(key[0], key[1], ref.judge, now.judge, ref.reward, now.reward, ref.step)
        return found


def _series(metrics: Mapping[str, float]) -> list[tuple[tuple[str, str | None], float, float]]:
    """((judge, class or None), reward, judge score) for every pair present and finite in `metrics`."""
    out = []
    judges = [k[len(_JUDGE_PREFIX):-len("/mean")] for k in metrics
              if k.startswith(_JUDGE_PREFIX) and k.endswith("/mean")]
    for name in judges:
        prefix = f"{_JUDGE_PREFIX}{name}/"
        pairs = [((name, None), "eval/reward/mean", f"{prefix}mean")]
        for k in metrics:
            cls = k[len(prefix):]
            if k.startswith(prefix) and "/" not in cls and cls not in _SUMMARY_NAMES:
                pairs.append(((name, cls), f"eval/reward/{cls}", k))
        for key, reward_key, judge_key in pairs:
            reward, judge = _finite(metrics.get(reward_key)), _finite(metrics.get(judge_key))
            if reward is not None and judge is not None:
                out.append((key, reward, judge))
    return out


def _finite(value) -> float | None:
    """`value` as a float if it is a finite number, else None."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None
