"""DiffusionNFT (arXiv 2509.16117, Zheng et al.): online negative-aware fine-tuning on the forward process.

    accelerate launch trainers/nft.py                       # the built-in toy task (toy-digits)
    python trainers/nft.py --config configs/toy_numbers_nft.yaml
    python trainers/nft.py model.finetune=lora train.learning_rate=1e-3 train.kl_beta=1e-4

Each step the sampling policy v_old (weights theta_old) generates G samples per
prompt with any sampler (ODE by default), the rewards become an optimality
probability r in [0, 1] per sample, and the trained policy v_theta is fitted by
flow matching on the clean samples x0, noised afresh: x_t = (1 - t)·x0 + t·eps,
target u = eps - x0 (Sec. 2.1). Training is CFG-free (Sec. 3.3). After the
update theta_old moves toward theta by the soft update; the engine serves it.

The paper, by equation (arXiv v2):
- r = 1/2 + 1/2·clip((r_raw - mean_group r_raw) / Z_c, -1, 1)   (Alg. 1, l. 4-5)
- v+ = (1 - beta)·v_old + beta·v_theta,  v- = (1 + beta)·v_old - beta·v_theta   (Thm. 3.2)
- L(theta) = E[ r·||v+ - u||^2 + (1 - r)·||v- - u||^2 ]   (Eq. 5; minimiser Eq. 6)
- adaptive weighting: ||x_hat - x0||^2 / sg(mean|x_hat - x0|), x_hat = x_t - t·v (Sec. 3.3)
- soft update theta_old <- eta_i·theta_old + (1 - eta_i)·theta, eta_i = min(0.001·i, 0.5)
  (Alg. 1, l. 14; App. C)

Deviations from the paper's text (each follows the public code, NVlabs/DiffusionNFT,
unless it says otherwise):
1. Loss scale: (r·l+ + (1 - r)·l-) / beta, times advantage.clip_max c; squared norms are
   element means. The gradient at v_theta = v_old is then A times the weighted
   flow-matching gradient, whatever beta and c are.
2. Z_c = c·(std + 1e-4), the std of the step (advantage.global_std) or of the group.
3. Each sample is trained at `timesteps_per_sample` random times of the rollout's
   own grid (the code: 9 of 10); time_sampling=uniform is not in the paper.
4. Masked rewards are left out; flat groups (r = 1/2) stay in unless
   keep_flat_groups=false.
5. KL: the paper is KL-free, the code adds 1e-4·mean||v_theta - v_ref||^2;
   here kl_beta weighs that term and defaults to 0.03 on the toy task (the watch fires without it).
6. Times and noise come from a generator seeded by (seed, step, rank).
7. The code's EMA for evaluation is ema.enabled=true ema.update_every=1 (off
   by default); not here: its fp16 autocast with a GradScaler.
8. Rollouts with classifier-free guidance are refused (v_old must have sampled x0).
9. The eta schedule counts training steps; the first soft update uses eta_1 = 0.001.
10. theta_old is the trained tensors only, swapped into the one transformer (code: a 2nd LoRA adapter); same maths.
11. train.downsample_fraction < 1 (not in the paper or its code): PODS' max-variance down-sampling (arXiv
    2504.13818) of each group's samples by advantage, on each rank's share of a group.

Usage, the equations and deviations in full, logged metrics and the measured runs:
docs/recipes/nft.md; the toy default's tuning: docs/tuning_nft.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import flywheel.quiet_interrupt  # first: run as a script, a Ctrl-C while torch loads is one line, no traceback
flywheel.quiet_interrupt.install(__name__)
import flywheel.openmp_env  # noqa: F401  before torch: OpenMP's idle threads sleep unless the user chose
import torch

from engine import PromptEmbeds, Trajectory
from flywheel.advantages import group_advantages, kept_per_group, max_variance_subset
from flywheel.cli import run_main
from flywheel.distributed import rank_and_world
from flywheel.rollout_collector import RolloutBatch
from flywheel.recipe.algorithm import UpdateResult, gradient_result
from flywheel.recipe.flow_matching import noised
from flywheel.recipe.rollouts import check_layout_options
from flywheel.recipe.policy import Policy
from flywheel.recipe.preflight import fsdp_requested, optimizer_steps_per_update, warn_split_groups
from flywheel.recipe.rollouts import Rollouts
from flywheel.config.parsing import resolve_config
from flywheel.config.sections import AdvantageConfig, OptimConfig, RunConfig, SamplingConfig
from flywheel.config.validation import ABOVE_ZERO, check_shared_sections, check_switched_keys
from flywheel.recipe.session import RecipeRun
from flywheel.recipe.training_loop import train
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
    kl_beta: float = 0.03
    """weight of mean ||v_theta - v_ref||^2 to the reference (base) model; 0 = KL-free as in the paper. 0.03 keeps
    the toy default from gaming its reward (docs/recipes/nft.md#defaults-and-reward-hacking)"""
    downsample_fraction: float = 1.0
    """PODS (arXiv 2504.13818): train only the max-variance round(f·G) (at least 2) of each group's samples on this
    rank, with no forwards for the rest; 1 = every sample (the paper)"""


@dataclass
class Config(RunConfig):
    run_dir: str = "runs/nft-toy"
    """where config, metrics, samples and checkpoints go"""
    steps: int = 55
    """training steps (rollout + update + soft update); with kl_beta 0.03, 55 passes 0.95 before the samples of a
    prompt collapse (docs/recipes/nft.md#defaults-and-reward-hacking)"""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(sampler="ode"))
    train: NFTConfig = field(default_factory=NFTConfig)
    advantage: AdvantageConfig = field(default_factory=lambda: AdvantageConfig(global_std=True))
    """advantages normalised by the std of all the step's rewards (the paper's "global reward std"); clip_max is
    c: advantages are clipped to [-c, c], r = 1/2 + A / (2c), and the loss is scaled by c (public code)"""


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
    if v_ref is not None:  # without a reference nothing was measured: no key rather than a 0 that reads as one
        stats["ref_mse"] = kl.detach()  # a velocity MSE, not a KL: its own key (GRPO's "kl" is a Gaussian KL)
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
    """theta_old, the policy that rolls out: its weights, the velocity v_old they give, and its soft update.

    `weights` (name -> tensor, the trainable ones: all of the transformer or the
    LoRA adapter, in the weights' dtype) are what the soft update moves, what the
    engine serves (the training loop swaps them into the one transformer around
    rollouts and syncs, inside `NFT.serving_weights`) and what a checkpoint keeps.
    v_old is the trained module's velocity with them swapped in for the forward:
    no second copy of the model (flywheel/recipe/policy.py `swapped_in`).
    """

    def __init__(self, weights: dict[str, torch.Tensor], policy: Policy, tc: NFTConfig, equals_trained: bool = True):
        self.weights, self.policy, self.tc = weights, policy, tc
        # theta_old == theta bit for bit (a fresh run's snapshot, or after a soft update with eta 0): until the
        # next optimizer step v_old is v_theta, so the update reuses v_theta's forward for it.
        self.equals_trained = equals_trained

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds) -> torch.Tensor:
        """v_old: the conditional velocity of the sampling weights (no grad); the trained ones are back after."""
        with torch.no_grad(), self.policy.weights_swapped(self.weights):
            return self.policy.model.velocity(self.policy.transformer, x, t, cond)

    def follow(self, named_params: list[tuple[str, torch.nn.Parameter]], step: int) -> dict:
        """After step `step`'s optimizer steps: theta_old <- eta·theta_old + (1 - eta)·theta (the loop then
        serves it, version + 1).

        eta is the schedule's at step + 1, the training steps done: the public code raises its step count
        before it soft-updates, so its first update already uses 0.001.
        """
        tc = self.tc
        eta = eta_schedule(step + 1, tc.eta_flat_steps, tc.eta_rate, tc.eta_max)
        soft_update([self.weights[name] for name, _ in named_params], [p for _, p in named_params], eta)
        self.equals_trained = eta == 0  # eta 0 copies theta exactly (soft_update)
        return {"nft/eta": eta}

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


def has_random_layers(module: torch.nn.Module) -> bool:
    """Whether a forward of `module` draws random numbers (a dropout with p > 0 in training mode): two forwards at
    the same weights then differ, so v_old cannot be taken from v_theta's forward."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
               for m in module.modules())


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


def trained_samples(batch: RolloutBatch, keep_flat_groups: bool, downsample_fraction: float = 1.0) -> torch.Tensor:
    """Which samples enter the loss [B]: the valid ones (or only those of groups with a spread of rewards), and of
    those, with downsample_fraction < 1, each group's max-variance subset by advantage (PODS)."""
    if not keep_flat_groups:
        included = batch.usable.bool()
    elif batch.rewards is None:  # no scorer masks (hand-built batches): every sample has a reward
        included = torch.ones_like(batch.usable, dtype=torch.bool)
    else:
        included = batch.rewards.valid.to(batch.usable.device).bool()
    if downsample_fraction < 1:
        # Advantages, not rewards: within a group they are an affine map of the rewards (the same subset), and
        # they are what every rank agrees on.
        included = max_variance_subset(batch.advantages.to(included.device), batch.group_ids.to(included.device),
                                       downsample_fraction, included)
    return included


def down_sampled_minibatches(included: torch.Tensor, count: int) -> list[list[int]]:
    """The kept rows split in order into `count` minibatches of near-equal size: as many as the update of every
    row has, so the optimizer steps (train.updates_per_rollout) are the same, and the same on every process
    whatever each keeps (their gradients are all-reduced at the same minibatches). A minibatch left without a
    kept row (fewer kept than minibatches) runs one excluded row at weight 0, so every process runs its backward."""
    kept = included.nonzero().flatten().tolist()
    spare = (~included).nonzero().flatten().tolist()
    out = []
    for part in torch.tensor_split(torch.tensor(kept, dtype=torch.long), count):
        out.append(part.tolist() or [spare.pop(0)])
    return out


class NFT:
    """DiffusionNFT's update behind the algorithm protocol (flywheel/recipe/algorithm.py): the policy, its
    optimizer, the config and the sampling policy theta_old, whose weights are the recipe's own tensors and the
    ones the engine serves (`serving_weights`).

    `transformer` is the trained module as prepared (DDP-wrapped on several ranks); `policy.ref_velocity`, the
    reference model's velocity, is needed when train.kl_beta > 0 and logged ("ref_mse") whenever given.
    `old_velocity(x_t, t, cond)` gives v_old: the sampling policy's (theta_old swapped into the trained module).
    """

    def __init__(self, policy: Policy, optimizer, transformer, cfg, accelerator):
        self.policy, self.optimizer, self.transformer, self.cfg = policy, optimizer, transformer, cfg
        self.accelerator = accelerator
        self.sampling = SamplingPolicy(initial_sampling_weights(policy, {}), policy, cfg.train)
        self.old_velocity: VelocityFn = self.sampling.velocity

    def update(self, batch: RolloutBatch, step: int) -> UpdateResult:
        """One DiffusionNFT update over this rank's rollouts: minibatches x K flow times, optimizer step(s), then
        the soft update of theta_old (Algorithm 1, line 14). Stops with NonFiniteError before an optimizer step
        whose gradient norm is not finite, and right after one that leaves a non-finite weight."""
        cfg, tc, model, transformer = self.cfg, self.cfg.train, self.policy.model, self.transformer
        ref_velocity = self.policy.ref_velocity
        traj = batch.trajectory
        if traj.guidance_scale != 1.0:
            raise ValueError(f"DiffusionNFT trains CFG-free (paper Sec. 3.3): these rollouts used guidance_scale="
                             f"{traj.guidance_scale}, so the sampling policy's velocity is not the conditional one "
                             "the loss uses. Sample with sampling.guidance_scale=1")
        if tc.kl_beta > 0 and ref_velocity is None:
            raise ValueError(f"train.kl_beta={tc.kl_beta} needs ref_velocity (the reference model's velocity)")
        device = traj.latents.device
        rank, _ = rank_and_world()
        times, noise = update_draws(traj, tc, update_generator(cfg.seed, step, rank, stream=UPDATE_STREAM))
        k = times.shape[1]
        # r from the flywheel's group advantages (normalised over every rank), not from the raw rewards here.
        r_all = optimality_from_advantages(batch.advantages, cfg.advantage.clip_max).to(device)
        included = trained_samples(batch, tc.keep_flat_groups, tc.downsample_fraction).to(device)

        grads = GradientSteps(self.accelerator, transformer, self.optimizer, self.policy.named_params, tc, step)
        minibatches = grads.minibatches(len(traj))  # every row, an excluded one at weight 0
        if tc.downsample_fraction < 1:  # the kept rows only: the others cost no forward (PODS' saving)
            minibatches = down_sampled_minibatches(included, len(minibatches))
        # Until this update's first optimizer step, a sampling policy equal to the trained one gives v_old =
        # v_theta exactly: one forward fewer per loss term (eta 0, e.g. train.eta_max=0; the same numbers).
        reuse_v_theta = self.v_old_is_v_theta()
        reused = 0
        for m, rows in enumerate(minibatches):
            sub = traj.select(rows)
            cond, _ = trajectory_conditioning(sub, use_cfg=False)
            x0, r = sub.latents[:, -1], r_all[rows]
            weight = included[rows].float() / included[rows].float().sum().clamp(min=1.0)
            for j in range(k):
                t, eps = times[rows, j].to(device), noise[rows, j].to(device)
                t_b = t.reshape(-1, *([1] * (x0.dim() - 1)))
                x_t = (1 - t_b) * x0 + t_b * eps
                # v_old before v_theta: its forward swaps theta_old into the parameters v_theta's graph will need.
                v_old = None if reuse_v_theta else self.old_velocity(x_t, t, cond)
                v_ref = ref_velocity(x_t, t, cond) if ref_velocity is not None else None
                with grads.microstep(m, last_of_minibatch=j == k - 1):
                    v_theta = model.velocity(transformer, x_t, t, cond)
                    if reuse_v_theta:
                        v_old, reused = v_theta.detach(), reused + 1
                    loss, stats = nft_loss(v_theta, v_old, x0, eps, t, r, tc.beta, tc.loss_weighting, weight,
                                           scale=cfg.advantage.clip_max, v_ref=v_ref, kl_beta=tc.kl_beta)
                    grads.backward(loss / grads.backwards_per_step(k))
                grads.record(stats)
            if grads.maybe_step(m):
                reuse_v_theta = False  # theta moved, theta_old did not
        metrics = grads.metrics()
        metrics["nft/old_forwards_skipped"] = float(reused)
        metrics["nft/r_mean"] = float((r_all * included).sum() / included.sum().clamp(min=1))
        metrics["nft/trained_samples"] = float(included.sum())
        metrics.update(self.sampling.follow(self.policy.named_params, step))
        return gradient_result(metrics)

    def v_old_is_v_theta(self) -> bool:
        """Whether v_old may be taken from v_theta's forward: the sampling policy's own velocity (not one a caller
        set), theta_old equal to theta, and a forward without random layers."""
        return (self.old_velocity == self.sampling.velocity and self.sampling.equals_trained
                and not has_random_layers(self.transformer))

    def serving_weights(self):
        """theta_old in the trained module's place: what rollouts sample and what a weight sync serves."""
        return self.policy.weights_swapped(self.sampling.weights)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.sampling.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """A checkpoint's theta_old (strict names); {} (a fresh run) starts it at the trained weights."""
        self.sampling.weights = initial_sampling_weights(self.policy, state)
        self.sampling.equals_trained = all(torch.equal(self.sampling.weights[name], p.detach())
                                           for name, p in self.policy.named_params)


# ---------------------------------------------------------------------------------------
# Config checks
# ---------------------------------------------------------------------------------------


# NFT's keys that act only when their switch is on (check_switched_keys): set away from the default
# with the switch off, they would be ignored.
NFT_SWITCHED_KEYS = (
    ("train.eta_max", ABOVE_ZERO, ("train.eta_rate", "train.eta_flat_steps")),  # eta_max 0: theta_old = theta
)


def check_beta_acts(cfg: Config, checks) -> None:
    """train.beta set away from its default where it cannot act: with train.eta_max 0 and one optimizer step per
    update, every loss term has v_old = v_theta, where the loss's gradient is A times the flow-matching gradient
    whatever beta is (deviation 1; tests/test_nft_loss.py). beta only rescales the logged loss there."""
    tc = cfg.train
    if cfg.resume or tc.eta_max != 0 or not tc.beta > 0 or tc.beta == NFTConfig().beta:
        return
    if optimizer_steps_per_update(cfg) == 1:
        checks.fail(f"train.beta={tc.beta:g} with train.eta_max=0 and one optimizer step per update: theta_old is "
                    "theta at every loss term, where the gradient does not depend on beta, so it would be ignored; "
                    "set train.eta_max > 0 or train.updates_per_rollout > 1, or leave it out")


def validate_config(cfg: Config) -> None:
    """Check every field before anything runs: one ConfigError listing each bad key and what is valid."""
    checks = check_shared_sections(cfg)
    check_switched_keys(cfg, checks, NFT_SWITCHED_KEYS)
    check_beta_acts(cfg, checks)
    check_layout_options(cfg, checks, serve="swapped")  # the engine serves theta_old: async, Ray, workflow refused
    if fsdp_requested():
        checks.fail("FSDP launch: DiffusionNFT's sampling policy is a whole copy of the trainable weights, which "
                    "FSDP shards; launch with DDP (or one process)")
    checks.require("sampling.guidance_scale", lambda v: v == 1.0,
                   "must be 1: DiffusionNFT trains the conditional velocity (CFG-free, paper Sec. 3.3), so v_old "
                   "must be the velocity that sampled; eval guidance is eval.guidance_scale")
    checks.require("train.beta", lambda v: v > 0, "must be > 0 (the implicit policies mix v_old and v_theta by it)")
    checks.require("train.eta_flat_steps", lambda v: v >= 0, "must be an integer >= 0")
    checks.require("train.eta_rate", lambda v: v >= 0, "must be >= 0 (eta's growth per training step)")
    checks.require("train.eta_max", lambda v: 0 <= v <= 1, "must be in [0, 1] (0: on-policy, 1: never moves)")
    checks.require("train.kl_beta", lambda v: v >= 0, "must be >= 0 (0 = KL-free, as in the paper)")
    checks.require("train.downsample_fraction", lambda v: 0 < v <= 1,
                   "must be in (0, 1]: the fraction of each group's samples trained (1 = all)")
    size = cfg.data.group_size
    fraction = cfg.train.downsample_fraction
    if 0 < fraction < 1 and isinstance(size, int) and size >= 1 and kept_per_group(size, fraction) == size:
        checks.fail(f"train.downsample_fraction={fraction:g} keeps every sample of a group of data.group_size={size} "
                    "(at least 2 are kept), so it would be ignored; use a larger group or leave it out")
    grid = cfg.sampling.steps
    if cfg.train.time_sampling == "rollout_grid":
        checks.require("train.timesteps_per_sample", lambda v: 1 <= v <= grid,
                       f"must be in [1, sampling.steps={grid}] (distinct times of the rollout's grid), or null",
                       allow_none=True)
    else:
        checks.require("train.timesteps_per_sample", lambda v: v >= 1, "must be an integer >= 1 or null",
                       allow_none=True)
    checks.raise_if_any()
    if fraction < 1:
        warn_split_groups(cfg, "train.downsample_fraction keeps the max-variance subset of each process's share of "
                               "a group, not of the whole group")


# ---------------------------------------------------------------------------------------
# Main: setup, loop, save
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    cfg = resolve_config(Config, sys.argv[1:] if argv is None else argv, recipe="nft")
    validate_config(cfg)
    run = RecipeRun(cfg, recipe="nft")
    policy, transformer, optimizer = run.trained_policy(reference=bool(cfg.train.kl_beta))  # only the KL penalty needs one
    nft = NFT(policy, optimizer, transformer, cfg, run.accelerator)
    nft.load_state_dict(run.recipe_tensors)  # theta_old of a resumed run
    # The engine serves the trained module; the loop swaps theta_old into it around rollouts and syncs
    # (nft.serving_weights), and evaluation samples the trained weights.
    rollouts = Rollouts(cfg, run.accelerator, policy, run.version, run.trainer_state, serve="swapped")
    return train(run, rollouts, nft)


if __name__ == "__main__":
    run_main(main)
