"""Asynchronous rollouts: the engine generates step s+1 while the trainer trains on step s.

The engine runs in its own process (`flywheel.sync.engine_process`), so rollout and
training use different cores; a background thread only waits on it. A batch
generated with weights `staleness` versions older than the trainer's is used
if staleness <= rollout.max_staleness, else thrown away and generated again. The
trainer corrects for the lag with a truncated importance weight (see
`trainers/grpo.py`), and the staleness of every batch used is counted.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class AsyncCollector:
    """Keeps one `collect(step)` running ahead of the trainer."""

    def __init__(self, collect: Callable[[int], object], max_staleness: int = 1):
        if max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {max_staleness}")
        self.collect = collect
        self.max_staleness = max_staleness
        self.staleness_counts: Counter[int] = Counter()
        self.regenerated = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self._pending: dict[int, Future] = {}

    def prefetch(self, step: int) -> None:
        """Start collecting `step` in the background (no-op if already started)."""
        if step not in self._pending:
            self._pending[step] = self._executor.submit(self.collect, step)

    def rollout_running(self) -> bool:
        """Whether a prefetched collect is still running."""
        return any(not future.done() for future in self._pending.values())

    def get(self, step: int, trainer_version: int):
        """The batch of `step`: the prefetched one if fresh enough, else a new one."""
        self.prefetch(step)
        batch = self._pending.pop(step).result()
        staleness = trainer_version - batch.trajectory.weight_version
        if staleness > self.max_staleness:
            self.regenerated += 1
            batch = self.collect(step)
            staleness = trainer_version - batch.trajectory.weight_version
        self.staleness_counts[staleness] += 1
        batch.metrics["staleness"] = staleness
        return batch

    def metrics(self) -> dict[str, float]:
        """The staleness histogram so far, and how many batches were regenerated."""
        out = {f"staleness/count_{k}": float(v) for k, v in sorted(self.staleness_counts.items())}
        out["staleness/regenerated"] = float(self.regenerated)
        return out

    def state_dict(self) -> dict:
        """The counts behind `metrics()`, JSON-able, for a checkpoint's trainer state."""
        return {"staleness_counts": {str(k): v for k, v in sorted(self.staleness_counts.items())},
                "regenerated": self.regenerated}

    def load_state_dict(self, state: dict) -> None:
        """Continue the counts of a checkpoint, so a resumed run's staleness metrics continue too."""
        counts = {int(k): int(v) for k, v in state["staleness_counts"].items()}
        if any(k < 0 or v < 0 for k, v in counts.items()) or int(state["regenerated"]) < 0:
            raise ValueError(f"async collector state has negative staleness or counts: {state}")
        self.staleness_counts = Counter(counts)
        self.regenerated = int(state["regenerated"])

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._executor.shutdown(wait=True)
