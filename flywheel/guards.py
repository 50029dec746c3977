"""Guards that stop a run at the first non-finite number, naming the step and what went bad.

DESIGN.md: non-finite losses, gradients or weights stop the run at once. A NaN
that flows on masks every sample, writes NaN checkpoints and prunes the good
ones; stopping before the optimizer step (or right after it, for weights)
keeps the last checkpoint on disk the last good state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class RunStoppedError(RuntimeError):
    """The run stopped itself at the step its message names, its checkpoints on disk the last good state: a
    non-finite number, or rewards that gave nothing to learn from for too long. The command line prints the
    message and the newest checkpoint in place of a traceback into the guard (flywheel/cli.py)."""


class NonFiniteError(RunStoppedError, FloatingPointError):
    """A loss, gradient norm, metric or weight is NaN or inf; the run stops at the step named."""


class NoSignalError(RunStoppedError):
    """Consecutive steps whose rewards carried no signal (every sample masked, or every group flat)."""


def check_finite(value: float | torch.Tensor, what: str, step: int, hint: str = "") -> None:
    """Raise NonFiniteError when a scalar is NaN or inf."""
    v = float(value)
    if not math.isfinite(v):
        raise NonFiniteError(f"step {step}: {what} is {v}; the run stops here and the checkpoints on disk are the "
                             f"last good ones{'. ' + hint if hint else ''}")


def check_finite_weights(named_params: Iterable[tuple[str, torch.Tensor]], step: int, hint: str = "") -> None:
    """Raise NonFiniteError naming the first parameter holding a NaN or inf (one host sync for all of them)."""
    named = list(named_params)
    if not named:
        return
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).cpu()
    if not bool(finite.all()):
        bad = [name for (name, _), ok in zip(named, finite.tolist()) if not ok]
        raise NonFiniteError(f"step {step}: weight {bad[0]!r} ({len(bad)} tensor(s) in all) holds NaN or inf after "
                             f"the optimizer step; the run stops here and the checkpoints on disk are the last good "
                             f"ones{'. ' + hint if hint else ''}")
