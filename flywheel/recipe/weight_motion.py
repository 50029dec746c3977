"""How far the optimizer moves the trained weights, relative to their size: measured each step, and checked
against the learning rate before a run starts.

A constant-rate AdamW moves each weight by about the learning rate a step, whatever the gradient's scale
(while |gradient| is above its eps). A learning rate far under the weights' size (1e-12 on float32 weights of
RMS 0.02) takes optimizer steps that change nothing but rounding: every step counts as trained, the run exits
0, and the weights are the ones it started from. `check_step_size` refuses that before anything is
written, and with it a train.max_grad_norm that clips the gradient under AdamW's eps and a learning rate that
rounds away on most bfloat16 weights. The loop logs `train/update_rel` (the RMS of the update over the RMS of
the weights) each step that took an optimizer step; a step can rightly move a tensor by less (a Wan2.2 expert
whose timesteps no sample hit that step gets only weight decay), so the measurement is a metric, not a stop.

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
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which make_optimizer keeps
# 16-bit trained weights (a full fine-tune at model.dtype=bfloat16): a step changes a weight only when it is over
# half the weight's last bit, so small weights move and large ones do not. Under this fraction of the (non-zero)
# weights changing, most of each update rounds away.
MIN_FRACTION_CHANGED = 0.5


def check_step_size(learning_rate: float, max_grad_norm: float, named_params) -> None:
    """Refuse optimizer steps that could only round, before the run directory exists (one pass over the weights).

    AdamW moves each weight by about the learning rate a step while |gradient| is over its eps, and by
    lr·|gradient|/eps under it; clipping holds the gradient's norm to train.max_grad_norm, so its RMS per weight
    to max_grad_norm/sqrt(n). The step, lr·min(1, max_grad_norm/(sqrt(n)·eps)), must be at least
    MIN_RELATIVE_STEP of the trained weights' RMS (zero tensors, a LoRA's B, count in it), and for 16-bit weights
    it must change at least MIN_FRACTION_CHANGED of their non-zero elements (an evenly spaced sample of each
    tensor, added in the weights' own dtype)."""
    tensors = [p.detach() for _, p in named_params if p.numel()]
    count = sum(t.numel() for t in tensors)
    if not count:
        return
    # One host read for the whole model, not one per tensor.
    squares = float(sum(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for t in tensors))
    rms = math.sqrt(squares / count)
    if rms == 0:
        return  # all zero: nothing to compare the step with
    clip_factor = min(1.0, max_grad_norm / (math.sqrt(count) * ADAM_EPS))
    step = learning_rate * clip_factor
    if step < MIN_RELATIVE_STEP * rms:
        if learning_rate >= MIN_RELATIVE_STEP * rms:  # the rate alone would do: clipping is what holds it
            smallest_norm = MIN_RELATIVE_STEP * rms / learning_rate * math.sqrt(count) * ADAM_EPS
            raise ConfigError(
                f"train.max_grad_norm={max_grad_norm:g}: clipping holds the gradient of the {count} trained weights "
                f"to an RMS of {max_grad_norm / math.sqrt(count):.2g} per weight, under AdamW's eps ({ADAM_EPS:g}), "
                f"so each step moves a weight by about {step:.2g}, under {MIN_RELATIVE_STEP:g} of their RMS "
                f"({rms:.3g}), and the run would train nothing; it must be at least {smallest_norm:.1g} "
                f"(the shipped configs use 1.0)")
        raise ConfigError(f"train.learning_rate={learning_rate:g}: AdamW moves each weight by about the learning "
                          f"rate a step, and the trained weights' RMS is {rms:.3g}, so every step would change them "
                          f"by under {MIN_RELATIVE_STEP:g} of their size (rounding) and the run would train nothing; "
                          f"it must be at least {MIN_RELATIVE_STEP * rms:.1g} to move them past rounding (the shipped "
                          f"configs use 1e-4 to 3e-3)")
    check_low_precision_step(step, learning_rate, tensors)


def check_low_precision_step(step: float, learning_rate: float, tensors: list[torch.Tensor]) -> None:
    """Refuse a step that changes under MIN_FRACTION_CHANGED of the non-zero 16-bit trained weights (a sample of
    each tensor, the step added in the tensor's own dtype, which rounds as the optimizer's update would)."""
    narrow = [t for t in tensors if t.is_floating_point() and torch.finfo(t.dtype).bits <= 16]
    if not narrow:
        return
    with torch.no_grad():
        device = narrow[0].device
        counts = []
        for t in narrow:
            w = t.reshape(-1)[_spaced(t.numel(), t.device)]
            nonzero = w != 0  # a mask, not an index: no host sync per tensor
            counts.append(torch.stack([((w + step != w) & nonzero).sum(), nonzero.sum()]).to(device))
        changed, total = torch.stack(counts).sum(0).tolist()  # one host read for every tensor
    if total == 0 or changed >= MIN_FRACTION_CHANGED * total:
        return
    names = " and ".join(sorted({str(t.dtype).removeprefix("torch.") for t in narrow}))
    raise ConfigError(f"train.learning_rate={learning_rate:g} on {names} trained weights: a {names} weight changes "
                      f"only by a step over half its last bit, and a step of about {step:.2g} changes "
                      f"{changed / total:.0%} of them, so most of each update would round away; train float32 "
                      f"weights (model.dtype=float32, or a LoRA, whose adapter is float32) or raise the "
                      f"learning rate")


def _spaced(n: int, device, per_tensor: int = SAMPLE_PER_TENSOR) -> torch.Tensor:
    """per_tensor evenly spaced indices into n elements (all of them when fewer)."""
    return torch.linspace(0, n - 1, min(n, per_tensor), device=device).round().long()


class WeightMotion:
    """The same evenly spaced elements of every trained tensor, read before and after an update."""

    def __init__(self, named_params, per_tensor: int = SAMPLE_PER_TENSOR):
        self.params, self.index = [], []
        for _, p in named_params:
            n = p.numel()
            if n == 0:  # an FSDP rank's empty shard
                continue
            self.params.append(p)
            self.index.append(_spaced(n, p.device, per_tensor))

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
