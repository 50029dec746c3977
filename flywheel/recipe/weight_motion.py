"""How far an update moved the trained weights, relative to their size, on a fixed sample of their elements.

A constant-rate AdamW moves each weight by about the learning rate a step, whatever the gradient's scale. A
learning rate far under the weights' size (1e-12 on float32 weights of magnitude 0.02) takes optimizer steps
that change nothing but rounding: every step is counted as trained, the run ends with exit status 0, and the
weights are the ones it started from. The loop logs `train/update_rel` (the RMS of the update over the RMS of
the weights) each step that took an optimizer step, and stops at the session's first one when it is under
MIN_RELATIVE_MOVE.

A sample rather than a copy: a copy of a full fine-tune's weights would double their memory; a few hundred
evenly spaced elements of every trained tensor cost nothing and see any update AdamW makes (it moves every
element whose gradient or weight decay is non-zero). Under FSDP each rank samples its own shards and the
sums are averaged over ranks.
"""

from __future__ import annotations

import math

import torch

from flywheel.distributed import all_reduce_mean

SAMPLE_PER_TENSOR = 256
# About float32's machine epsilon (1.19e-7): an update whose size relative to the weights is under it changes
# only their last bit, if that. A working run's first step is 1e-5 and up (1e-6 of a learning rate on weights of
# magnitude 0.02 is 5e-5).
MIN_RELATIVE_MOVE = 1e-7


class WeightMotion:
    """The same evenly spaced elements of every trained tensor, read before and after an update."""

    def __init__(self, named_params, per_tensor: int = SAMPLE_PER_TENSOR):
        self.params, self.index = [], []
        for _, p in named_params:
            n = p.numel()
            if n == 0:  # an FSDP rank's empty shard
                continue
            self.params.append(p)
            self.index.append(torch.linspace(0, n - 1, min(n, per_tensor), device=p.device).round().long())

    def sample(self) -> list[torch.Tensor]:
        """The sampled elements now (copies, in float64)."""
        with torch.no_grad():
            return [p.detach().reshape(-1)[i].double() for p, i in zip(self.params, self.index)]

    def relative_move(self, before: list[torch.Tensor]) -> float:
        """RMS(after - before) / RMS(before) over the sample, over every rank (inf when the weights were zero
        and moved, 0 when nothing moved)."""
        now = self.sample()
        if now:
            moved = float(sum(((a - b) ** 2).sum() for a, b in zip(now, before)))
            size = float(sum((b ** 2).sum() for b in before))
        else:
            moved = size = 0.0
        totals = all_reduce_mean({"moved": moved, "size": size})  # means over ranks: their ratio is the sums'
        if totals["size"] == 0:
            return math.inf if totals["moved"] > 0 else 0.0
        return math.sqrt(totals["moved"] / totals["size"])


def too_small_message(step: int, relative: float, learning_rate: float) -> str:
    """Why a run stops after an update that did not move its weights."""
    return (f"step {step}: the optimizer step moved the trained weights by {relative:.2g} of their size (RMS of "
            f"the update over RMS of the weights, under {MIN_RELATIVE_MOVE:g}: rounding), so the run would train "
            f"nothing; train.learning_rate={learning_rate:g} is too small for these weights (AdamW moves a weight "
            f"by about the learning rate a step): raise it")
