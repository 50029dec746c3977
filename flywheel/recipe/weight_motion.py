"""How far the optimizer moves the trained weights, relative to their size: measured each step, and checked
against the learning rate before a run starts.

A constant-rate AdamW moves each weight by about the learning rate a step, whatever the gradient's scale
(while |gradient| is above its eps). A learning rate far under the weights' size (1e-12 on float32 weights of
RMS 0.02) takes optimizer steps that change nothing but rounding: every step counts as trained, the run exits
0, and the weights are the ones it started from. `check_learning_rate` refuses that before anything is
written. The loop logs `train/update_rel` (the RMS of the update over the RMS of the weights) each step that
took an optimizer step; a step can rightly move a tensor by less (a Wan2.2 expert whose timesteps no sample
hit that step gets only weight decay), so the measurement is a metric, not a stop.

The metric reads a sample rather than a copy: a copy of a full fine-tune's weights would double their memory;
a few hundred evenly spaced elements of every trained tensor cost nothing and see any update AdamW makes (it
moves every element whose gradient or weight decay is non-zero). Under FSDP each rank samples its own shards
and the sums are averaged over ranks.
"""

from __future__ import annotations

import math

import torch

from flywheel.config.parsing import ConfigError
from flywheel.distributed import all_reduce_mean

SAMPLE_PER_TENSOR = 256
# About float32's machine epsilon (1.19e-7): a step smaller than this relative to the weights changes at most
# their last bit. Working runs sit far above it (1e-6 of a learning rate on weights of RMS 0.02 is 5e-5).
MIN_RELATIVE_STEP = 1e-7


def check_learning_rate(learning_rate: float, named_params) -> None:
    """Refuse a learning rate whose AdamW steps (about the learning rate per weight) are under MIN_RELATIVE_STEP
    of the trained weights' RMS: they would change the weights by rounding only. Zero tensors (a LoRA's B) count
    in the RMS; one pass over the weights, before the run directory exists."""
    tensors = [p.detach() for _, p in named_params if p.numel()]
    count = sum(t.numel() for t in tensors)
    # One host read for the whole model, not one per tensor.
    squares = float(sum(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for t in tensors)) if count else 0.0
    rms = math.sqrt(squares / count) if count else 0.0
    if rms > 0 and learning_rate < MIN_RELATIVE_STEP * rms:
        raise ConfigError(f"train.learning_rate={learning_rate:g}: AdamW moves each weight by about the learning "
                          f"rate a step, and the trained weights' RMS is {rms:.3g}, so every step would change them "
                          f"by under {MIN_RELATIVE_STEP:g} of their size (rounding) and the run would train nothing; "
                          f"it must be at least {MIN_RELATIVE_STEP * rms:.1g} to move them past rounding (the shipped "
                          f"configs use 1e-4 to 3e-3)")


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
