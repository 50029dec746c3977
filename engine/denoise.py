"""The denoise loop: device-resident, fp32 latents and log-probs.

Nothing in `denoise` moves data to the host: noise is drawn before the loop, the
per-step noise levels are host floats known in advance, and results are
written into preallocated device tensors. `engine.guards` checks this in tests.

Two loops. `denoise` runs the project's samplers: every rollout (Flow-SDE or
CPS inside the SDE window, Euler outside it, as the trained policy is
defined) and ODE requests on models whose scheduler is plain Euler.
`denoise_with_scheduler` runs ODE requests (evaluation, serving) on a folder
whose scheduler is something else (Wan's default UniPC, DPM-Solver, ...):
the model is called at that scheduler's timesteps and `scheduler.step`
moves the latents, exactly as the stock pipeline does, so the final latents
equal the pipeline's (tested: UniPC on Wan and FLUX, DPM-Solver++ on SD3).
Its step is diffusers' code: UniPC makes no Python-level host reads (the
guard test runs it), but on CUDA it copies entries of its host-side sigma
table to the device and its corrector calls `torch.linalg.solve`, whose
error check reads the solver status back: a few synchronisations per step,
as in the stock pipeline. Evaluation and serving pay them; rollouts never
take that path.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cards import FlowModel, PromptEmbeds
from engine.sampling import (cps_mean_std, cps_step, dpm_solver_2m_step, gaussian_step_log_prob, ode_step,
                             part_log_probs, sde_mean_std, sde_step, sde_t_cap)


def concat_embeds(a: PromptEmbeds, b: PromptEmbeds) -> PromptEmbeds:
    """Stack two conditionings along the batch (for one CFG forward)."""
    mask = None if a.mask is None else torch.cat([a.mask, b.mask])
    extra = None if a.extra is None else {k: torch.cat([v, b.extra[k]]) for k, v in a.extra.items()}
    return PromptEmbeds(torch.cat([a.embeds, b.embeds]), torch.cat([a.pooled, b.pooled]), mask, extra)


def guided_velocity(model: FlowModel, transformer: nn.Module, x: torch.Tensor, t: torch.Tensor,
                    cond: PromptEmbeds, uncond_cond: PromptEmbeds | None, guidance_scale: float) -> torch.Tensor:
    """Velocity with classifier-free guidance v = v_u + g·(v_c - v_u), or the model's own `guide`.

    `uncond_cond` is the unconditional branch stacked before the conditional
    one (see `concat_embeds`), so both run in a single batched forward. When it
    is None (g = 1, or a guidance-distilled model) only the conditional branch runs.
    A model with a `guide(v_uncond, v_cond, g)` method combines the branches itself; one that also sets
    `guide_uses_conditioning = True` is called `guide(v_uncond, v_cond, g, cond)`.
    """
    if getattr(model, "embedded_guidance", False):
        # Guidance-distilled models (FLUX.1-dev) take g as an input: no unconditional branch.
        return model.velocity(transformer, x, t, cond, guidance=guidance_scale)
    if uncond_cond is None:
        return model.velocity(transformer, x, t, cond)
    if torch.is_tensor(t) and t.dim() == 1 and t.numel() == x.shape[0]:
        t = torch.cat([t, t])  # one time per row: the unconditional rows take their conditional twin's
    v = model.velocity(transformer, torch.cat([x, x]), t, uncond_cond)
    v_uncond, v_cond = v.chunk(2)
    guide = getattr(model, "guide", None)
    if guide is not None:
        if getattr(model, "guide_uses_conditioning", False):
            # Per-row scales carried by the conditioning (ltx2's audio guidance scale in cond.extra).
            return guide(v_uncond, v_cond, guidance_scale, cond)
        return guide(v_uncond, v_cond, guidance_scale)
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def _trajectory_buffers(initial_noise: torch.Tensor, steps: int,
                       keep_trajectory: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x fp32, latents [B, steps+1 or 1, *latent] with the start in slot 0, zero log_probs [B, steps])."""
    x = initial_noise.float()
    batch = x.shape[0]
    latents = torch.empty((batch, steps + 1 if keep_trajectory else 1, *x.shape[1:]), dtype=torch.float32,
                          device=x.device)
    log_probs = torch.zeros((batch, steps), dtype=torch.float32, device=x.device)
    if keep_trajectory:
        latents[:, 0] = x
    return x, latents, log_probs


@torch.no_grad()
def denoise(model: FlowModel, transformer: nn.Module, initial_noise: torch.Tensor, step_noise: torch.Tensor | None,
            timesteps: torch.Tensor, noise_levels: list[float], cond: PromptEmbeds,
            uncond_cond: PromptEmbeds | None, guidance_scale: float,
            keep_trajectory: bool = True, sampler: str = "sde",
            multistep_from: int | None = None, element_levels: list[torch.Tensor] | None = None,
            parts: dict[str, tuple[int, int]] | None = None,
            parts_out: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the sampler from noise to data.

    initial_noise [B, *latent]; step_noise [B, T, *latent] (None for a pure ODE run);
    timesteps [T+1] from 1 to 0; noise_levels: T host floats (0 = ODE step);
    sampler: "sde" (Flow-SDE) or "cps" for the stochastic steps ("ode" = none);
    multistep_from: ODE steps k >= multistep_from (k >= 1) take DPM-Solver++(2M) with
    the previous point's data prediction, except the last step, which stays first
    order (Euler) as DPM-Solver++ ends (MixGRPO-Flash); None = Euler everywhere.
    element_levels: per-element noise levels of each stochastic step (device tensors [N], flat latents
    [B, N]: ltx2's video and audio elements at their own levels), used instead of noise_levels[k], which
    then only says whether step k is stochastic (its largest level); parts / parts_out: each part's
    element range and a [B, T] buffer the step's log-prob of that part is written to (per modality).
    Returns (latents [B, T+1, *latent] or [B, 1, *latent] with only the
    final latent when keep_trajectory is False, log_probs [B, T]).
    """
    steps = len(noise_levels)
    x, latents, log_probs = _trajectory_buffers(initial_noise, steps, keep_trajectory)
    t_cap = sde_t_cap(timesteps)
    x0_prev = None
    for k in range(steps):
        t, t_next = timesteps[k], timesteps[k + 1]
        v = guided_velocity(model, transformer, x, t, cond, uncond_cond, guidance_scale)
        x_now = x
        # noise_levels are host floats known before the loop: this branch costs no sync.
        second_order = (multistep_from is not None and 1 <= multistep_from <= k < steps - 1
                        and noise_levels[k] == 0.0)
        if second_order:
            x = dpm_solver_2m_step(x, v, t, t_next, x0_prev, timesteps[k - 1])
        elif step_noise is None or noise_levels[k] == 0.0:
            x = ode_step(x, v, t, t_next)
        elif element_levels is not None:
            level = element_levels[k]
            mean, std = (cps_mean_std(x, v, t, t_next, level) if sampler == "cps"
                         else sde_mean_std(x, v, t, t_next, level, t_cap))
            x = mean + std * step_noise[:, k]
            log_probs[:, k] = gaussian_step_log_prob(x, mean, std)
            for name, value in part_log_probs(x, mean, std, parts or {}).items():
                parts_out[name][:, k] = value
        elif sampler == "cps":
            x, log_probs[:, k] = cps_step(x, v, t, t_next, noise_levels[k], step_noise[:, k])
        else:
            x, log_probs[:, k] = sde_step(x, v, t, t_next, noise_levels[k], step_noise[:, k], t_cap)
        if multistep_from is not None:
            x0_prev = x_now - t * v  # the data prediction the next multistep step extrapolates from
        if keep_trajectory:
            latents[:, k + 1] = x
    if not keep_trajectory:
        latents[:, 0] = x
    return latents, log_probs


@torch.no_grad()
def denoise_with_scheduler(model: FlowModel, transformer: nn.Module, initial_noise: torch.Tensor, scheduler,
                           cond: PromptEmbeds, uncond_cond: PromptEmbeds | None, guidance_scale: float,
                           keep_trajectory: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the ODE from noise to data with a diffusers scheduler's own steps (see the module docstring).

    `scheduler` is a fresh instance already set for this batch: a multistep
    solver keeps the previous steps' model outputs on it. The model is called
    at flow time timestep / num_train_timesteps: the families' velocity turns
    it back into the pipeline's timestep (x 1000, every released folder's
    num_train_timesteps), equal up to float32 rounding. Returns (latents [B, N+1, *latent],
    or [B, 1, *latent] with only the final latent, log_probs [B, N] of zeros),
    N = len(scheduler.timesteps): the state after every scheduler step.
    """
    timesteps = scheduler.timesteps
    steps = len(timesteps)
    flow_times = timesteps.to(device=initial_noise.device, dtype=torch.float32) / scheduler.config.num_train_timesteps
    x, latents, log_probs = _trajectory_buffers(initial_noise, steps, keep_trajectory)
    for k in range(steps):
        v = guided_velocity(model, transformer, x, flow_times[k], cond, uncond_cond, guidance_scale)
        x = scheduler.step(v, timesteps[k], x, return_dict=False)[0].float()
        if keep_trajectory:
            latents[:, k + 1] = x
    if not keep_trajectory:
        latents[:, 0] = x
    return latents, log_probs
