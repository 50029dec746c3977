"""eval.stop_on_hacking=N: end a run after N consecutive evaluations where the hacking watch fired.

Off by default (0). A run that stops this way ends normally (exit status 0)
after its usual end-of-run saves (a checkpoint of the step it stopped at among
them), with a last line that says why; best/
(flywheel/recipe/best.py) holds the best judged evaluation, and the checkpoints
saved during the streak of signals do not prune the last one saved before it
(the last good checkpoint), so a resume can start from there with other settings.
"""

from __future__ import annotations

from collections.abc import Mapping

from flywheel.hacking_watch import WARNING_METRIC


class HackingStop:
    """Counts the consecutive evaluations with a watch signal; `should_stop` once there are `patience` of them."""

    def __init__(self, patience: int, checkpointed: Mapping | None = None):
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"eval.stop_on_hacking={patience!r}: must be an integer >= 0 (0 = off)")
        self.patience = patience
        checkpointed = checkpointed or {}
        self.streak = int(checkpointed.get("hacking_streak", 0))
        self.last_good_checkpoint: int | None = checkpointed.get("last_good_checkpoint")

    def observe(self, metrics: Mapping[str, float]) -> None:
        """After an evaluation (its metrics, with the watch's eval/hacking_warning)."""
        fired = float(metrics.get(WARNING_METRIC, 0.0) or 0.0) != 0.0
        self.streak = self.streak + 1 if fired else 0

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.streak >= self.patience

    def keep_last(self, keep_checkpoints: int | None) -> int | None:
        """The pruning of a checkpoint saved now: none while signals are firing (the last good one stays)."""
        return None if self.patience > 0 and self.streak > 0 else keep_checkpoints

    def saved(self, step: int) -> None:
        """A checkpoint of `step` was written; it is a good one when no signal is firing."""
        if self.streak == 0:
            self.last_good_checkpoint = step

    def state(self) -> dict:
        """What a checkpoint carries, so a resumed run keeps counting."""
        return {"hacking_streak": self.streak, "last_good_checkpoint": self.last_good_checkpoint}

    def reason(self, step: int, best_step: int | None, best_reward: float | None, checkpoints_dir) -> str:
        """The run's last line when it stops early."""
        best = ("best/ holds no evaluation" if best_step is None
                else f"best/ holds step {best_step} (eval reward {best_reward:.3f})")
        good = ("no checkpoint was saved before the signals" if self.last_good_checkpoint is None
                else f"the last checkpoint before them is {checkpoints_dir}/step_{self.last_good_checkpoint:06d}")
        return (f"stopped at step {step}: the hacking watch fired at {self.streak} consecutive evaluations "
                f"(eval.stop_on_hacking={self.patience}); {best}; {good}; the weights it stopped with are in "
                f"{checkpoints_dir}/step_{step:06d}")
