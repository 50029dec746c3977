"""Flow-GRPO (arXiv 2505.05470): group-relative policy optimisation of a flow-matching model.

    accelerate launch trainers/grpo.py                     # the built-in toy task
    accelerate launch trainers/grpo.py --config configs/toy_grpo.yaml lr=1e-3
    python trainers/grpo.py model.finetune=lora rewards=digit_alignment:1.0,jpeg_compressibility:0.1

Each step: G samples for each of P prompts with the Flow-SDE sampler (per-step
log-probs recorded), rewards, advantages normalised within each prompt's group
over all ranks, then a PPO-clip update on the per-step probability ratios,
with an optional KL penalty to the reference policy; every optimizer step
syncs the new weights into the engine (colocated) and bumps the version.
The recipe reads top to bottom: config, the loss, setup, the loop, save.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

import torch

from engine import Trajectory
from engine.loop import guided_velocity
from engine.sampling import sde_t_cap, step_log_prob, transition_std
from flywheel.cli import run_main
from flywheel.loop import RolloutBatch
from flywheel.recipe.policy import build_policy, make_optimizer
from flywheel.recipe.rollouts import Rollouts, cpu_core_sharing
from flywheel.recipe.sections import (DataConfig, ModelConfig, OptimConfig, RunConfig, SamplingConfig,
                                      check_shared_sections, resolve_config)
from flywheel.recipe.session import RecipeRun
from flywheel.recipe.update import GradientSteps, trajectory_conditioning

# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


@dataclass
class GRPOConfig(OptimConfig):
    clip_range: float = 1e-4
    """PPO clip range on the per-step probability ratio"""
    kl_beta: float = 0.0
    """weight of the KL penalty to the reference policy (0 = off)"""
    kl_form: Literal["exact", "flow_grpo"] = "exact"
    """KL per step: "exact" Gaussian KL |mu - mu_ref|^2 / (2 std^2), or Flow-GRPO's, which leaves |dt| out of the
    variance (the exact KL times |dt|: the same kl_beta is 1/|dt| times weaker); flow_grpo needs sampler=sde"""
    log_kl: bool = True
    """measure the KL to the reference even when kl_beta = 0 (one extra no-grad forward per step)"""
    importance_cap: float = 2.0
    """async rollouts: truncation of the importance weight pi_current / pi_rollout"""
    timestep_fraction: float = 1.0
    """fraction of the stochastic steps trained each step"""
    timestep_selection: Literal["random", "first"] = "random"
    """which steps `timestep_fraction` keeps: round(f·n) random ones each step, or the first int(f·n) as Flow-GRPO"""
    cfg_in_train: bool = True
    """apply guidance in the training forward too (when rollouts used it)"""


@dataclass
class Config(RunConfig):
    run_dir: str = "runs/grpo-toy"
    """where config, metrics, samples and checkpoints go"""
    model: ModelConfig = field(default_factory=ModelConfig)
    """the model card, its weights and what is trained"""
    data: DataConfig = field(default_factory=DataConfig)
    """training and evaluation prompts, prompts per step and group size"""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """the rollout sampler (Flow-SDE by default) and the evaluation samples"""
    train: GRPOConfig = field(default_factory=GRPOConfig)
    """the optimizer and the GRPO loss"""


# ---------------------------------------------------------------------------------------
# The GRPO loss of one denoising step
# ---------------------------------------------------------------------------------------


def step_policy(model, transformer, traj: Trajectory, j: int, use_cfg: bool):
    """Step j of a trajectory batch under `transformer`: (log_prob [B], mean, std, cond, uncond_cond)."""
    x, x_next = traj.latents[:, j], traj.latents[:, j + 1]
    t, t_next = traj.timesteps[j], traj.timesteps[j + 1]
    cond, uncond_cond = trajectory_conditioning(traj, use_cfg)
    v = guided_velocity(model, transformer, x, t, cond, uncond_cond, traj.guidance_scale)
    log_prob, mean, std = step_log_prob(traj.sampler, x, x_next, v, t, t_next, traj.noise_levels[j],
                                        sde_t_cap(traj.timesteps))
    return log_prob, mean, std, cond, uncond_cond


def grpo_step_loss(model, transformer, ref_velocity, traj: Trajectory, j: int, advantages: torch.Tensor,
                   usable: torch.Tensor, cfg: GRPOConfig,
                   proximal: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss (+ beta·KL) of stochastic step j of a trajectory batch under the current weights.

    Flow-GRPO (arXiv 2505.05470, Eq. 8): per sample and step, with r = pi_theta / pi_old,
        loss = max(-A·r, -A·clip(r, 1 - eps, 1 + eps)) + beta·KL(pi_theta || pi_ref),
    averaged over the usable samples (those whose group has a spread of rewards).

    `proximal` is for rollouts that lag the trainer (async): decoupled PPO as in
    AReaL (arXiv 2505.24298). The log-probs of step j under the weights at the
    start of this update (computed once, before any optimizer step) are the
    proximal policy: r = pi_theta / pi_prox is clipped, and the truncated
    importance weight min(pi_prox / pi_behaviour, cap) corrects for the lag.

    KL of two Gaussians with the same std: |mu - mu_ref|^2 / (2 std^2) per element
    ("exact"), or Flow-GRPO's form, which divides by 2 sigma_t^2 where the
    transition's variance is sigma_t^2·|dt| (its issue #78): the exact KL times |dt|.
    """
    log_prob, mean, std, cond, uncond_cond = step_policy(model, transformer, traj, j, cfg.cfg_in_train)
    behaviour = traj.log_probs[:, j]
    if proximal is None:
        ratio = torch.exp(log_prob - behaviour)
        is_weight = torch.ones_like(ratio)
    else:
        ratio = torch.exp(log_prob - proximal)
        is_weight = torch.exp(proximal - behaviour).clamp(max=cfg.importance_cap)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_range, 1.0 + cfg.clip_range)
    weight = usable.float() / usable.float().sum().clamp(min=1.0)
    loss = (is_weight * torch.maximum(unclipped, clipped) * weight).sum()

    kl = torch.zeros((), device=log_prob.device)
    if ref_velocity is not None:
        x, x_next = traj.latents[:, j], traj.latents[:, j + 1]
        t, t_next = traj.timesteps[j], traj.timesteps[j + 1]
        with torch.no_grad():
            v_ref = ref_velocity(x, t, cond, uncond_cond, traj.guidance_scale)
            _, mean_ref, _ = step_log_prob(traj.sampler, x, x_next, v_ref, t, t_next, traj.noise_levels[j],
                                           sde_t_cap(traj.timesteps))
        variance = std**2 if cfg.kl_form == "exact" else std**2 / (t - t_next)
        kl_per_sample = ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * variance)
        kl = (kl_per_sample * weight).sum()
        loss = loss + cfg.kl_beta * kl

    deviation = (ratio.detach() - 1).abs()
    stats = {
        "loss": loss.detach(),
        "kl": kl.detach(),
        "ratio/mean": (ratio.detach() * weight).sum(),
        "clipfrac": ((deviation > cfg.clip_range).float() * weight).sum(),
        # Exactly 0 on the first minibatch of a step: the rollout's (or proximal) weights, recomputed.
        "ratio/max_dev": (deviation * usable).max(),
        # Trainer-vs-rollout log-prob gap: 0 on-policy, the policy's drift when rollouts lag.
        "logprob_gap/max": ((log_prob.detach() - behaviour).abs() * usable).max(),
        "is_weight/mean": (is_weight * weight).sum(),
    }
    return loss, stats


def stochastic_steps(traj: Trajectory) -> list[int]:
    """The steps whose transition has a positive std: the only ones with a log-probability to train."""
    std = transition_std(traj.sampler, traj.timesteps, traj.noise_levels)
    return (std > 0).nonzero().flatten().tolist()


def chosen_steps(traj: Trajectory, fraction: float, generator: torch.Generator,
                 selection: str = "random") -> list[int]:
    """Which denoising steps to train: a `fraction` of the stochastic ones.

    "random": round(fraction·n) of the n stochastic steps, drawn anew every step.
    "first": the first int(fraction·n) of them in schedule order, as Flow-GRPO
    trains (9 of 10 steps at 0.99). Deterministic steps (noise level 0, CPS's
    last step) are never chosen.
    """
    stochastic = stochastic_steps(traj)
    if not stochastic:
        raise ValueError("the rollouts have no stochastic step to train: use sampling.sampler=sde or cps with "
                         "sampling.noise_level > 0 (and an sde_window that holds a step before the last one for cps)")
    if selection == "first":
        return stochastic[:max(1, int(fraction * len(stochastic)))]
    keep = max(1, round(fraction * len(stochastic)))
    order = torch.randperm(len(stochastic), generator=generator).tolist()
    return sorted(stochastic[i] for i in order[:keep])


@torch.no_grad()
def proximal_log_probs(model, transformer, traj: Trajectory, minibatches: list[list[int]], steps: list[int],
                       use_cfg: bool) -> torch.Tensor:
    """Log-probs [N, T] of the chosen steps under the weights now, before any optimizer step of the update.

    Computed with the minibatches and forwards the loss will use, so the first
    minibatch's ratio against them is exactly 1.
    """
    out = torch.zeros_like(traj.log_probs)
    for rows in minibatches:
        sub = traj.select(rows)
        for j in steps:
            out[rows, j] = step_policy(model, transformer, sub, j, use_cfg)[0]
    return out


def grpo_update(batch: RolloutBatch, model, transformer, ref_velocity, optimizer, accelerator, sync,
                named_params: list[tuple[str, torch.nn.Parameter]], cfg: Config, step: int,
                before_each_step=lambda: None) -> dict[str, float]:
    """One GRPO update over this rank's rollouts: minibatches x chosen steps, then optimizer step(s) + `sync()`.

    `before_each_step()` runs before every denoising step's forward (async rollouts adjust threads there).
    """
    tc = cfg.train
    traj = batch.trajectory
    steps = chosen_steps(traj, tc.timestep_fraction, torch.Generator().manual_seed(cfg.seed * 7919 + step),
                         tc.timestep_selection)
    grads = GradientSteps(accelerator, transformer, optimizer, named_params, sync, tc, step)
    minibatches = grads.minibatches(len(traj))
    proximal = (proximal_log_probs(model, transformer, traj, minibatches, steps, tc.cfg_in_train)
                if cfg.async_rollouts else None)
    for m, rows in enumerate(minibatches):
        sub = traj.select(rows)
        adv, usable = batch.advantages[rows], batch.usable[rows]
        for i, j in enumerate(steps):
            before_each_step()
            loss, stats = grpo_step_loss(model, transformer, ref_velocity, sub, j, adv, usable, tc,
                                         proximal=None if proximal is None else proximal[rows, j])
            grads.backward(loss / grads.backwards_per_step(len(steps)), m, last_of_minibatch=i == len(steps) - 1)
            grads.record(stats)
        grads.maybe_step(m)
    return grads.metrics()


# ---------------------------------------------------------------------------------------
# Config checks
# ---------------------------------------------------------------------------------------


def validate_config(cfg: Config) -> None:
    """Check every field before anything runs: one ConfigError listing each bad key and what is valid."""
    checks = check_shared_sections(cfg)
    sampler = cfg.sampling.sampler
    if sampler == "ode":
        checks.fail("sampling.sampler=ode: GRPO trains the per-step log-probabilities of a stochastic sampler; "
                    "use sampler=sde or cps (or a recipe that trains on ODE samples: trainers/nft.py, awm.py)")
    for key in ("train.clip_range",):
        checks.require(key, lambda v: v > 0, "must be > 0")
    checks.require("train.kl_beta", lambda v: v >= 0, "must be >= 0 (0 = no KL penalty)")
    checks.require("train.importance_cap", lambda v: v >= 1, "must be >= 1 (the truncation of pi / pi_rollout)")
    checks.require("train.timestep_fraction", lambda v: 0 < v <= 1, "must be in (0, 1]")
    if cfg.train.kl_form == "flow_grpo" and sampler != "sde":
        checks.fail(f"train.kl_form=flow_grpo is Flow-GRPO's Flow-SDE KL; with sampling.sampler={sampler} use "
                    "train.kl_form=exact")
    if not cfg.train.cfg_in_train and cfg.sampling.guidance_scale != 1.0:
        # The rollouts sampled the guided policy; training the unguided one is off-policy from the first step.
        checks.fail(f"train.cfg_in_train=false with sampling.guidance_scale={cfg.sampling.guidance_scale}: the "
                    "training forward would score a policy other than the one that sampled (every ratio far "
                    "from 1). Set train.cfg_in_train=true, or sampling.guidance_scale=1")
    checks.raise_if_any()


# ---------------------------------------------------------------------------------------
# Main: setup, loop, save
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    cfg = resolve_config(Config, sys.argv[1:] if argv is None else argv)
    validate_config(cfg)
    run = RecipeRun(cfg, recipe="grpo")
    policy = build_policy(cfg, run.device, reference=cfg.train.kl_beta > 0 or cfg.train.log_kl)
    optimizer = make_optimizer(policy, cfg.train)
    run.resume(policy, optimizer)
    transformer, optimizer = run.prepare(policy, optimizer)
    rollouts = Rollouts(cfg, run.accelerator, policy, run.version, run.trainer_state)
    share_cores = cpu_core_sharing(rollouts.collector, run.accelerator)

    def update(batch: RolloutBatch, step: int) -> dict:
        return grpo_update(batch, policy.model, transformer, policy.ref_velocity, optimizer, run.accelerator,
                           rollouts.sync, policy.named_params, cfg, step, before_each_step=share_cores)

    return run.train(rollouts, update)


if __name__ == "__main__":
    run_main(main)
