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

CPS (coefficients-preserving sampling, arXiv 2509.05952) with noise level eta in [0, 1):
    x0_hat  = x_k - t · v                      (predicted data)
    eps_hat = x_k + (1 - t) · v                (predicted noise)
    std     = t_next · sin(eta · pi / 2)
    mean    = (1 - t_next) · x0_hat + sqrt(t_next² - std²) · eps_hat
    x_{k+1} = mean + std · eps_k
The noise coefficients t_next·cos(eta·pi/2) and std add in quadrature to
t_next, so x_{k+1} keeps the marginal's coefficients (1 - t_next, t_next)
instead of the Flow-SDE's drifting ones. sqrt(t_next² - std²) is computed as
t_next · cos(eta · pi / 2), the same value without a negative under the root.
Its log-prob is the Gaussian log-density of the taken step with that mean and
std (mean over elements, as for Flow-SDE). With eta = 0 the mean is
x_k + (t_next - t) · v algebraically: the Euler step, equal up to rounding.

DPM-Solver++(2M) (Lu et al., arXiv 2211.01095, Alg. 2, the multistep second-order
solver in its "midpoint" form), for the ODE steps after an SDE window (MixGRPO-Flash).
Rectified flow is the diffusion with alpha_t = 1 - t, sigma_t = t: log-SNR
lambda_t = log((1 - t) / t), data prediction x0 = x - t·v. From t with the previous
point's prediction x0_prev at t_prev, to t_next:
    h    = lambda_{t_next} - lambda_t,   r = (lambda_t - lambda_{t_prev}) / h
    D1   = (x0 - x0_prev) / r
    x_{t_next} = (t_next / t)·x + (1 - t_next)·(1 - e^{-h})·(x0 + D1 / 2)
with e^{-h} = t_next·(1 - t) / ((1 - t_next)·t). Without a previous point (D1 = 0) it
is the first-order DPM-Solver++ step, which for rectified flow is the Euler step
algebraically.

The log-prob is averaged over elements (not summed) so that its scale does
not depend on the image size; constants cancel in PPO ratios anyway.

Steps whose noise level is 0 (outside the SDE window, or every step of the
"ode" sampler) are run as plain Euler steps by `engine.denoise.denoise`, so they
equal ODE steps bit for bit whatever the sampler. The one exception: "ode"
requests on a folder whose scheduler is not FlowMatchEulerDiscreteScheduler
(Wan's default UniPC) are stepped by that scheduler
(`engine.denoise.denoise_with_scheduler`), to equal the stock pipeline.
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


def dpm_solver_2m_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor,
                       x0_prev: torch.Tensor, t_prev: torch.Tensor) -> torch.Tensor:
    """One DPM-Solver++(2M) step of the probability-flow ODE (see the module docstring), 0 < t_next < t < t_prev.

    `x0_prev` is the data prediction x - t·v made at the previous schedule point t_prev.
    """
    x0 = x - t * v
    lam, lam_next, lam_prev = (torch.log((1 - s) / s) for s in (t, t_next, t_prev))
    h = lam_next - lam
    d1 = (x0 - x0_prev) * (h / (lam - lam_prev))
    decay = t_next * (1 - t) / ((1 - t_next) * t)  # e^{-h}, without the logs' rounding
    return (t_next / t) * x + ((1 - t_next) * (1 - decay)) * (x0 + 0.5 * d1)


def compressed_tail(timesteps: torch.Tensor, start: int, fraction: float) -> torch.Tensor:
    """The schedule with its points after index `start` thinned: the n steps from t_start to 0 become
    max(1, int(n·fraction)) steps through the schedule's own points at evenly spaced (rounded) indices."""
    steps = timesteps.shape[0] - 1
    n = steps - start
    kept = max(1, int(n * fraction))
    index = torch.linspace(start, steps, kept + 1, dtype=torch.float64).round().long()
    return torch.cat([timesteps[:start], timesteps[index.to(timesteps.device)]])


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


def per_element(std: torch.Tensor | float) -> bool:
    """Whether a std (or noise level) varies per element (ltx2's [video | audio] latent: [N] or [B, N]) rather
    than being a scalar or one value per sample ([B, 1, ...])."""
    return isinstance(std, torch.Tensor) and std.dim() > 0 and std.shape[-1] > 1


def gaussian_step_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over elements of log N(x_next; mean, std²); 0 where std == 0 (NaN std gives NaN).

    A per-element std (a joint audio+video latent whose modalities have their own noise levels) averages
    over the stochastic elements only: a modality stepped deterministically (noise level 0) drops out,
    and with every element stochastic it is the mean over all of them, as for a scalar std.
    """
    stochastic = std != 0  # not `> 0`: a NaN std must surface as a NaN log-prob, not pass as deterministic
    safe_std = torch.where(stochastic, std, torch.ones_like(std))
    log_density = -((x_next - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    if per_element(std):
        mask = stochastic.expand_as(x_next).flatten(1).to(log_density.dtype)
        count = mask.sum(dim=1)
        per_sample = (log_density.flatten(1) * mask).sum(dim=1) / count.clamp(min=1.0)
        return torch.where(count > 0, per_sample, torch.zeros_like(per_sample))
    per_sample = log_density.flatten(1).mean(dim=1)
    # std is a scalar or broadcasts per sample ([B, 1, ...]): one flag per sample, not a [B, B] broadcast.
    stochastic_per_sample = stochastic.expand_as(x_next).flatten(1)[:, 0]
    return torch.where(stochastic_per_sample, per_sample, torch.zeros_like(per_sample))


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


def part_log_probs(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                   parts: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Each part's step log-prob [B] (mean over its stochastic elements, 0 if it has none) of flat latents
    [B, N]; `parts` maps a name to its [start, end) element range (ltx2: {"video": ..., "audio": ...})."""
    std = std.expand(mean.shape[-1]) if std.dim() == 0 else std
    return {name: gaussian_step_log_prob(x_next[:, a:b], mean[:, a:b], std[..., a:b]) for name, (a, b) in parts.items()}


def gaussian_kl(mean: torch.Tensor, mean_ref: torch.Tensor, variance: torch.Tensor | float) -> torch.Tensor:
    """Per-sample KL of two Gaussians of one variance, |mean - mean_ref|² / (2·variance), averaged over the
    elements with a positive variance (all of them for a scalar one; a per-element variance leaves out the
    elements of a modality that stepped deterministically)."""
    if not per_element(variance):
        return ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * variance)
    positive = variance > 0
    safe = torch.where(positive, variance, torch.ones_like(variance))
    mask = positive.expand_as(mean).flatten(1).to(mean.dtype)
    kl = (((mean - mean_ref) ** 2 / (2 * safe)).flatten(1) * mask).sum(1)
    return kl / mask.sum(1).clamp(min=1.0)


def cps_mean_std(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor,
                 noise_level: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of the CPS transition x_t -> x_{t_next} (noise level = eta)."""
    angle = torch.as_tensor(noise_level, dtype=torch.float32, device=x.device) * (math.pi / 2)
    x0_hat = x - t * v
    eps_hat = x + (1 - t) * v
    std = t_next * torch.sin(angle)
    mean = (1 - t_next) * x0_hat + (t_next * torch.cos(angle)) * eps_hat
    return mean, std


def cps_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor,
             noise_level: float | torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One CPS step: returns (x_next, log_prob [B])."""
    mean, std = cps_mean_std(x, v, t, t_next, noise_level)
    x_next = mean + std * noise
    return x_next, gaussian_step_log_prob(x_next, mean, std)


def cps_step_log_prob(x: torch.Tensor, x_next: torch.Tensor, v: torch.Tensor, t: torch.Tensor,
                      t_next: torch.Tensor, noise_level: float | torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob of a CPS step already taken, under velocity v: (log_prob [B], mean, std)."""
    mean, std = cps_mean_std(x, v, t, t_next, noise_level)
    return gaussian_step_log_prob(x_next, mean, std), mean, std


def step_log_prob(sampler: str, x: torch.Tensor, x_next: torch.Tensor, v: torch.Tensor, t: torch.Tensor,
                  t_next: torch.Tensor, noise_level: float | torch.Tensor,
                  t_cap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob of a taken step under the sampler that took it ("sde" or "cps"): (log_prob, mean, std).

    A trainer recomputing a rollout's log-probs calls this with `Trajectory.sampler`.
    """
    if sampler == "cps":
        return cps_step_log_prob(x, x_next, v, t, t_next, noise_level)
    if sampler in ("sde", "ode"):
        return sde_step_log_prob(x, x_next, v, t, t_next, noise_level, t_cap)
    raise ValueError(f"sampler={sampler!r} is not known; valid samplers: ode, sde, cps")


def transition_std(sampler: str, timesteps: torch.Tensor, noise_levels: torch.Tensor) -> torch.Tensor:
    """The std of every step's transition [T] under the sampler that took it: 0 where the step is deterministic.

    A step is stochastic only where its std is positive: noise level 0 (ODE steps,
    outside the SDE window) gives 0, and so does CPS's last step, whose std
    t_next·sin(eta·pi/2) vanishes at t_next = 0. Deterministic steps have no
    log-probability (it is 0 by convention), so they never enter a loss or a KL.
    """
    t, t_next = timesteps[:-1], timesteps[1:]
    levels = noise_levels.to(device=t.device, dtype=torch.float32)
    if sampler == "cps":
        return t_next * torch.sin(levels * (math.pi / 2))
    if sampler in ("sde", "ode"):
        return sde_sigma(t, levels, sde_t_cap(timesteps)) * torch.sqrt((t - t_next).clamp(min=0))
    raise ValueError(f"sampler={sampler!r} is not known; valid samplers: ode, sde, cps")


def step_noise_levels(steps: int, sampler: str, noise_level: float,
                      sde_window: tuple[int, int] | None = None) -> list[float]:
    """The noise level of every step: 0 for ODE steps, `noise_level` inside the SDE window.

    For "sde" the level is Flow-SDE's `a`, for "cps" it is eta; the window applies to both.
    """
    if sampler == "ode":
        return [0.0] * steps
    start, end = sde_window if sde_window is not None else (0, steps)
    return [noise_level if start <= k < end else 0.0 for k in range(steps)]
