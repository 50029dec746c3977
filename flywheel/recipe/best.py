"""The run's best checkpoint, chosen by the judged evaluation: `best/` in the run directory.

Of every evaluation of a run (the base one at step 0 included), `best/` holds
the weights of the one with the highest eval reward among those where the
hacking watch (flywheel/hacking_watch.py) did not fire: a high reward that the
judges contradict is not a result. It is replaced only when a later evaluation
is strictly better, and written atomically (a folder built aside, then swapped
in by renames), so a kill leaves the old best or the new one, never a mix.

    best/best.json            {"step", "reward", "ema", "lora"}: what it holds
    best/weights.safetensors  the trained tensors as evaluated (the EMA average when that was evaluated)
    best/lora/                with model.finetune=lora: the adapter (diffusers' format where the card has a
                              pipeline, else peft's tensors in adapter_model.safetensors)

The record survives a resume from a checkpoint at or after its step: best/best.json
is read back, and the weights beside it are what it names. One written by an
evaluation after the resumed checkpoint is set aside by the resume (session.py,
`_set_aside_later_work`): the steps are trained again and rebuild it, so the
metrics equal a run that never stopped.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from flywheel.hacking_watch import WARNING_METRIC
from flywheel.runs.rundir import atomic_write_text, fsync_dir

BEST_DIRNAME = "best"
BEST_INFO_FILENAME = "best.json"
WEIGHTS_FILENAME = "weights.safetensors"
LORA_DIRNAME = "lora"
REWARD_KEY = "eval/reward/mean"
# Metrics of every evaluation: the step best/ holds after it (-1: none yet) and its reward.
BEST_STEP_METRIC = "eval/best_step"


def eligible(metrics: Mapping[str, float]) -> float | None:
    """The eval reward of an evaluation that may be the best one, else None: a finite reward, and no watch signal."""
    reward = metrics.get(REWARD_KEY)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return None
    if float(metrics.get(WARNING_METRIC, 0.0) or 0.0) != 0.0:
        return None
    return float(reward)


def read_best(run_dir: str | os.PathLike) -> dict | None:
    """best/best.json of a run directory, or None when it has none (or it is unreadable)."""
    path = Path(run_dir) / BEST_DIRNAME / BEST_INFO_FILENAME
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("step"), int) else None


class BestCheckpoint:
    """Keeps `run_dir/best/` on the evaluation with the highest eval reward and no hacking-watch signal."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / BEST_DIRNAME
        self._recover()
        self.state: dict | None = read_best(self.run_dir)

    @property
    def step(self) -> int | None:
        return None if self.state is None else int(self.state["step"])

    def _recover(self) -> None:
        # A swap killed between its two renames leaves the previous best at .best.old and no best/: put it back.
        old, tmp = self.run_dir / f".{BEST_DIRNAME}.old", self.run_dir / f".{BEST_DIRNAME}.tmp"
        if old.is_dir() and not self.path.exists():
            os.replace(old, self.path)
        for leftover in (old, tmp):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)

    def consider(self, step: int, metrics: Mapping[str, float], write: Callable[[Path], dict]) -> bool:
        """After the evaluation at `step`: if it is eligible and beats the best so far, `write(folder)` puts the
        weights into a fresh folder (returning what to record beside step and reward, e.g. {"ema": ...}) and
        the folder replaces best/. Returns whether best/ moved."""
        reward = eligible(metrics)
        if reward is None or (self.state is not None and not reward > float(self.state["reward"])):
            return False
        tmp, old = self.run_dir / f".{BEST_DIRNAME}.tmp", self.run_dir / f".{BEST_DIRNAME}.old"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            extra = write(tmp) or {}
            state = {"step": int(step), "reward": reward, **extra}
            atomic_write_text(tmp / BEST_INFO_FILENAME, json.dumps(state, sort_keys=True) + "\n")
            fsync_dir(tmp)
            if self.path.exists():
                if old.exists():
                    shutil.rmtree(old)
                os.replace(self.path, old)
            os.replace(tmp, self.path)
            fsync_dir(self.run_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
        self.state = state
        return True

    def metrics(self) -> dict[str, float]:
        """`eval/best_step`: the step best/ holds (-1 before any eligible evaluation)."""
        return {BEST_STEP_METRIC: float(-1 if self.step is None else self.step)}
