"""The Flow-DPPO policy loss (arXiv 2606.11025): PPO's ratio clip replaced by an asymmetric mask on the exact
per-step Gaussian KL to the behaviour policy. Used by trainers/grpo.py with `train.policy_loss=dppo`.

Why a KL and not the ratio. A Flow-SDE (or CPS) step is a Gaussian whose std s
does not depend on the weights, so the divergence of the current step policy
from the one that sampled is known exactly and cheaply from the two means:

    KL_i = mean over elements of |mu_theta,i - mu_old,i|^2 / (2 s^2)        (per sample i, per step)

while the ratio r_i = pi_theta(x_next | x) / pi_old(x_next | x) of the taken
step is a one-sample estimate of it. PPO's clip |r - 1| <= eps therefore over-
and under-constrains different steps; DPPO bounds the KL instead.

The loss of one step, per sample i with advantage A_i and ratio r_i:

    l_i = -A_i · r_i · M_i,
    M_i = 0  if KL_i > delta and ((A_i > 0 and r_i > 1) or (A_i < 0 and r_i < 1)),  else 1,

M detached (no gradient through the mask). The mask is asymmetric: a sample
is dropped only once it is outside the trust region (KL above the threshold
delta) AND its gradient would push it further out (a positive advantage raising
a ratio already above 1, a negative one lowering a ratio already below 1).
A sample outside the region whose gradient pulls it back keeps it, and inside
the region every sample keeps its unclipped policy gradient.

Facts from the public code (read for facts only; the paper's text could not be
read from here, so no equation numbers): the mask rule above and the
"x-based" KL of the transition means with the exact variance s^2 =
(sigma_t·sqrt|dt|)^2 are those of verl-omni (DiffusionLossConfig: loss_mode
flow_dppo, kl_mask_threshold 1e-5, add_kl_coefficient true), Flow-Factory
(DPPOTrainingArguments: kl_mask_type x-based, kl_mask_threshold 1e-6, no
clip_range) and a third public reimplementation (threshold 1.0, KL averaged over
the latent's elements). The KL is averaged over the elements, as all three do.
Deviation: that reimplementation divides the summed loss by the number of kept
samples; here the weights are GRPO's (each usable sample 1 / the usable count,
a dropped one adding 0), so a mask that acts lowers the step's gradient instead
of re-weighting the rest, as PPO's clip does.
"""

from __future__ import annotations

import torch


def dppo_keep_mask(ratio: torch.Tensor, advantages: torch.Tensor, kl_old: torch.Tensor,
                   threshold: float) -> torch.Tensor:
    """[B] bool: M_i of the module docstring, False where a sample's gradient is dropped.

    Dropped: KL_i > threshold and the advantage pushes the ratio further from 1
    (A > 0 with r > 1, or A < 0 with r < 1).
    """
    outside = kl_old > threshold
    away = ((advantages > 0) & (ratio > 1)) | ((advantages < 0) & (ratio < 1))
    return ~(outside & away)


def dppo_sample_loss(ratio: torch.Tensor, advantages: torch.Tensor, kl_old: torch.Tensor,
                     threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(l [B], keep [B]): l_i = -A_i · r_i · M_i (the module docstring), the mask M detached."""
    keep = dppo_keep_mask(ratio.detach(), advantages, kl_old.detach(), threshold)
    return -advantages * ratio * keep.to(ratio.dtype), keep


def dppo_loss(ratio: torch.Tensor, advantages: torch.Tensor, kl_old: torch.Tensor, threshold: float,
              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_i w_i · l_i, keep [B]): one step's Flow-DPPO loss with per-sample weights w (GRPO's: usable / the
    number usable)."""
    per_sample, keep = dppo_sample_loss(ratio, advantages, kl_old, threshold)
    return (per_sample * weight).sum(), keep
