"""WeightSyncController: moves the trainer's weights into the serving engine.

The contract (DESIGN.md): freeze -> drain -> transfer -> bump version +
invalidate caches -> resume. Calls already running finish on the version they
started with; calls that arrive during a sync wait and then run on the new
version; nothing is dropped. Each phase is timed for the metrics.

Colocated mode: the engine serves the trainer's own module, so the transfer
is free (the optimizer already updated the weights in place). The sync still
runs the full protocol so that versions and caches stay honest.
"""

from __future__ import annotations

import enum
import time

from engine import Engine

MODES = ("colocated",)


class SyncState(enum.Enum):
    IDLE = "idle"
    FROZEN = "frozen"
    DRAINED = "drained"
    TRANSFERRED = "transferred"


class WeightSyncController:
    """Runs the sync protocol against one engine and counts versions."""

    def __init__(self, engine: Engine, mode: str = "colocated", timeout_s: float = 600.0):
        if mode not in MODES:
            raise ValueError(f"weight sync mode {mode!r} is not available; valid modes: {', '.join(MODES)}")
        self.engine = engine
        self.mode = mode
        self.timeout_s = timeout_s
        self.state = SyncState.IDLE

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def sync(self, prompt_encoder_changed: bool = False) -> dict[str, float]:
        """Push the current weights; returns the phase timings and the new version."""
        if self.state is not SyncState.IDLE:
            raise RuntimeError(f"a weight sync is already in progress (state {self.state.value})")
        start = time.perf_counter()
        self.engine.pause()
        self.state = SyncState.FROZEN
        try:
            drain_s = self.engine.drain(timeout_s=self.timeout_s)
            self.state = SyncState.DRAINED
            transfer_start = time.perf_counter()
            transferred_bytes = 0  # colocated: the engine already holds the trainer's tensors
            transfer_s = time.perf_counter() - transfer_start
            self.state = SyncState.TRANSFERRED
            self.engine.set_weight_version(self.engine.weight_version + 1,
                                           prompt_encoder_changed=prompt_encoder_changed)
        finally:
            self.engine.resume()
            self.state = SyncState.IDLE
        return {
            "sync/drain_s": drain_s,
            "sync/transfer_s": transfer_s,
            "sync/total_s": time.perf_counter() - start,
            "sync/bytes": float(transferred_bytes),
            "weight_version": self.engine.weight_version,
        }
