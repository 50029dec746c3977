"""The rectified-flow pieces the flow-matching recipes (NFT, AWM, DPO) share.

    x_t = (1 - t)·x0 + t·eps        t = 1 is noise, t = 0 data
    u   = eps - x0                  the velocity target
"""

from __future__ import annotations

import torch


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t)·x0 + t·noise, with t a scalar, a [B] vector (one time per row) or already broadcastable."""
    if t.dim() == 1:
        t = t.reshape(-1, *([1] * (x0.dim() - 1)))
    return (1 - t) * x0 + t * noise


def matching_error(v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per-row flow-matching error: mean over elements of (v - (noise - x0))^2, shape [N], float32."""
    target = noise.float() - x0.float()
    return (v.float() - target).pow(2).flatten(1).mean(1)


def velocity_mse(v: torch.Tensor, v_other: torch.Tensor) -> torch.Tensor:
    """Per-row velocity MSE to another model's velocity (a reference or an anchor, held fixed): mean over elements
    of (v - v_other)^2, shape [N], float32; the gradient flows through v only."""
    return (v.float() - v_other.detach().float()).pow(2).flatten(1).mean(1)
