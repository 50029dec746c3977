"""Samplers for rectified-flow models, separate from any model.

Convention (DESIGN.md): x_t = (1 - t)·x0 + t·eps, t = 1 is noise, t = 0 is data,
velocity v = eps - x0. Sampling walks a schedule t_0 = 1 > t_1 > ... > t_T = 0,
so every step has dt = t_{k+1} - t_k < 0.

ODE (Euler):   x_{k+1} = x_k + dt · v

Flow-SDE (Flow-GRPO, arXiv 2505.05470, Eq. 9) with noise level a:
    sigma_t = a · sqrt(t / (1 - t))
    mean    = x_k + dt · [v + sigma_t² / (2t) · (x_k + (1 - t) · v)]
    std     = sigma_t · sqrt(-dt)
    x_{k+1} = mean + std · eps_k,  eps_k ~ N(0, I)
    log p(x_{k+1} | x_k) = mean over elements of the Gaussian log-density.

At t = 1 the ratio t / (1 - t) is infinite; as Flow-GRPO does, the 1 - t in
the denominator is floored at 1 - t_1 (the next schedule point), which keeps
the first step finite. With a = 0 the SDE step reduces to the Euler step
exactly (every correction is multiplied by zero), and its log-prob is 0.

The log-prob is averaged over elements (not summed) so that its scale does
not depend on the image size; constants cancel in PPO ratios anyway.
"""

from __future__ import annotations

import math

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def flow_timesteps(steps: int, shift: float = 1.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The schedule t_0 = 1 > ... > t_T = 0 (fp32), with SD3's time shift.

    shift s maps t -> s·t / (1 + (s - 1)·t); s > 1 spends more steps near noise.
    """
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    if shift != 1.0:
        t = shift * t / (1 + (shift - 1) * t)
    return t.to(dtype=torch.float32, device=device)


def ode_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor) -> torch.Tensor:
    """One Euler step of the probability-flow ODE."""
    return x + (t_next - t) * v


def sde_t_cap(timesteps: torch.Tensor) -> torch.Tensor:
    """The cap on t in sigma's denominator: the schedule's second point (Flow-GRPO)."""
    return timesteps[1] if timesteps.shape[0] > 2 else timesteps[0] * 0.5


def sde_sigma(t: torch.Tensor, noise_level: float | torch.Tensor, t_cap: torch.Tensor) -> torch.Tensor:
    """sigma_t = a·sqrt(t / (1 - t)), with t in the denominator capped at t_cap (< 1)."""
    return noise_level * torch.sqrt(t / (1 - torch.minimum(t, t_cap)))


def sde_mean_std(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor,
                 noise_level: float | torch.Tensor, t_cap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of the Flow-SDE transition x_t -> x_{t_next}."""
    dt = t_next - t
    sigma = sde_sigma(t, noise_level, t_cap)
    mean = x + dt * (v + sigma**2 / (2 * t) * (x + (1 - t) * v))
    std = sigma * torch.sqrt(-dt)
    return mean, std


def gaussian_step_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over elements of log N(x_next; mean, std²); 0 where std == 0."""
    stochastic = std > 0
    safe_std = torch.where(stochastic, std, torch.ones_like(std))
    log_density = -((x_next - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    per_sample = log_density.flatten(1).mean(dim=1)
    return torch.where(stochastic, per_sample, torch.zeros_like(per_sample))


def sde_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor,
             noise_level: float | torch.Tensor, noise: torch.Tensor,
             t_cap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Flow-SDE step: returns (x_next, log_prob [B])."""
    mean, std = sde_mean_std(x, v, t, t_next, noise_level, t_cap)
    x_next = mean + std * noise
    return x_next, gaussian_step_log_prob(x_next, mean, std)


def sde_step_log_prob(x: torch.Tensor, x_next: torch.Tensor, v: torch.Tensor, t: torch.Tensor,
                      t_next: torch.Tensor, noise_level: float | torch.Tensor,
                      t_cap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob of a step already taken, under velocity v: (log_prob [B], mean, std).

    Uses the same arithmetic as `sde_step`, so with unchanged weights the
    recomputed log-prob equals the recorded one bit for bit.
    """
    mean, std = sde_mean_std(x, v, t, t_next, noise_level, t_cap)
    return gaussian_step_log_prob(x_next, mean, std), mean, std


def step_noise_levels(steps: int, sampler: str, noise_level: float,
                      sde_window: tuple[int, int] | None = None) -> list[float]:
    """The noise level `a` of every step: 0 for ODE steps, `noise_level` inside the SDE window."""
    if sampler == "ode":
        return [0.0] * steps
    start, end = sde_window if sde_window is not None else (0, steps)
    return [noise_level if start <= k < end else 0.0 for k in range(steps)]
