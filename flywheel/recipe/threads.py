"""How many torch threads a CPU rank of a recipe runs on.

The user's setting wins: the `threads` key, else OMP_NUM_THREADS from the
environment (as `accelerate launch` and torchrun export it for each rank),
else a count the caller already lowered torch to. Only when nothing was set
are the cores divided among the ranks on the machine, and even then a rank
never gets more threads than torch started with.
"""

from __future__ import annotations

import os

import torch

THREADS_ENV = "OMP_NUM_THREADS"


def rank_threads(requested: int | None, ranks: int, environ=os.environ) -> int:
    """The torch threads of one CPU rank: `requested` (> 0), else the user's, else cores // ranks."""
    if requested:
        return requested
    if environ.get(THREADS_ENV, "").strip():
        return torch.get_num_threads()  # torch read it at start; a later set_num_threads by the caller also wins
    return min(torch.get_num_threads(), max(1, (os.cpu_count() or 1) // max(1, ranks)))


def set_rank_threads(requested: int | None, ranks: int) -> int:
    """Apply `rank_threads` to this process; returns the count."""
    threads = rank_threads(requested, ranks)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
