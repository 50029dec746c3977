"""Importing this before torch makes OpenMP's idle threads sleep instead of spin, unless the user chose.

OpenMP reads its wait policy once, as torch loads: the recipes import this
module first. By default (GNU OpenMP, which torch's CPU wheels use) a thread
that waits at the end of a parallel region spins for a while before it
sleeps. On cores that another job shares, the spinning thread burns the time
slice the thread it waits for needs: with two torch threads on two shared
cores a toy rollout took over 20x longer than with OMP_WAIT_POLICY=PASSIVE
(`benchmarks/cpu_wait.py`; the README's "CPU threads"). A user who set any
of the wait variables keeps their setting.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
# Any of these is the user's choice of how idle OpenMP threads wait (GNU OpenMP's and Intel OpenMP's own knobs).
WAIT_ENV_KEYS = (WAIT_POLICY_ENV, "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "KMP_LIBRARY")


def passive_wait_by_default(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE in `environ` unless a wait variable is already set; True if it set it."""
    if any(environ.get(key, "").strip() for key in WAIT_ENV_KEYS):
        return False
    environ[WAIT_POLICY_ENV] = "PASSIVE"
    return True


passive_wait_by_default()
