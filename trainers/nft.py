"""DiffusionNFT (arXiv 2509.16117, Zheng et al.): online negative-aware fine-tuning on the forward process.

    accelerate launch trainers/nft.py                       # the built-in toy task (toy-digits)
    python trainers/nft.py --config configs/toy_numbers_nft.yaml
    python trainers/nft.py model.finetune=lora train.learning_rate=1e-3 train.kl_beta=1e-4

Each step the sampling policy v_old (weights theta_old) generates G samples per
prompt with any sampler (ODE by default: no per-step log-probs), the rewards
become an optimality probability r in [0, 1] per sample, and the trained policy
v_theta is fitted by flow matching on the clean samples x0, noised afresh:
x_t = (1 - t)·x0 + t·eps, target u = eps - x0 (rectified flow, paper Sec. 2.1).
Training is CFG-free: only the conditional velocity is used (Sec. 3.3). After
the update theta_old moves toward theta by the soft update, and the engine
serves it: the weight version names the sampling policy, and evaluation samples
the trained one.

The paper, by equation (numbers of arXiv v2):

- Optimality probability (Algorithm 1, lines 4-5; Sec. 3.3 "Optimality Reward"):
      r = 1/2 + 1/2·clip((r_raw - mean_group r_raw) / Z_c, -1, 1),
  Z_c > 0 a normaliser, "which could take the form of a global reward std".
- Implicit positive and negative policies, mixing coefficient beta (Theorem 3.2):
      v+ = (1 - beta)·v_old + beta·v_theta,      v- = (1 + beta)·v_old - beta·v_theta.
- The loss (Eq. 5):  L(theta) = E[ r·||v+ - u||^2 + (1 - r)·||v- - u||^2 ],
  whose minimiser is v_theta* = v_old + (2 / beta)·Delta (Eq. 6), Delta the
  reinforcement guidance of Eq. (4) (the direction from the negative to the
  positive split of the sampling policy's data).
- Adaptive loss weighting (Sec. 3.3): w(t)·||v - u||^2 of Eq. (1) is replaced
  by the self-normalised x0 regression ||x_hat - x0||^2 / sg(mean|x_hat - x0|),
  x_hat = x_t - t·v. Since x_hat - x0 = t·(v - u) this is t·||v - u||^2 / mean|v - u|
  (per element mean): more weight at large t, which the paper finds stable (Fig. 9).
- Soft update of the sampling policy (Algorithm 1, line 14):
      theta_old <- eta_i·theta_old + (1 - eta_i)·theta,
  eta_i = min(0.001·i, 0.5) by default (App. C); eta = 0 is fully on-policy and
  unstable, eta -> 1 stable but slow (Fig. 8). For OCR the public code holds
  eta at 0 for 75 steps, then raises it by 0.0075 a step up to 0.999.
- Defaults (App. C, config/nft.py of NVlabs/DiffusionNFT): beta = 1 (0.1 for the
  multi-reward and OCR runs), loss at the rollout's own sampling times, a
  2nd-order ODE sampler with 10 steps, 48 groups x 24 samples, LoRA r = 32,
  alpha = 64, learning rate 3e-4.

Where this recipe deviates from the paper's text (each choice follows the public
code unless it says otherwise):

1. Loss scale. The per-sample loss is (r·l+ + (1 - r)·l-) / beta, and the
   mean over samples is multiplied by `adv_clip_max` (c), as in the public code;
   Eq. (5) has neither factor, and its squared norms are sums where the code
   (and this recipe) takes means over the latent's elements (a constant factor). With r = 1/2 + A / (2c) for the clipped group
   advantage A, the gradient at v_theta = v_old is then exactly A times the
   gradient of the weighted flow-matching loss, whatever beta and c are: an
   advantage-weighted flow-matching step at the start of every update.
2. Z_c = c·(std + 1e-4): r = 1/2 + 1/2·clip(A / c, -1, 1) for the group
   advantage A = (R - mean of the prompt's group) / (std + 1e-4) that the
   flywheel computes over every rank, with the std of all the step's rewards
   (`global_std`, as the public code's sample.global_std = True) or of the group.
3. Flow times. Each sample is trained at `timesteps_per_sample` distinct
   times of the rollout's own time grid, drawn at random per sample (App. C:
   "exactly on the corresponding sampling timesteps"; the public code trains
   int(0.99·T) of the T times, 9 of 10). `time_sampling=uniform` draws
   t ~ U(0, 1] instead (not in the paper).
4. Masked rewards. A sample whose reward the scorers masked has no r: it is
   left out of the loss. Samples of a group whose valid rewards are all equal
   (A = 0, r = 1/2) stay in by default, as in the public code: at r = 1/2 the
   two branches pull v_theta toward v_old. `keep_flat_groups=false` drops them.
5. KL. The paper is KL-free; the public code always adds 1e-4·mean||v_theta -
   v_ref||^2 against the base model. Here `kl_beta` weighs that same term and
   defaults to 0.
6. Randomness. Times and noise come from a generator seeded from (seed, step,
   rank), so a resumed run draws the same ones; the public code uses the global RNG.
7. The public code's EMA of theta used for evaluation (decay 0.9, every optimizer
   step) is `train.ema=true train.ema_update_every=1` (off by default, as for every
   recipe); not here: its fp16 autocast with a GradScaler (this recipe trains in the
   model's dtype).
8. Guidance. Rollouts made with classifier-free guidance (guidance_scale != 1)
   are refused: v_old must be the velocity of the policy that sampled x0.
9. The eta schedule counts training steps (Algorithm 1's iterations i, one
   rollout batch each), whatever the number of optimizer steps per batch (the
   public code counts optimizer steps: the same with one per batch). As the
   code, the soft update after the i-th step (i = 1, 2, ...) uses eta_i, so the
   first one already uses 0.001 (this recipe used eta_0 = 0 there before).
10. theta_old is the trained tensors only, swapped into the one transformer (code: a 2nd LoRA adapter); same maths.

Defaults, and what was changed from the paper's for the built-in toy task (toy-digits,
8 prompts x 16 samples, ODE with 10 steps, full fine-tune; held-out eval reward at
guidance 1, base 0.48, judge digit_svc 0.57; measured on the 2-core machines, seed 0
unless said):

- learning_rate 5e-4 (paper 3e-4): 3e-4 gives 0.89-0.91 at step 30 and 0.93-0.95 at
  40-70; 5e-4 gives 0.94 at 30, 0.97 at 40, 0.98 at 60-80 (seed 1: 0.95 at 20, 0.97 at
  40, 0.99 at 50). 1e-3 reaches 0.96-0.97 by step 30, then swings between 0.93 and
  0.98: the instability of a nearly on-policy run (paper Fig. 8).
- timesteps_per_sample 2 (public code: 9 of 10): one or two times per sample learnt
  alike per step here; two cost 2/9 of the training forwards of nine.
- steps 50 (was 60): with the soft update that starts at eta 0.001, eval 0.966 at step 50
  and 0.981 at 60, but eval/diversity (pixel std across a prompt's seeds) 0.069 at 50
  and 0.061 at 60, under half the base's 0.131 (docs/tuning_nft.md). Before that
  change, 60 steps gave 0.977 (seed 0) and 0.985 (seed 1), judge 0.57 -> 0.93.
- The eta schedule is the paper's; it stays under 0.06 in 60 steps, so with one
  optimizer step per rollout batch (minibatch_size 128 = the batch) v_theta is v_old
  at nearly every forward, beta hardly matters, and each update is the
  advantage-weighted flow-matching step of item 1. At lr 1e-3, a constant eta = 0.5
  learnt slower (0.93 at step 60), so did four optimizer steps per batch
  (minibatch_size 32: 0.91 at step 40), and 16 prompts x 8 samples fell back to 0.78.

configs/toy_numbers_nft.yaml (toy-numbers, GRPO's rollout budget of 8 x 16) raises
learning_rate to 1e-3. `python benchmarks/time_to_target.py` (eval every 5 steps, 2
quiet cores, seed 0): eval reward 0.198 -> 0.480 (step 5), 0.748 (10), 0.879 (15),
0.945 (30), 0.962 (60); number_svc judge 0.255 -> 0.811 at step 15, 0.860 at 60.
Target 0.8 at step 15 in 4.3 s against GRPO's step 80 in 54.4 s. Seeds 1 and 2: first
>= 0.8 at step 15 too (0.828 and 0.889), judge there 0.723 and 0.814. Tried and not
kept (seeds 0-2): kl_beta 0.1 (judge at target 0.78-0.79, final reward 0.90), kl_beta
1.0 (never reaches 0.8: 0.46 at step 60), learning_rate 5e-4 (step 25, judge 0.815 and
0.714 on seeds 0 and 1).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import flywheel.openmp_env  # noqa: F401  before torch: OpenMP's idle threads sleep unless the user chose
import torch

from engine import PromptEmbeds, Trajectory
from flywheel.advantages import group_advantages
from flywheel.cli import run_main
from flywheel.distributed import rank_and_world
from flywheel.loop import RolloutBatch
from flywheel.recipe.flow_matching import noised
from flywheel.recipe.policy import Policy, build_policy, make_optimizer
from flywheel.recipe.rollouts import Rollouts
from flywheel.recipe.sections import (DataConfig, ModelConfig, OptimConfig, RunConfig, SamplingConfig,
                                      check_shared_sections, resolve_config)
from flywheel.recipe.session import RecipeRun
from flywheel.recipe.update import GradientSteps, trajectory_conditioning, update_generator

# A velocity function of (x_t [B, ...], t [B], conditioning) -> v [B, ...], run without grad.
VelocityFn = Callable[[torch.Tensor, torch.Tensor, PromptEmbeds], torch.Tensor]

# The public code's floor on the adaptive weight, so a sample predicted exactly never divides by zero.
ADAPTIVE_WEIGHT_FLOOR = 1e-5
# The public code trains int(0.99·T) of a rollout's T times (its train.timestep_fraction).
DEFAULT_TIME_FRACTION = 0.99
# Keeps the update's random stream apart from other users of the run's seed.
UPDATE_STREAM = 0x4E4654

# ---------------------------------------------------------------------------------------
# Config: the algorithm's own keys of the `train` section, and the recipe's config
# ---------------------------------------------------------------------------------------


@dataclass
class NFTConfig(OptimConfig):
    learning_rate: float = 5e-4
    """AdamW learning rate (the paper's 3e-4 is slower on the toy task: see the module docstring)"""
    beta: float = 1.0
    """mixing coefficient of the implicit policies v± (Theorem 3.2); 1/beta is the guidance strength"""
    adv_clip_max: float = 5.0
    """c: group advantages are clipped to [-c, c] and r = 1/2 + A / (2c); the loss is scaled by c (public code)"""
    global_std: bool = True
    """normalise advantages by the std of all the step's rewards (the paper's "global reward std"), not each group's"""
    keep_flat_groups: bool = True
    """train samples of groups whose rewards are all equal at r = 1/2 (public code); false leaves them out"""
    eta_flat_steps: int = 0
    """soft update: eta = 0 (sampling policy := trained one) for this many training steps"""
    eta_rate: float = 0.001
    """soft update: eta grows by this much per training step after the flat ones (paper: 0.001)"""
    eta_max: float = 0.5
    """soft update: eta's ceiling (paper: 0.5; 0.999 for OCR)"""
    time_sampling: Literal["rollout_grid", "uniform"] = "rollout_grid"
    """flow times of the loss: distinct times of the rollout's own grid per sample (paper), or t ~ U(0, 1]"""
    timesteps_per_sample: int | None = 2
    """flow times each sample is trained at per step; None = int(0.99·T) of the rollout's T steps (public code)"""
    loss_weighting: Literal["adaptive", "uniform"] = "adaptive"
    """"adaptive": ||x_hat - x0||^2 / sg(mean|x_hat - x0|) (Sec. 3.3); "uniform": ||v - u||^2 (w(t) = 1)"""
    kl_beta: float = 0.0
    """weight of mean ||v_theta - v_ref||^2 to the reference (base) model; 0 = KL-free as in the paper"""


@dataclass
class Config(RunConfig):
    run_dir: str = "runs/nft-toy"
    """where config, metrics, samples and checkpoints go"""
    steps: int = 50
    """training steps (rollout + update + soft update); 50 stops before the samples of a prompt collapse
    (docs/tuning_nft.md)"""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(sampler="ode"))
    train: NFTConfig = field(default_factory=NFTConfig)


# ---------------------------------------------------------------------------------------
# Pure functions: optimality probability, the loss, the soft update and its schedule
# ---------------------------------------------------------------------------------------


def optimality_from_advantages(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = 1/2 + 1/2·clip(A / c, -1, 1) in [0, 1] for group advantages A (Algorithm 1, line 5, Z_c = c·std)."""
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0 (the advantage that maps to r = 1), got {adv_clip_max}")
    return 0.5 + 0.5 * torch.clamp(advantages.float() / adv_clip_max, -1.0, 1.0)


def optimality_probability(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None,
                           adv_clip_max: float = 5.0, global_std: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Optimality probability r [N] in [0, 1] of raw rewards [N] grouped by prompt (group_ids [N]).

    The reward minus its group's mean, over (the std of all valid rewards, or of
    the group, + eps) and c = adv_clip_max: r = 1/2 + 1/2·clip(A / c, -1, 1).
    Masked samples (`valid` false or a non-finite reward) and groups whose
    valid rewards are all equal get r = 1/2; leave the masked ones out of the loss.
    """
    advantages, _ = group_advantages(rewards, group_ids, valid, eps=eps, clip=adv_clip_max, global_std=global_std)
    return optimality_from_advantages(advantages, adv_clip_max)


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(1)


def _regression_loss(v: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, target: torch.Tensor,
                     t_b: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-sample flow-matching loss [B] of velocity v: adaptive x0 regression, or plain velocity MSE."""
    if weighting == "uniform":
        return _per_sample_mean((v - target) ** 2)
    x_hat = x_t - t_b * v  # the x0 prediction of rectified flow
    error = x_hat - x0
    with torch.no_grad():  # sg(mean|x_hat - x0|), in float64 as the public code
        weight = _per_sample_mean(error.double().abs()).clamp(min=ADAPTIVE_WEIGHT_FLOOR)
    return _per_sample_mean(error**2) / weight.to(error.dtype)


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             r: torch.Tensor, beta: float, weighting: str = "adaptive", sample_weight: torch.Tensor | None = None,
             scale: float = 1.0, v_ref: torch.Tensor | None = None,
             kl_beta: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT loss (Eq. 5) of one batch at flow times t [B]; returns (loss, stats).

        x_t = (1 - t)·x0 + t·noise,  u = noise - x0,
        v+ = (1 - beta)·v_old + beta·v_theta,  v- = (1 + beta)·v_old - beta·v_theta,
        per sample: (r·l(v+) + (1 - r)·l(v-)) / beta,
        loss = scale · sum_i w_i·per_sample_i + kl_beta · sum_i w_i·mean||v_theta - v_ref||^2,

    l the adaptive x0 regression (or the plain velocity MSE with weighting="uniform"),
    w = sample_weight (default: uniform 1/B). v_old (and v_ref) carry no gradient.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (the implicit policies mix v_old and v_theta by it), got {beta}")
    if weighting not in ("adaptive", "uniform"):
        raise ValueError(f"loss weighting {weighting!r} is not known; valid: adaptive, uniform")
    b = v_theta.shape[0]
    t_b = t.reshape(b, *([1] * (v_theta.dim() - 1))).to(v_theta.dtype)
    x_t = noised(x0, noise, t_b)
    target = noise - x0
    v_old = v_old.detach()
    v_pos = (1 - beta) * v_old + beta * v_theta
    v_neg = (1 + beta) * v_old - beta * v_theta
    positive = _regression_loss(v_pos, x_t, x0, target, t_b, weighting)
    negative = _regression_loss(v_neg, x_t, x0, target, t_b, weighting)
    per_sample = (r * positive + (1 - r) * negative) / beta
    w = torch.full((b,), 1.0 / b, device=v_theta.device) if sample_weight is None else sample_weight
    loss = scale * (w * per_sample).sum()
    kl = torch.zeros((), device=v_theta.device)
    if v_ref is not None:
        kl = (w * _per_sample_mean((v_theta - v_ref.detach()) ** 2)).sum()
        loss = loss + kl_beta * kl
    elif kl_beta > 0:
        raise ValueError(f"kl_beta={kl_beta} needs v_ref, the reference model's velocity")
    stats = {
        "loss": loss.detach(),
        "nft/positive_loss": (w * positive).sum().detach(),
        "nft/negative_loss": (w * negative).sum().detach(),
        # How far the trained policy has moved from the sampling one on these inputs (0 before the first step).
        "nft/old_deviation": (w * _per_sample_mean((v_theta.detach() - v_old) ** 2)).sum(),
    }
    if v_ref is not None:  # without a reference nothing was measured: no "kl" key rather than a 0 that reads as one
        stats["kl"] = kl.detach()
    return loss, stats


def eta_schedule(step: int, flat_steps: int = 0, rate: float = 0.001, eta_max: float = 0.5) -> float:
    """Soft-update factor once `step` training steps are done (1 after the first update): 0 while step <
    flat_steps, then min((step - flat_steps)·rate, eta_max) (paper App. C: min(0.001·i, 0.5); the public
    code's return_decay of its step count, already raised by the update it follows)."""
    if step < 0 or flat_steps < 0:
        raise ValueError(f"eta_schedule needs step >= 0 and flat_steps >= 0, got step={step}, flat_steps={flat_steps}")
    if rate < 0 or not 0 <= eta_max <= 1:
        raise ValueError(f"eta_schedule needs rate >= 0 and eta_max in [0, 1], got rate={rate}, eta_max={eta_max}")
    if step < flat_steps:
        return 0.0
    return min((step - flat_steps) * rate, eta_max)


@torch.no_grad()
def soft_update(old_params: Iterable[torch.Tensor], new_params: Iterable[torch.Tensor], eta: float) -> None:
    """theta_old <- eta·theta_old + (1 - eta)·theta, in place (Algorithm 1, line 14).

    eta = 0 copies theta exactly (the sampling policy becomes the trained one, bit for bit).
    """
    if not 0 <= eta <= 1:
        raise ValueError(f"soft update factor eta must be in [0, 1], got {eta}")
    old, new = list(old_params), list(new_params)
    if len(old) != len(new):
        raise ValueError(f"soft update needs one sampling-policy tensor per trained one: got {len(old)} and {len(new)}")
    for i, (o, n) in enumerate(zip(old, new)):
        if o.shape != n.shape:
            raise ValueError(f"soft update: tensor {i} is {tuple(o.shape)} in the sampling policy and "
                             f"{tuple(n.shape)} in the trained one")
        if eta == 0:
            o.copy_(n)
        else:
            o.mul_(eta).add_(n.detach().to(o.dtype), alpha=1 - eta)



# ---------------------------------------------------------------------------------------
# The sampling policy theta_old: what the engine serves
# ---------------------------------------------------------------------------------------


class SamplingPolicy:
    """theta_old, the policy that rolls out: its weights, the rollouts that serve them, and its soft update.

    `weights` (name -> tensor, the trainable ones: all of the transformer or the
    LoRA adapter, in the weights' dtype) are what the soft update moves, what the
    engine serves (a sync hands them over; each rollout swaps them into the one
    transformer) and what a checkpoint keeps. v_old is the trained module's
    velocity with them swapped in for the forward (no second copy of the model:
    flywheel/recipe/swapped_weights.py).
    """

    def __init__(self, weights: dict[str, torch.Tensor], rollouts: Rollouts, policy: Policy, tc: NFTConfig):
        self.weights, self.rollouts, self.policy, self.tc = weights, rollouts, policy, tc

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds) -> torch.Tensor:
        """v_old: the conditional velocity of the sampling weights (no grad); the trained ones are back after."""
        with torch.no_grad(), self.policy.weights_swapped(self.weights):
            return self.policy.model.velocity(self.policy.transformer, x, t, cond)

    def serving_unchanged(self) -> dict:
        """The sync an optimizer step triggers: none, since the engine serves theta_old, not theta."""
        return {"weight_version": self.rollouts.version}

    def follow(self, named_params: list[tuple[str, torch.nn.Parameter]], step: int) -> dict:
        """After step `step`'s update: theta_old <- eta·theta_old + (1 - eta)·theta, then serve it (version + 1).

        eta is the schedule's at step + 1, the training steps done: the public code raises its step count
        before it soft-updates, so its first update already uses 0.001.
        """
        tc = self.tc
        eta = eta_schedule(step + 1, tc.eta_flat_steps, tc.eta_rate, tc.eta_max)
        soft_update([self.weights[name] for name, _ in named_params], [p for _, p in named_params], eta)
        synced = self.rollouts.sync(self.weights)
        metrics = {key: value for key, value in synced.items() if key != "weight_version"}
        return {**metrics, "nft/eta": eta, "weight_version_after": synced["weight_version"]}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights


def initial_sampling_weights(policy: Policy, checkpointed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """theta_old at the start: the trained weights of a fresh run, the checkpoint's on resume (strict names)."""
    if not checkpointed:
        return policy.snapshot()
    trained = {name for name, _ in policy.named_params}
    if set(checkpointed) != trained:
        odd = sorted(set(checkpointed) ^ trained)
        raise ValueError(f"resume: the checkpoint's sampling policy and the trained weights name different tensors "
                         f"({len(odd)} differ, e.g. {odd[0]!r}); was model.finetune or the LoRA changed?")
    return {name: checkpointed[name].to(p.device, p.dtype).clone() for name, p in policy.named_params}


# ---------------------------------------------------------------------------------------
# The update
# ---------------------------------------------------------------------------------------


def times_per_sample(traj: Trajectory, cfg: NFTConfig) -> int:
    """K: flow times each sample is trained at this step."""
    if cfg.timesteps_per_sample is not None:
        k = cfg.timesteps_per_sample
        if k < 1:
            raise ValueError(f"train.timesteps_per_sample must be >= 1 or null, got {k}")
        return k
    return max(1, int(DEFAULT_TIME_FRACTION * traj.num_steps))


def update_draws(traj: Trajectory, cfg: NFTConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(flow times [B, K], noise [B, K, *latent]) of one update, drawn on the CPU in a fixed order.

    rollout_grid: each sample gets K distinct times of the rollout's grid (its
    start times t_0 = 1 > ... > t_{T-1} > 0; the final t = 0 is the clean sample).
    uniform: K independent times in (0, 1].
    """
    b, k = len(traj), times_per_sample(traj, cfg)
    if cfg.time_sampling == "rollout_grid":
        grid = traj.timesteps[:-1].detach().float().cpu()
        grid = grid[grid > 0]
        if k > grid.numel():
            raise ValueError(f"train.timesteps_per_sample={k} distinct flow times per sample, but the rollouts' grid "
                             f"has {grid.numel()}: use at most {grid.numel()}, more sampling.steps, or "
                             "train.time_sampling=uniform")
        order = torch.rand(b, grid.numel(), generator=generator).argsort(dim=1)[:, :k]
        times = grid[order]
    elif cfg.time_sampling == "uniform":
        times = 1.0 - torch.rand(b, k, generator=generator)
    else:
        raise ValueError(f"train.time_sampling={cfg.time_sampling!r} is not known; valid: rollout_grid, uniform")
    noise = torch.randn((b, k, *traj.latents.shape[2:]), generator=generator)
    return times, noise


def trained_samples(batch: RolloutBatch, keep_flat_groups: bool) -> torch.Tensor:
    """Which samples enter the loss [B]: the valid ones (or only those of groups with a spread of rewards)."""
    if not keep_flat_groups:
        return batch.usable.bool()
    if batch.rewards is None:  # no scorer masks (hand-built batches): every sample has a reward
        return torch.ones_like(batch.usable, dtype=torch.bool)
    return batch.rewards.valid.to(batch.usable.device).bool()



def nft_update(batch: RolloutBatch, model, transformer, old_velocity: VelocityFn, optimizer, accelerator,
               sync: Callable[[], dict], named_params: list[tuple[str, torch.nn.Parameter]], cfg, step: int,
               ref_velocity: VelocityFn | None = None) -> dict[str, float]:
    """One DiffusionNFT update over this rank's rollouts: minibatches x K flow times, then optimizer step(s).

    `cfg.train` holds the NFTConfig keys and the optimizer's (minibatch_size,
    gradient_accumulation_steps, max_grad_norm); `cfg.seed` seeds the draws.
    `old_velocity(x_t, t, cond)` is the sampling policy's velocity;
    `ref_velocity`, the same for the reference model, is needed when
    train.kl_beta > 0 and logged ("kl") whenever given. `sync()` runs after
    every optimizer step and returns a dict with "weight_version" (main's does
    nothing: the engine serves the sampling policy, which moves only with the
    soft update after this call). Stops with NonFiniteError before an
    optimizer step whose gradient norm is not finite, and right after one that
    leaves a non-finite weight.
    """
    tc = cfg.train
    traj = batch.trajectory
    if traj.guidance_scale != 1.0:
        raise ValueError(f"DiffusionNFT trains CFG-free (paper Sec. 3.3): these rollouts used guidance_scale="
                         f"{traj.guidance_scale}, so the sampling policy's velocity is not the conditional one the "
                         "loss uses. Sample with sampling.guidance_scale=1")
    if tc.kl_beta > 0 and ref_velocity is None:
        raise ValueError(f"train.kl_beta={tc.kl_beta} needs ref_velocity (the reference model's velocity)")
    device = traj.latents.device
    rank, _ = rank_and_world()
    times, noise = update_draws(traj, tc, update_generator(cfg.seed, step, rank, stream=UPDATE_STREAM))
    k = times.shape[1]
    # r from the flywheel's group advantages (normalised over every rank), not from the raw rewards here.
    r_all = optimality_from_advantages(batch.advantages, tc.adv_clip_max).to(device)
    included = trained_samples(batch, tc.keep_flat_groups).to(device)

    grads = GradientSteps(accelerator, transformer, optimizer, named_params, sync, tc, step)
    for m, rows in enumerate(grads.minibatches(len(traj))):
        sub = traj.select(rows)
        cond, _ = trajectory_conditioning(sub, use_cfg=False)
        x0, r = sub.latents[:, -1], r_all[rows]
        weight = included[rows].float() / included[rows].float().sum().clamp(min=1.0)
        for j in range(k):
            t, eps = times[rows, j].to(device), noise[rows, j].to(device)
            t_b = t.reshape(-1, *([1] * (x0.dim() - 1)))
            x_t = (1 - t_b) * x0 + t_b * eps
            v_old = old_velocity(x_t, t, cond)
            v_ref = ref_velocity(x_t, t, cond) if ref_velocity is not None else None
            v_theta = model.velocity(transformer, x_t, t, cond)
            loss, stats = nft_loss(v_theta, v_old, x0, eps, t, r, tc.beta, tc.loss_weighting, weight,
                                   scale=tc.adv_clip_max, v_ref=v_ref, kl_beta=tc.kl_beta)
            grads.backward(loss / grads.backwards_per_step(k), m, last_of_minibatch=j == k - 1)
            grads.record(stats)
        grads.maybe_step(m)
    metrics = grads.metrics()
    metrics["nft/r_mean"] = float((r_all * included).sum() / included.sum().clamp(min=1))
    metrics["nft/trained_samples"] = float(included.sum())
    return metrics


# ---------------------------------------------------------------------------------------
# Config checks
# ---------------------------------------------------------------------------------------


def validate_config(cfg: Config) -> None:
    """Check every field before anything runs: one ConfigError listing each bad key and what is valid."""
    checks = check_shared_sections(cfg)
    if cfg.async_rollouts:
        checks.fail("async_rollouts=true: not supported by DiffusionNFT here (the engine serves the sampling "
                    "policy theta_old, a soft-updated copy, from this process); set async_rollouts=false")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        checks.fail("FSDP launch: DiffusionNFT's sampling policy is a whole copy of the trainable weights, which "
                    "FSDP shards; launch with DDP (or one process)")
    checks.require("sampling.guidance_scale", lambda v: v == 1.0,
                   "must be 1: DiffusionNFT trains the conditional velocity (CFG-free, paper Sec. 3.3), so v_old "
                   "must be the velocity that sampled; eval guidance is sampling.eval_guidance_scale")
    checks.require("train.beta", lambda v: v > 0, "must be > 0 (the implicit policies mix v_old and v_theta by it)")
    checks.require("train.eta_flat_steps", lambda v: v >= 0, "must be an integer >= 0")
    checks.require("train.eta_rate", lambda v: v >= 0, "must be >= 0 (eta's growth per training step)")
    checks.require("train.eta_max", lambda v: 0 <= v <= 1, "must be in [0, 1] (0: on-policy, 1: never moves)")
    checks.require("train.kl_beta", lambda v: v >= 0, "must be >= 0 (0 = KL-free, as in the paper)")
    grid = cfg.sampling.steps
    if cfg.train.time_sampling == "rollout_grid":
        checks.require("train.timesteps_per_sample", lambda v: 1 <= v <= grid,
                       f"must be in [1, sampling.steps={grid}] (distinct times of the rollout's grid), or null",
                       allow_none=True)
    else:
        checks.require("train.timesteps_per_sample", lambda v: v >= 1, "must be an integer >= 1 or null",
                       allow_none=True)
    checks.raise_if_any()


# ---------------------------------------------------------------------------------------
# Main: setup, loop, save
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    cfg = resolve_config(Config, sys.argv[1:] if argv is None else argv, recipe="nft")
    validate_config(cfg)
    run = RecipeRun(cfg, recipe="nft")
    policy = build_policy(cfg, run.device, reference=bool(cfg.train.kl_beta))  # only the KL penalty needs one
    optimizer = make_optimizer(policy, cfg.train)
    run.resume(policy, optimizer)
    transformer, optimizer = run.prepare(policy, optimizer)
    sampling_weights = initial_sampling_weights(policy, run.recipe_tensors)
    # The engine serves theta_old (a fresh run's: the trained weights) by swapping it into the trained module
    # for each rollout; evaluation samples the trained weights.
    rollouts = Rollouts(cfg, run.accelerator, policy, run.version, run.trainer_state, serve="swapped",
                        served_weights=sampling_weights)
    sampling = SamplingPolicy(sampling_weights, rollouts, policy, cfg.train)

    def update(batch: RolloutBatch, step: int) -> dict:
        metrics = nft_update(batch, policy.model, transformer, sampling.velocity, optimizer, run.accelerator,
                             sampling.serving_unchanged, policy.named_params, cfg, step, policy.ref_velocity)
        return {**metrics, **sampling.follow(policy.named_params, step)}

    return run.train(rollouts, update, recipe_state=sampling.state_dict)


if __name__ == "__main__":
    run_main(main)
