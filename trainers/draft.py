"""Reward-gradient fine-tuning: DRaFT-K (Clark et al., arXiv 2309.17400) and ReFL (Xu et al., ImageReward,
arXiv 2304.05977) as a setting of it. Page: docs/recipes/draft.md (usage, metrics, measurements).

    accelerate launch trainers/draft.py                      # the built-in toy task (toy-digits)
    python trainers/draft.py --config configs/toy_numbers_draft.yaml
    python trainers/draft.py train.mode=refl                 # ReFL's one-step x0 prediction at a late step

A differentiable reward's gradient flows back through the sampler into the weights: no advantages, no
likelihoods. The flywheel rolls out G samples per prompt with the ODE (no grad); the update re-runs the last
part of each sample's chain with grad and maximises the reward of where it lands.

DRaFT-K (`train.mode=draft`, K = `train.truncation_steps`), with the T-step Euler ODE
x_{k+1} = x_k + (t_{k+1} - t_k)·v_theta(x_k, t_k, c) from t_0 = 1 (noise) to t_T = 0 (data):

    x_T(theta) = Phi_{T-1} o ... o Phi_{T-K}(sg(x_{T-K})),     L(theta) = -s·r(decode(x_T), c)

(the paper's truncated backpropagation; s = `train.reward_scale`; the update starts from the rollout's stored
x_{T-K}). Each step's forward runs under torch.utils.checkpoint (`train.step_checkpointing`): one forward's
activations are held at a time whatever K is; the gradient is the same (tested bit for bit).
DRaFT-LV (`train.lv_samples=n`, K = 1): x_t^i = (1 - t)·sg(x_T) + t·eps_i at t = t_{T-1}, denoised in one
step with grad, x_hat^i = x_t^i - t·v_theta(x_t^i, t); L = mean_i -s·r(decode(x_hat^i)).
ReFL (`train.mode=refl`): a step j per sample, uniform in int(lo·T) .. int(hi·T) - 1 (`train.refl_window`,
default (0.75, 1): ImageReward's code draws mid_timestep in [30, 39] of 40); x0_hat = x_j - t_j·v_theta(x_j, t_j)
with grad from the rollout's own x_j; L = -s·r(decode(x0_hat)).

Regularisers, optional (0 = off, as in the papers' main runs), at every state the grad path visits:

    + kl_beta     · mean |v_theta - v_ref|^2        velocity MSE to the reference (base) model
    + anchor_beta · mean |v_theta - v_ema|^2        velocity MSE to an EMA of the trained weights (AWM's anchor)

Only scorers with `differentiable = True` (rewards/types.py) are accepted: another is refused when the config
is checked, before anything is written. The reward is the weighted sum of raw scores; a NaN-scored sample is
left out of the loss.

Deviations from the papers, each on purpose:
1. Sampler: DRaFT and ReFL sample Stable Diffusion with DDIM (ReFL: 40 steps); here the card's rectified-flow
   Euler ODE. The no-grad part is the flywheel's rollout itself, so the update does not sample twice; with
   several optimizer steps per rollout the later minibatches start from states of older weights.
2. Loss: DRaFT maximises r; ReFL's released code minimises relu(2 - r)·1e-3 and mixes in a pretraining loss
   (recalled from that code, not re-read here). Here -s·r for both, no pretraining data (the KL and anchor
   terms are the brakes); rows averaged over a minibatch's valid samples.
3. DRaFT trains LoRA weights of SD 1.4; here any card, full or LoRA, with every recipe's max_grad_norm clip.
4. ReFL's step and DRaFT-LV's noise come from a generator seeded from (seed, step, rank), so a resumed run
   draws what an uninterrupted one did; the papers' code uses the global RNG.
5. Rollouts with CFG (sampling.guidance_scale != 1) train through the guided velocity, the one that sampled.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal


import flywheel.quiet_interrupt  # first: run as a script, a Ctrl-C while torch loads is one line, no traceback
flywheel.quiet_interrupt.install(__name__)
import flywheel.openmp_env  # noqa: F401  before torch: OpenMP's idle threads sleep unless the user chose
import torch
from torch.utils.checkpoint import checkpoint

from engine.sampling import ode_step
from flywheel.cli import run_main
from flywheel.recipe.algorithm import UpdateResult, gradient_result
from flywheel.recipe.ema import EMAAnchored, WeightEMA, checkpointed_anchor
from flywheel.recipe.policy import Policy
from flywheel.recipe.preflight import check_anchor_lags, fsdp_requested
from flywheel.recipe.rollouts import Rollouts
from flywheel.config.parsing import resolve_config
from flywheel.config.sections import OptimConfig, RunConfig, SamplingConfig
from flywheel.config.validation import (ABOVE_ZERO, check_advantage_unused, check_shared_sections, check_switched_keys,
                                        set_away_from_default)
from flywheel.recipe.session import RecipeRun
from flywheel.recipe.training_loop import train
from flywheel.recipe.update import GradientSteps, trajectory_conditioning, update_generator
from flywheel.rollout_collector import RolloutBatch

# Keeps this recipe's draws (ReFL's steps, DRaFT-LV's noise) apart from other users of the run's seed.
DRAW_STREAM = 0x445246  # "DRF"
# The EMA anchor's tensors in a checkpoint (beside the trained weights, see RecipeRun.save).
MODES = ("draft", "refl")

# velocity(x, t) of the trained policy for one minibatch's conditioning, with grad.
Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# The (x_k detached, t_k, v_k) of each step a grad path takes: where the regularisers compare velocities.
Visited = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------------------------------
# Config: the algorithm's own keys of the `train` section, and the recipe's config
# ---------------------------------------------------------------------------------------


@dataclass
class DraftConfig(OptimConfig):
    learning_rate: float = 1e-3
    """AdamW learning rate (docs/recipes/draft.md: the toy runs)"""
    mode: Literal["draft", "refl"] = "draft"
    """"draft": backpropagate through the last truncation_steps ODE steps (DRaFT-K); "refl": one-step x0
    prediction from a random late step of the rollout (ReFL)"""
    truncation_steps: int = 1
    """K: the ODE steps the reward's gradient flows through (DRaFT-K; DRaFT-1 is the default here)"""
    lv_samples: int = 0
    """DRaFT-LV: noise the final sample to the last step's time this many times and denoise each with grad
    (0 = off; needs mode=draft, truncation_steps=1; the paper uses 2)"""
    refl_window: tuple[float, float] = (0.75, 1.0)
    """ReFL: the step index is drawn among int(lo·T) .. int(hi·T) - 1 of a T-step rollout (ImageReward: 30..39
    of 40)"""
    step_checkpointing: bool = True
    """recompute each grad step's transformer forward in backward (torch.utils.checkpoint): one step's
    activations held at a time, whatever K is; the same gradient"""
    reward_scale: float = 1.0
    """s in L = -s·r: the reward's weight in the loss (negative minimises the reward)"""
    kl_beta: float = 0.1
    """weight of the velocity MSE to the reference (base) model at the grad path's states (0 = off, no
    reference built); 0.1 keeps the toy default from gaming its reward (docs/recipes/draft.md)"""
    anchor_beta: float = 0.0
    """weight of the velocity MSE to an EMA of the trained weights (AWM's KL-EMA anchor; 0 = off)"""
    anchor_decay: float = 0.3
    """EMA anchor: ceiling of the decay (EMA <- decay·EMA + (1 - decay)·weights after each step)"""
    anchor_decay_ramp: float = 0.001
    """EMA anchor: decay = min(anchor_decay, anchor_decay_ramp·steps done) (AWM's warm-up)"""


@dataclass
class Config(RunConfig):
    run_dir: str = "runs/draft-toy"
    """where config, metrics, samples and checkpoints go"""
    steps: int = 35
    """training steps (rollout + update); with kl_beta 0.1 toy-digits passes 0.95 at 35 (docs/recipes/draft.md)"""
    # The gradient path re-runs the deterministic sampler: rollouts must be the ODE's.
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(sampler="ode"))
    train: DraftConfig = field(default_factory=DraftConfig)


# ---------------------------------------------------------------------------------------
# Config checks
# ---------------------------------------------------------------------------------------


def refl_steps(num_steps: int, window: tuple[float, float]) -> tuple[int, int]:
    """[first, end) step indices ReFL draws from in a `num_steps`-step rollout; ValueError when empty."""
    lo, hi = window
    first, end = int(lo * num_steps), min(int(hi * num_steps), num_steps)
    if end <= first:
        raise ValueError(f"train.refl_window={tuple(window)} holds no step of a {num_steps}-step rollout "
                         f"(indices {first}..{end - 1}): widen it or raise sampling.steps")
    return first, end


def check_differentiable_rewards(cfg, checks) -> None:
    """One line naming each scorer of `rewards` that passes no gradient to the pixels, and the ones that do."""
    from rewards.registry import check_spec, differentiable_scorers, is_differentiable_target, parse_spec_targets

    if check_spec(cfg.reward.scorers, cfg.reward.args, cfg.reward.modules):
        return  # the reward keys' own problems are reported by check_shared_sections
    refused = []
    for name, target, _ in parse_spec_targets(cfg.reward.scorers):
        try:
            ok = is_differentiable_target(target)
        except (KeyError, ImportError, TypeError, ValueError):
            ok = False
        if not ok:
            refused.append(name if name == target else f"{name} ({target})")
    if refused:
        checks.fail(f"reward.scorers={cfg.reward.scorers!r}: {', '.join(refused)} {'is' if len(refused) == 1 else 'are'} not "
                    "differentiable (DRaFT/ReFL backpropagate the reward into the pixels); differentiable scorers: "
                    f"{', '.join(differentiable_scorers())}")


# DRaFT's keys that act only when their switch is on (check_switched_keys): set away from the default
# with the switch off, they would be ignored.
DRAFT_SWITCHED_KEYS = (
    ("train.mode", "draft", ("train.truncation_steps",)),
    ("train.mode", "refl", ("train.refl_window",)),
    ("train.anchor_beta", ABOVE_ZERO, ("train.anchor_decay", "train.anchor_decay_ramp")),  # 0: no EMA anchor
)


MAX_LV_SAMPLES = 1000  # reward passes a sample for DRaFT-LV (the paper takes 2): a bound for typos


def validate_config(cfg: Config) -> None:
    """Check every field before anything runs: one ConfigError listing each bad key and what is valid."""
    checks = check_shared_sections(cfg)
    check_switched_keys(cfg, checks, DRAFT_SWITCHED_KEYS)
    tc = cfg.train
    checks.require("train.mode", lambda v: v in MODES, f"must be one of {', '.join(MODES)}")
    checks.require("train.truncation_steps", lambda v: 1 <= v <= cfg.sampling.steps,
                   f"must be in [1, sampling.steps={cfg.sampling.steps}] (the ODE steps the gradient flows through)")
    checks.require("train.lv_samples", lambda v: 0 <= v <= MAX_LV_SAMPLES,
                   f"must be an integer in [0, {MAX_LV_SAMPLES}] (0 = off; each is one more reward and backward pass)")
    if tc.lv_samples > 0 and (tc.mode != "draft" or tc.truncation_steps != 1):
        checks.fail(f"train.lv_samples={tc.lv_samples}: DRaFT-LV is a variant of DRaFT-1: it needs train.mode=draft "
                    f"and train.truncation_steps=1 (got mode={tc.mode}, truncation_steps={tc.truncation_steps})")
    checks.require("train.refl_window", lambda w: len(w) == 2 and 0 <= w[0] < w[1] <= 1,
                   "must be [lo, hi] with 0 <= lo < hi <= 1 (fractions of the rollout's steps)")
    if tc.mode == "refl" and len(tc.refl_window) == 2 and 0 <= tc.refl_window[0] < tc.refl_window[1] <= 1:
        try:
            refl_steps(cfg.sampling.steps, tc.refl_window)
        except ValueError as e:
            checks.fail(str(e))
    checks.require("train.reward_scale", lambda v: math.isfinite(v) and v != 0,
                   "must be a finite number other than 0 (negative minimises the reward)")
    for key in ("train.kl_beta", "train.anchor_beta", "train.anchor_decay_ramp"):
        checks.require(key, lambda v: v >= 0, "must be >= 0 (0 = off)")
    checks.require("train.anchor_decay", lambda v: 0 <= v < 1, "must be in [0, 1)")
    check_anchor_lags(cfg, checks)
    checks.require("sampling.sampler", lambda v: v == "ode",
                   "must be ode: the gradient path re-runs the rollout's deterministic sampler from its stored states")
    checks.require("reward.aggregation", lambda v: v == "weighted_sum",
                   "must be weighted_sum: the loss is the weighted sum of the scorers' scores (no advantages)")
    check_advantage_unused(cfg, checks, "DRaFT", "the loss is the reward itself, differentiated")
    for key, value in set_away_from_default(cfg, ("reward.max_flat_steps",)):
        # A flat group stops no DRaFT step: every valid sample's reward is differentiated, equal or not.
        checks.fail(f"{key}={value}: DRaFT trains on every valid sample's reward, not on the spread within a group, "
                    "so equal rewards never stop a step and it would be ignored; leave it out")
    if cfg.rollout.asynchronous:
        checks.fail("rollout.asynchronous=true: not supported by DRaFT (its gradient path starts from the rollout's states, "
                    "made by the weights it trains); set rollout.asynchronous=false")
    if cfg.rollout.backend != "local":
        checks.fail(f"rollout.backend={cfg.rollout.backend}: DRaFT scores with its own differentiable scorers in "
                    "this process; set rollout.backend=local")
    if cfg.workflow.name:
        checks.fail(f"workflow.name={cfg.workflow.name!r}: DRaFT differentiates the trained card's own sampler "
                    "and decoder only; unset workflow.name")
    if fsdp_requested():
        checks.fail("FSDP launch: not supported by DRaFT here (not tested); launch with DDP (or one process)")
    check_differentiable_rewards(cfg, checks)
    checks.raise_if_any()


# ---------------------------------------------------------------------------------------
# The differentiable reward
# ---------------------------------------------------------------------------------------


class DifferentiableReward:
    """The weighted sum of differentiable scorers' scores, with the autograd graph back to the images."""

    def __init__(self, scorers: dict, weights: dict[str, float]):
        from rewards.types import is_differentiable

        for name, scorer in scorers.items():
            if not is_differentiable(scorer):
                raise ValueError(f"reward {name!r} is not differentiable (its scorer sets no differentiable = True)")
        self.scorers, self.weights = scorers, weights

    @classmethod
    def for_run(cls, cfg, rollouts: Rollouts) -> "DifferentiableReward":
        """The run's scorers: the rollouts' own (one copy of each scorer's weights), else built from the spec."""
        from flywheel.video import MiddleFrameRewards

        reward_set = rollouts.flywheel.rewards
        if isinstance(reward_set, MiddleFrameRewards):  # a video card's: the scorers are the wrapped set's
            reward_set = reward_set.rewards
        scorers = getattr(reward_set, "scorers", None)
        if isinstance(scorers, dict) and scorers:
            return cls(scorers, dict(reward_set.weights))
        from rewards import RewardSet
        from rewards.registry import resolve_args

        built = RewardSet(cfg.reward.scorers, scorer_kwargs=resolve_args(cfg.reward.scorers, cfg.reward.args))
        return cls(built.scorers, dict(built.weights))

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(total [B] on the images' device, with grad; valid [B] bool: every score finite; {name: scores})."""
        total = torch.zeros(images.shape[0], device=images.device)
        valid = torch.ones(images.shape[0], dtype=torch.bool, device=images.device)
        per_scorer = {}
        # The scorers see a view of the images whose gradient is zeroed on the invalid rows: where a score is
        # NaN its local derivative is NaN too, and the 0 the masked mean gives it times NaN is NaN, which would
        # reach the weights (a NaN gradient norm) although the row is left out of the loss.
        scored = images.view_as(images) if images.requires_grad else images
        for name, scorer in self.scorers.items():
            scores = scorer(scored, prompts, metadata).to(images.device).float()
            if images.requires_grad and not scores.requires_grad:
                raise RuntimeError(f"reward {name!r} declares differentiable = True but its scores carry no gradient "
                                   "to the images (a no_grad, detach, uint8 or numpy step in its __call__?): fix the "
                                   "scorer or leave it out of this recipe's rewards")
            ok = torch.isfinite(scores)
            valid &= ok
            per_scorer[name] = scores
            total = total + self.weights[name] * torch.where(ok, scores, torch.zeros_like(scores))
        if scored.requires_grad and not bool(valid.all()):
            keep = valid.view(-1, *([1] * (images.dim() - 1)))
            scored.register_hook(lambda grad: torch.where(keep, grad, torch.zeros_like(grad)))
        return total, valid, per_scorer


# ---------------------------------------------------------------------------------------
# The gradient path: DRaFT-K's last K steps, DRaFT-LV's re-noised last step, ReFL's one step
# ---------------------------------------------------------------------------------------


def grad_velocity(velocity: Velocity, x: torch.Tensor, t: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    """v_theta(x, t) with grad; under checkpointing its activations are recomputed in backward."""
    if checkpointed:
        return checkpoint(velocity, x, t, use_reentrant=False)
    return velocity(x, t)


def truncated_ode(velocity: Velocity, x: torch.Tensor, timesteps: torch.Tensor, first: int,
                  checkpointed: bool = True) -> tuple[torch.Tensor, Visited]:
    """DRaFT-K's grad path: Euler steps first..T-1 of the ODE from x (the state at timesteps[first]) to t = 0.

    Returns (x_T with the graph through every step's velocity, the visited (x_k detached, t_k, v_k) of each step:
    the regularisers' points). `timesteps` [T+1] from 1 to 0.
    """
    visited = []
    for k in range(first, len(timesteps) - 1):
        t, t_next = timesteps[k], timesteps[k + 1]
        v = grad_velocity(velocity, x, t, checkpointed)
        visited.append((x.detach(), t, v))
        x = ode_step(x, v, t, t_next)
    return x, visited


def one_step_x0(velocity: Velocity, x_t: torch.Tensor, t: torch.Tensor, checkpointed: bool = True
                ) -> tuple[torch.Tensor, Visited]:
    """ReFL's and DRaFT-LV's grad path: x0_hat = x_t - t·v_theta(x_t, t) (t a scalar or one per row)."""
    v = grad_velocity(velocity, x_t, t, checkpointed)
    t_b = t.reshape(-1, *([1] * (x_t.dim() - 1))) if t.dim() == 1 else t
    return x_t - t_b * v, [(x_t.detach(), t, v)]


def grad_paths(traj, velocity: Velocity, tc: DraftConfig, generator: torch.Generator):
    """The minibatch's grad paths, one per loss term: [(x_final, visited, t_mean)] (DRaFT-LV: one per draw)."""
    timesteps = traj.timesteps.to(traj.latents.device)
    steps = len(timesteps) - 1
    if tc.mode == "draft" and tc.lv_samples == 0:
        first = steps - tc.truncation_steps
        x, visited = truncated_ode(velocity, traj.latents[:, first].detach(), timesteps, first, tc.step_checkpointing)
        return [(x, visited, float(timesteps[first:-1].mean()))]
    if tc.mode == "draft":  # DRaFT-LV
        t = timesteps[steps - 1]
        x0 = traj.latents[:, -1].detach()
        paths = []
        for _ in range(tc.lv_samples):
            eps = torch.randn(x0.shape, generator=generator).to(x0.device)
            x_t = (1 - t) * x0 + t * eps
            x, visited = one_step_x0(velocity, x_t, t, tc.step_checkpointing)
            paths.append((x, visited, float(t)))
        return paths
    first, end = refl_steps(steps, tc.refl_window)
    index = torch.randint(first, end, (len(traj),), generator=generator).to(traj.latents.device)
    rows = torch.arange(len(traj), device=traj.latents.device)
    x_j, t_j = traj.latents[rows, index].detach(), timesteps[index]
    x, visited = one_step_x0(velocity, x_j, t_j, tc.step_checkpointing)
    return [(x, visited, float(t_j.mean()))]


def velocity_distance(visited, target: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Mean over the grad path's steps of mean |v_theta - v_target|^2 at the same points (targets: no grad)."""
    terms = []
    for x, t, v in visited:
        with torch.no_grad():
            v_target = target(x, t)
        terms.append((v.float() - v_target.detach().float()).pow(2).mean())
    return torch.stack(terms).mean()


def draft_loss(reward: torch.Tensor, valid: torch.Tensor, reward_scale: float, kl: torch.Tensor | None = None,
               kl_beta: float = 0.0, anchor: torch.Tensor | None = None, anchor_beta: float = 0.0
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-s·mean_valid(r) + kl_beta·kl + anchor_beta·anchor; rows with an invalid reward are left out."""
    weight = valid.float() / valid.float().sum().clamp(min=1.0)
    mean_reward = (torch.where(valid, reward, torch.zeros_like(reward)) * weight).sum()
    loss = -reward_scale * mean_reward
    stats = {"draft/reward": mean_reward.detach(), "draft/valid_samples": valid.float().sum()}
    if kl is not None:
        loss = loss + kl_beta * kl
        stats["ref_mse"] = kl.detach()  # a velocity MSE, not a KL (GRPO's "kl" is a Gaussian KL)
    if anchor is not None:
        loss = loss + anchor_beta * anchor
        stats["anchor_mse"] = anchor.detach()
    stats["loss"] = loss.detach()
    return loss, stats


# ---------------------------------------------------------------------------------------
# The EMA anchor: its velocity through torch.func.functional_call (no in-place weight swap, so the autograd
# graph of the trained weights, which holds them, stays valid)
# ---------------------------------------------------------------------------------------


class _PolicyVelocity(torch.nn.Module):
    """The policy's velocity as a module (for functional_call): its only submodule is the trained transformer."""

    def __init__(self, policy: Policy):
        super().__init__()
        self.transformer = policy.transformer
        self.__dict__["_policy"] = policy  # not a submodule

    def forward(self, x, t, cond, uncond_cond, guidance):
        return self._policy.velocity(self.transformer, x, t, cond, uncond_cond, guidance)


class EMAAnchor:
    """An EMA of the trained weights (the shared `WeightEMA`, float32) and the velocity it gives."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.average = WeightEMA(policy.named_params, what="EMA anchor")
        self._module = _PolicyVelocity(policy)

    @staticmethod
    def decay(steps_done: int, tc: DraftConfig) -> float:
        return min(tc.anchor_decay, tc.anchor_decay_ramp * steps_done)

    def velocity(self, x, t, cond, uncond_cond, guidance) -> torch.Tensor:
        weights = {f"transformer.{n}": self.average.shadow[n].to(p.dtype) for n, p in self.policy.named_params}
        with torch.no_grad():
            return torch.func.functional_call(self._module, weights, (x, t, cond, uncond_cond, guidance))

    def update(self, decay: float) -> None:
        self.average.update(self.policy.named_params, decay)


def ema_anchor(policy: Policy, tc: DraftConfig, checkpointed: dict[str, torch.Tensor]) -> EMAAnchor | None:
    """The run's EMA anchor (None when anchor_beta = 0): the weights of a fresh run, the checkpoint's on resume."""
    if tc.anchor_beta == 0:
        return None
    anchor = EMAAnchor(policy)
    saved = checkpointed_anchor(checkpointed)
    if saved:
        anchor.average.load_state_dict(saved)
    return anchor


# ---------------------------------------------------------------------------------------
# The update
# ---------------------------------------------------------------------------------------


def decoded_images(model, latents: torch.Tensor) -> torch.Tensor:
    """Pixels the scorers see (with grad): the card's decode; a video's middle frame, as image scorers get."""
    from flywheel.video import is_video, middle_frame

    images = model.decode(latents)
    return middle_frame(images) if is_video(images) else images


def draft_update(batch: RolloutBatch, policy: Policy, transformer, optimizer, accelerator, cfg, step: int,
                 reward: DifferentiableReward, anchor: EMAAnchor | None = None) -> dict[str, float]:
    """One DRaFT / ReFL update over this rank's rollouts: minibatches x grad paths, optimizer step(s).

    `transformer` is the trained module as prepared (DDP-wrapped on several ranks); `policy` gives the model, the
    trained parameters and the reference velocity (needed when train.kl_beta > 0); `reward` the differentiable
    scores. Every sample with a finite reward trains, flat groups included (no advantages here). `anchor`, when
    given, adds its term and moves once, at the end.
    """
    tc = cfg.train
    traj = batch.trajectory
    if tc.kl_beta > 0 and policy.ref_velocity is None:
        raise ValueError(f"train.kl_beta={tc.kl_beta} needs the reference model (build_policy(reference=True))")
    g = traj.guidance_scale
    generator = update_generator(cfg.seed, step, accelerator.process_index, stream=DRAW_STREAM)
    grads = GradientSteps(accelerator, transformer, optimizer, policy.named_params, tc, step)
    for m, rows in enumerate(grads.minibatches(len(traj))):
        sub = traj.select(rows)
        cond, uncond = trajectory_conditioning(sub, use_cfg=g != 1.0)

        def velocity(x, t, cond=cond, uncond=uncond):
            return policy.velocity(transformer, x, t, cond, uncond, g)

        # The grad paths' forwards all run before their backwards, so the minibatch is one microstep: its
        # backwards reduce only when it ends an optimizer step's accumulation (DDP decides at the forward).
        with grads.microstep(m, last_of_minibatch=True):
            paths = grad_paths(sub, velocity, tc, generator)
            for i, (x_final, visited, t_mean) in enumerate(paths):
                images = decoded_images(policy.model, x_final)
                total, valid, per_scorer = reward(images, sub.prompts, sub.metadata)
                kl = anchor_term = None
                if policy.ref_velocity is not None:  # built only for kl_beta > 0
                    kl = velocity_distance(visited, lambda x, t: policy.ref_velocity(x, t, cond, uncond, g))
                if anchor is not None:
                    anchor_term = velocity_distance(visited, lambda x, t: anchor.velocity(x, t, cond, uncond, g))
                loss, stats = draft_loss(total, valid, tc.reward_scale, kl, tc.kl_beta, anchor_term, tc.anchor_beta)
                grads.backward(loss / grads.backwards_per_step(len(paths)))
                for name, scores in per_scorer.items():
                    ok = torch.isfinite(scores.detach())
                    if ok.any():  # a scorer that scored no row of this minibatch has no mean to record
                        stats[f"draft/reward/{name}"] = scores.detach()[ok].mean()
                grads.record({**stats, "t/mean": torch.tensor(t_mean)})
        grads.maybe_step(m)
    metrics = grads.metrics()
    if metrics.get("grad_norm") == 0.0 and accelerator.is_main_process:
        print(f"warning: step {step + 1}: the reward's gradient is exactly zero (the optimizer step moved the weights "
              "by weight decay only): the decoded pixels may sit where the decoder clamps them, or the scorers are "
              "saturated", file=sys.stderr, flush=True)
    if anchor is not None:
        decay = EMAAnchor.decay(step + 1, tc)
        anchor.update(decay)
        metrics["anchor/decay"] = decay
    return metrics


# ---------------------------------------------------------------------------------------
# Main: the policy (and its EMA anchor), the rollouts, the differentiable reward, then the shared loop
# ---------------------------------------------------------------------------------------


class Draft(EMAAnchored):
    """DRaFT / ReFL behind the algorithm protocol (flywheel/recipe/algorithm.py): the policy, its optimizer, the
    config, the differentiable reward and the EMA anchor (None when train.anchor_beta = 0), whose tensors are
    the recipe's own. The engine samples the trained weights."""

    build_anchor = staticmethod(ema_anchor)  # EMAAnchored: serving_weights, state_dict, load_state_dict
    trains_on_advantages = False  # every valid sample trains, a flat group's too (the training loop's signal)

    def __init__(self, policy: Policy, optimizer, transformer, cfg, accelerator, reward: DifferentiableReward):
        self.policy, self.optimizer, self.transformer, self.cfg = policy, optimizer, transformer, cfg
        self.accelerator, self.reward = accelerator, reward
        self.anchor = ema_anchor(policy, cfg.train, {})

    def update(self, batch: RolloutBatch, step: int) -> UpdateResult:
        return gradient_result(draft_update(batch, self.policy, self.transformer, self.optimizer, self.accelerator,
                                            self.cfg, step, self.reward, self.anchor))


def main(argv: list[str] | None = None) -> dict:
    cfg = resolve_config(Config, sys.argv[1:] if argv is None else argv, recipe="draft")
    validate_config(cfg)
    run = RecipeRun(cfg, recipe="draft")
    policy, transformer, optimizer = run.trained_policy(reference=cfg.train.kl_beta > 0)
    rollouts = Rollouts(cfg, run.accelerator, policy, run.version, run.trainer_state)
    draft = Draft(policy, optimizer, transformer, cfg, run.accelerator, DifferentiableReward.for_run(cfg, rollouts))
    draft.load_state_dict(run.recipe_tensors)  # the EMA anchor of a resumed run
    return train(run, rollouts, draft)


if __name__ == "__main__":
    run_main(main)
