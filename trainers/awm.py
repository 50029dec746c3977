"""Advantage Weighted Matching (AWM, arXiv 2509.25050): RL with the pretraining loss of a flow-matching model.

    accelerate launch trainers/awm.py                     # the built-in toy task (toy-digits)
    python trainers/awm.py --config configs/toy_numbers_awm.yaml
    python trainers/awm.py model.finetune=lora train.learning_rate=1e-3

AWM trains on the policy's own clean samples x0 with the loss the model was
pretrained with, conditional flow matching, weighted by each sample's group
advantage A. The rollouts need no log-probabilities (any sampler, ODE included).

Per rollout step, for each sample (x0, c, A) and each of K flow times t drawn
for it (stratified, see `draw_times`), with fresh noise eps ~ N(0, I):

    x_t = (1 - t)·x0 + t·eps                      rectified flow, t = 1 is noise
    l   = mean over elements |v_theta(x_t, t, c) - (eps - x0)|^2     matching error
    L   = A·w(l, t)                                advantage-weighted matching
        + kl_beta     · mean |v_theta - v_ref|^2      velocity MSE to the reference (base) policy
        + anchor_beta · mean |v_theta - v_ema|^2      velocity MSE to an EMA of the trained weights

averaged over every sample of a minibatch, flat groups included, as the released
code (`loss_average=usable`: over usable samples), then over the K times. w is
"uniform" (l itself) or "ghuber", t/p·((l + d)^p - d^p), the released choice.

Where the numbers come from: the paper's text could not be read from here, so no
equation numbers are quoted; every formula and default was read from the authors'
code (github.com/scxue/advantage_weighted_matching: scripts/train_sd3_awm.py,
config/dgx_awm.py, README.md "Key Parameters").

Deviations from that code, each on purpose:
- A·w(l, t) instead of the PPO surrogate -A·exp(lp - lp_old) at clip range 1: the
  same gradient with one optimizer step per rollout; no ratio clip is offered.
- ODE rollouts by default (the code: SA-Solver at noise 0.4, which the engine lacks;
  sampling.sampler=sde sampling.noise_level=0.4 gives Flow-SDE instead).
- "schedule" times per minibatch, "uniform" times per row, as the code's modes;
  strata cut with integers, (i·span) // K.
- The KL "ELBO" weighting is left out (every released config uses "Uniform").
- The anchor moves once per rollout step (the code: per epoch; the same with one
  optimizer step per rollout).
- Times come from a generator seeded by (run seed, step, rank).
- The code's evaluation EMA is every recipe's ema.enabled (off by default; the
  code's: ema.enabled=true ema.decay=0.99 ema.update_every=1).
- Async rollouts are refused: the loss has no correction for older weights.

Usage, the deviations in full, logged metrics and the measured runs:
docs/recipes/awm.md; the toy default's length: docs/tuning_awm.md.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Literal

import flywheel.quiet_interrupt  # first: run as a script, a Ctrl-C while torch loads is one line, no traceback
flywheel.quiet_interrupt.install(__name__)
import flywheel.openmp_env  # noqa: F401  before torch: OpenMP's idle threads sleep unless the user chose
import torch

from engine import Trajectory
from flywheel.cli import run_main
from flywheel.rollout_collector import RolloutBatch
from flywheel.recipe.algorithm import UpdateResult, gradient_result
from flywheel.recipe.ema import (ANCHOR_PREFIX, EMAAnchored, WeightEMA,  # noqa: F401 (ANCHOR_PREFIX: its names)
                                 checkpointed_anchor)
from flywheel.recipe.flow_matching import matching_error, noised, velocity_mse
from flywheel.recipe.rollouts import check_layout_options
from flywheel.recipe.policy import Policy
from flywheel.recipe.preflight import check_anchor_lags, fsdp_requested
from flywheel.recipe.rollouts import Rollouts
from flywheel.config.parsing import resolve_config
from flywheel.config.sections import AdvantageConfig, OptimConfig, RunConfig, SamplingConfig
from flywheel.config.validation import ABOVE_ZERO, check_shared_sections, check_switched_keys
from flywheel.recipe.session import RecipeRun
from flywheel.recipe.training_loop import train
from flywheel.recipe.update import GradientSteps, trajectory_conditioning, update_generator

# Keeps (l + d)^p differentiable at l = 0 (the code's 1e-10).
HUBER_DELTA = 1e-10
# The stream of update_generator for AWM's flow times and noise: its draws never equal another
# user's of the same (seed, step, rank), such as a rollout's starting noise.
DRAW_STREAM = 0x41574D  # "AWM"
# The EMA anchor's tensors in a checkpoint (beside the trained weights, see RecipeRun.save).


# ---------------------------------------------------------------------------------------
# Config: the algorithm's own keys (the optimizer and batching keys come from OptimConfig)
# ---------------------------------------------------------------------------------------


@dataclass
class AWMConfig(OptimConfig):
    timesteps_per_sample: int = 6
    """flow times K drawn for each sample at each step, one per stratum (the paper's code: train_timesteps = 6)"""
    time_sampling: Literal["schedule", "uniform"] = "schedule"
    """"schedule": one of the rollout schedule's own times from each of K equal strata of its steps (the code's
    discrete_wo_init); "uniform": one t from each of K equal strata of [uniform_t_min, 1], then time-shifted"""
    timestep_fraction: float = 0.9
    """schedule sampling: the strata cover step indices below int(fraction·T) of a T-step rollout"""
    skip_first_step: bool = True
    """schedule sampling: leave out step 0 (t = 1, pure noise) as the GenEval and OCR configs; false keeps it
    (the PickScore config)"""
    uniform_t_min: float = 0.2
    """uniform sampling: lower end of t before the shift (the code's 0.2)"""
    time_shift: float = 1.0
    """uniform sampling: SD3 shift s·t / (1 + (s - 1)·t) of the drawn times (the code uses the model's 3.0)"""
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"
    """w(l, t) of a row's matching error l: l, t·l, t²·l, t·(sqrt(l + d) - sqrt(d)), or t/p·((l + d)^p - d^p)"""
    ghuber_power: float = 0.25
    """power p of the "ghuber" weighting (1 is t·l; smaller trusts the large errors less)"""
    advantage_max: float | None = 1.0
    """advantages, already clipped to ±advantage.clip_max, are rescaled to ±advantage_max as the code does
    (A·advantage_max/advantage.clip_max); null keeps them as they are"""
    kl_beta: float = 0.003
    """weight of the velocity MSE to the reference (base) policy (0 = off, and no reference is built; the code:
    GenEval 0.001, OCR 0.003, PickScore 1e-4)"""
    anchor_beta: float = 1.0
    """weight of the velocity MSE to an EMA of the trained weights, the code's "KL-EMA" (0 = off)"""
    anchor_decay: float = 0.3
    """EMA anchor: ceiling of the decay (EMA <- decay·EMA + (1 - decay)·weights after each step)"""
    anchor_decay_ramp: float = 0.001
    """EMA anchor: the decay is min(anchor_decay, anchor_decay_ramp·steps done), the code's linear warm-up"""
    loss_average: Literal["all", "usable"] = "all"
    """the rows a minibatch's loss averages over: "all" (the code's: flat groups, A = 0, add only to the KL and
    anchor terms) or "usable" (rows whose group has a spread of rewards: a stronger policy term when many groups
    are flat)"""
    cfg_in_train: bool = False
    """train the guided velocity v_u + g·(v_c - v_u) when rollouts used guidance (the code's train.cfg = False:
    the conditional velocity is the one pretraining fitted)"""


@dataclass
class Config(RunConfig):
    run_dir: str = "runs/awm-toy"
    """where config, metrics, samples and checkpoints go"""
    steps: int = 35
    """training steps (rollout + update); 35: reward past 0.95 with typicality at its best and the seeds of a
    prompt still apart (docs/recipes/awm.md#defaults-and-reward-hacking)"""
    # AWM trains on clean samples, not on per-step log-probabilities: the deterministic sampler will do.
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(sampler="ode"))
    train: AWMConfig = field(default_factory=AWMConfig)
    advantage: AdvantageConfig = field(default_factory=lambda: AdvantageConfig(global_std=True))
    """advantages normalised by the std of all the step's rewards, not each group's (the code's
    sample.global_std, true in every released config)"""


# ---------------------------------------------------------------------------------------
# Config checks
# ---------------------------------------------------------------------------------------


# AWM's keys that act only when their switch is on (check_switched_keys): set away from the default
# with the switch off, they would be ignored.
AWM_SWITCHED_KEYS = (
    ("train.time_sampling", "schedule", ("train.timestep_fraction", "train.skip_first_step")),
    ("train.time_sampling", "uniform", ("train.uniform_t_min", "train.time_shift")),
    ("train.weighting", "ghuber", ("train.ghuber_power",)),
    ("train.anchor_beta", ABOVE_ZERO, ("train.anchor_decay", "train.anchor_decay_ramp")),  # 0: no EMA anchor
)


def validate_config(cfg: Config) -> None:
    """Check every field before anything runs: one ConfigError listing each bad key and what is valid."""
    checks = check_shared_sections(cfg)
    check_switched_keys(cfg, checks, AWM_SWITCHED_KEYS)
    check_layout_options(cfg, checks)  # async, Ray, workflow: the table of what combines
    tc = cfg.train
    if fsdp_requested() and tc.anchor_beta > 0:
        # The anchor's forward swaps whole EMA tensors into the trained parameters, which FSDP holds as shards.
        checks.fail(f"train.anchor_beta={tc.anchor_beta} with an FSDP launch: the EMA anchor swaps whole weights "
                    "into the trained module, which FSDP shards; set train.anchor_beta=0, or launch with DDP "
                    "(or one process)")
    checks.require("train.timesteps_per_sample", lambda v: v >= 1, "must be an integer >= 1")
    checks.require("train.timestep_fraction", lambda v: 0 < v <= 1, "must be in (0, 1]")
    checks.require("train.uniform_t_min", lambda v: 0 <= v < 1, "must be in [0, 1)")
    checks.require("train.time_shift", lambda v: 0 < v <= 100, "must be in (0, 100] (1 = no shift)")
    checks.require("train.ghuber_power", lambda v: v > 0, "must be > 0 (1 is the t weighting)")
    checks.require("train.advantage_max", lambda v: v > 0, "must be > 0, or null to keep the advantages",
                   allow_none=True)
    for key in ("train.kl_beta", "train.anchor_beta", "train.anchor_decay_ramp"):
        checks.require(key, lambda v: v >= 0, "must be >= 0 (0 = off)")
    checks.require("train.anchor_decay", lambda v: 0 <= v < 1, "must be in [0, 1)")
    check_anchor_lags(cfg, checks)
    if (tc.time_sampling == "schedule" and cfg.sampling.steps >= 1 and tc.timesteps_per_sample >= 1
            and 0 < tc.timestep_fraction <= 1):  # a fraction out of range is reported above, not planned with
        try:
            schedule_strata(cfg.sampling.steps, tc.timesteps_per_sample, tc.timestep_fraction, tc.skip_first_step)
        except ValueError as e:
            checks.fail(f"{e} (sampling.steps={cfg.sampling.steps})")
    if cfg.rollout.asynchronous:
        checks.fail("rollout.asynchronous=true: AWM trains on-policy (its loss has no correction for rollouts made by "
                    "older weights); set rollout.asynchronous=false")
    checks.raise_if_any()


# ---------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------


def weighted_error(error: torch.Tensor, t: torch.Tensor, weighting: str, ghuber_power: float = 0.25) -> torch.Tensor:
    """w(l, t) per row: how the matching error enters the loss. `t` is [N] or a scalar."""
    t = torch.as_tensor(t, dtype=error.dtype, device=error.device)
    if weighting == "uniform":
        return error
    if weighting == "t":
        return t * error
    if weighting == "t2":
        return t * t * error
    if weighting == "huber":
        return t * (torch.sqrt(error + HUBER_DELTA) - math.sqrt(HUBER_DELTA))
    if weighting == "ghuber":
        p = ghuber_power
        return t / p * ((error + HUBER_DELTA) ** p - HUBER_DELTA**p)
    raise ValueError(f"unknown AWM weighting {weighting!r}: use one of uniform, t, t2, huber, ghuber")


def awm_loss(v_theta: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor | float,
             advantages: torch.Tensor, v_ref: torch.Tensor | None = None, *, usable: torch.Tensor | None = None,
             weighting: str = "ghuber", ghuber_power: float = 0.25, kl_beta: float = 0.0,
             v_anchor: torch.Tensor | None = None, anchor_beta: float = 0.0, average: str = "all"
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AWM loss of N rows: the mean of A·w(l, t) + kl_beta·|v - v_ref|² + anchor_beta·|v - v_anchor|².

    v_theta, x0, noise [N, ...] (the velocity at x_t = (1 - t)·x0 + t·noise);
    t [N] or a scalar; advantages [N]; usable [N] bool (None = every row).
    v_ref / v_anchor: the reference's and the EMA anchor's velocities at the
    same x_t (no gradient flows into them); each term is measured when given
    and added with its beta. `average` "all" takes the mean over every row
    (an unusable row's advantage is 0 by then, so it adds only to the
    regularisers), "usable" over the usable rows only (a minibatch with no
    usable row then has loss 0). The matching-error stats are over usable rows.
    """
    if average not in ("all", "usable"):
        raise ValueError(f"AWM loss average {average!r} is not known: use all or usable")
    n = v_theta.shape[0]
    mask = torch.ones(n, device=v_theta.device) if usable is None else usable.float().to(v_theta.device)
    usable_weight = mask / mask.sum().clamp(min=1.0)
    row_weight = usable_weight if average == "usable" else torch.full((n,), 1.0 / max(n, 1), device=v_theta.device)
    error = matching_error(v_theta, x0, noise)
    weighted = weighted_error(error, t, weighting, ghuber_power)
    # An unusable row has no training signal of its own, whatever advantage it was handed.
    adv = advantages.float().to(v_theta.device) * mask
    policy = (adv * weighted * row_weight).sum()
    loss = policy
    zero = torch.zeros((), device=v_theta.device)
    kl, anchor = zero, zero
    if v_ref is not None:
        kl = (velocity_mse(v_theta, v_ref) * row_weight).sum()
        loss = loss + kl_beta * kl
    if v_anchor is not None:
        anchor = (velocity_mse(v_theta, v_anchor) * row_weight).sum()
        loss = loss + anchor_beta * anchor
    detached = error.detach()
    positive, negative = mask * (adv > 0).float(), mask * (adv < 0).float()
    stats = {
        "loss": loss.detach(),
        "policy_loss": policy.detach(),
        "matching_error": (detached * usable_weight).sum(),
        # AWM lowers the error of better-than-average samples and raises the others': the gap is the signal.
        "matching_error/positive": (detached * positive).sum() / positive.sum().clamp(min=1.0),
        "matching_error/negative": (detached * negative).sum() / negative.sum().clamp(min=1.0),
    }
    # Only what was measured: without a reference (or an anchor) there is no distance to log, not a 0.
    if v_ref is not None:
        stats["ref_mse"] = kl.detach()  # a velocity MSE, not a KL: its own key (GRPO's "kl" is a Gaussian KL)
    if v_anchor is not None:
        stats["anchor_mse"] = anchor.detach()
    return loss, stats


# ---------------------------------------------------------------------------------------
# Flow times and noise of one step
# ---------------------------------------------------------------------------------------


def draw_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The CPU generator of a step's flow times and noise: the same (seed, step, rank) draws the same numbers."""
    return update_generator(seed, step, rank, stream=DRAW_STREAM)


def schedule_strata(num_steps: int, k: int, fraction: float, skip_first: bool) -> list[tuple[int, int]]:
    """[lower, upper) step-index ranges of the K schedule strata, splitting [start, int(fraction·T)) evenly."""
    start, end = (1 if skip_first else 0), int(fraction * num_steps)
    span = end - start
    if span < k:
        raise ValueError(f"train.timesteps_per_sample={k} needs at least {k} eligible steps, but a {num_steps}-step "
                         f"rollout with train.timestep_fraction={fraction} and train.skip_first_step={skip_first} has "
                         f"{max(span, 0)} (step indices {start}..{end - 1}): lower timesteps_per_sample, raise "
                         f"timestep_fraction or sampling.steps, or use train.time_sampling=uniform")
    bounds = [start + (i * span) // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def draw_times(timesteps: torch.Tensor, tc: AWMConfig, generator: torch.Generator, rows: int = 1) -> torch.Tensor:
    """A minibatch's K flow times (fp32, CPU), one from each stratum: [K] shared by its rows, or [K, rows].

    "schedule" ([K]): index lower + floor(u·(upper - lower)) of each stratum of
    the rollout's steps, and that step's time `timesteps[index]`;
    "uniform" ([K, rows], the code's per-row draw): for each row and stratum k,
    t = t_min + (k + u)/K·(1 - t_min); each row's K times are then put in a
    random order of their own (the code's argsort shuffle), and shifted:
    s·t / (1 + (s - 1)·t).
    """
    k = tc.timesteps_per_sample
    if tc.time_sampling == "schedule":
        u = torch.rand(k, generator=generator, dtype=torch.float64)
        strata = schedule_strata(len(timesteps) - 1, k, tc.timestep_fraction, tc.skip_first_step)
        index = [lo + int(math.floor(float(u[i]) * (hi - lo))) for i, (lo, hi) in enumerate(strata)]
        return timesteps.detach().float().cpu()[index]
    if tc.time_sampling == "uniform":
        u = torch.rand((k, rows), generator=generator, dtype=torch.float64)
        t = tc.uniform_t_min + (torch.arange(k, dtype=torch.float64)[:, None] + u) / k * (1.0 - tc.uniform_t_min)
        order = torch.rand((k, rows), generator=generator, dtype=torch.float64).argsort(dim=0)
        t = torch.gather(t, 0, order)
        s = tc.time_shift
        return (s * t / (1 + (s - 1) * t)).float()
    raise ValueError(f"train.time_sampling={tc.time_sampling!r}: use schedule or uniform")


def draw_minibatch(timesteps: torch.Tensor, rows: int, latent_shape: tuple[int, ...], tc: AWMConfig,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(times [K] or [K, rows], noise [K, rows, *latent]) of one minibatch, on the CPU: times first, then noise."""
    times = draw_times(timesteps, tc, generator, rows)
    noise = torch.randn((tc.timesteps_per_sample, rows, *latent_shape), generator=generator)
    return times, noise


# ---------------------------------------------------------------------------------------
# The EMA anchor
# ---------------------------------------------------------------------------------------


class EMAAnchor:
    """An exponential moving average of the trained weights, the policy the anchor term pulls toward.

    The average itself (update, state, strict loading; float32) is the shared
    `WeightEMA`, the one ema.enabled uses; the anchor adds its own decay schedule
    and its velocity: the trained module's with the EMA values swapped in for
    one no-grad forward (`Policy.weights_swapped`), so neither LoRA nor full
    fine-tuning keeps a second copy of the model (so an FSDP launch refuses it:
    the parameters are shards there). Its tensors are checkpointed for an exact resume.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]]):
        self.average = WeightEMA(named_params, what="EMA anchor")

    @property
    def shadow(self) -> dict[str, torch.Tensor]:
        return self.average.shadow

    @staticmethod
    def decay(steps_done: int, tc: AWMConfig) -> float:
        """min(anchor_decay, anchor_decay_ramp·steps_done): 0 at first, so the anchor starts at the weights."""
        return min(tc.anchor_decay, tc.anchor_decay_ramp * steps_done)

    def update(self, named_params, decay: float) -> None:
        """EMA <- decay·EMA + (1 - decay)·weights."""
        self.average.update(named_params, decay)

    def velocity(self, policy: Policy, x, t, cond, uncond_cond, guidance: float) -> torch.Tensor:
        """The (guided) velocity of the EMA weights at x, t; the trained weights are back, bit for bit, after."""
        with torch.no_grad(), policy.weights_swapped(self.shadow):
            return policy.velocity(policy.transformer, x, t, cond, uncond_cond, guidance)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.average.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Strict: the same names and shapes as the trained parameters."""
        self.average.load_state_dict(state)


def ema_anchor(policy: Policy, tc: AWMConfig, checkpointed: dict[str, torch.Tensor]) -> EMAAnchor | None:
    """The run's EMA anchor (None when train.anchor_beta = 0): the trained weights at the start of a fresh run,
    the checkpoint's EMA on resume (`checkpointed` is `RecipeRun.recipe_tensors`)."""
    if tc.anchor_beta == 0:
        return None
    anchor = EMAAnchor(policy.named_params)
    saved = checkpointed_anchor(checkpointed)
    if saved:
        anchor.load_state_dict(saved)
    return anchor


# ---------------------------------------------------------------------------------------
# The update
# ---------------------------------------------------------------------------------------


def scaled_advantages(advantages: torch.Tensor, tc: AWMConfig, clip_max: float) -> torch.Tensor:
    """The code's rescale A·advantage_max/clip_max (advantages arrive clipped to ±advantage.clip_max)."""
    if tc.advantage_max is None:
        return advantages
    return advantages * (tc.advantage_max / clip_max)


class AWM(EMAAnchored):
    """AWM's update behind the algorithm protocol (flywheel/recipe/algorithm.py): the policy, its optimizer, the
    config and the EMA anchor (None when train.anchor_beta = 0), whose tensors are the recipe's own.

    `transformer` is the trained module as prepared (DDP-wrapped on several ranks); `policy` gives the model,
    the trained parameters and the reference velocity (None: no KL term, nothing measured). `cfg.seed` and
    `cfg.train` are read. The anchor starts at the weights as they are; `load_state_dict` gives it a
    checkpoint's.
    """

    build_anchor = staticmethod(ema_anchor)  # EMAAnchored: serving_weights, state_dict, load_state_dict

    def __init__(self, policy: Policy, optimizer, transformer, cfg, accelerator):
        self.policy, self.optimizer, self.transformer, self.cfg = policy, optimizer, transformer, cfg
        self.accelerator = accelerator
        self.anchor = ema_anchor(policy, cfg.train, {})

    def update(self, batch: RolloutBatch, step: int) -> UpdateResult:
        """One AWM update over this rank's rollouts: minibatches x K flow times, optimizer step(s); the anchor
        (when on) adds its term with train.anchor_beta and moves once, at the end."""
        cfg, tc, policy, anchor = self.cfg, self.cfg.train, self.policy, self.anchor
        traj: Trajectory = batch.trajectory
        x0_all = traj.latents[:, -1].float()
        k = tc.timesteps_per_sample
        generator = draw_generator(cfg.seed, step, self.accelerator.process_index)
        grads = GradientSteps(self.accelerator, self.transformer, self.optimizer, policy.named_params, tc, step)
        for m, rows in enumerate(grads.minibatches(len(traj))):
            x0 = x0_all[rows]
            adv = scaled_advantages(batch.advantages[rows], tc, cfg.advantage.clip_max)
            cond, uncond_cond = trajectory_conditioning(traj.select(rows), tc.cfg_in_train)
            times, noise = draw_minibatch(traj.timesteps, len(rows), tuple(x0.shape[1:]), tc, generator)
            for i in range(k):
                # "schedule": one t for the minibatch's rows; "uniform": one per row.
                t, eps = times[i].to(x0.device), noise[i].to(x0.device)
                x_t = noised(x0, eps, t)
                with torch.no_grad():
                    v_ref = (None if policy.ref_velocity is None
                             else policy.ref_velocity(x_t, t, cond, uncond_cond, traj.guidance_scale))
                    v_anchor = (None if anchor is None
                                else anchor.velocity(policy, x_t, t, cond, uncond_cond, traj.guidance_scale))
                with grads.microstep(m, last_of_minibatch=i == k - 1):
                    v = policy.velocity(self.transformer, x_t, t, cond, uncond_cond, traj.guidance_scale)
                    loss, stats = awm_loss(v, x0, eps, t, adv, v_ref, usable=batch.usable[rows],
                                           weighting=tc.weighting, ghuber_power=tc.ghuber_power, kl_beta=tc.kl_beta,
                                           v_anchor=v_anchor, anchor_beta=tc.anchor_beta, average=tc.loss_average)
                    grads.backward(loss / grads.backwards_per_step(k))
                grads.record({**stats, "t/mean": t.float().mean()})
            grads.maybe_step(m)
        metrics = grads.metrics()
        if anchor is not None:
            decay = EMAAnchor.decay(step + 1, tc)
            anchor.update(policy.named_params, decay)
            metrics["anchor/decay"] = decay
        return gradient_result(metrics)


# ---------------------------------------------------------------------------------------
# Main: the policy, the algorithm and its EMA anchor, the rollouts, then the training loop
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    cfg = resolve_config(Config, sys.argv[1:] if argv is None else argv, recipe="awm")
    validate_config(cfg)
    run = RecipeRun(cfg, recipe="awm")
    policy, transformer, optimizer = run.trained_policy(reference=cfg.train.kl_beta > 0)
    awm = AWM(policy, optimizer, transformer, cfg, run.accelerator)
    awm.load_state_dict(run.recipe_tensors)  # the EMA anchor of a resumed run
    rollouts = Rollouts(cfg, run.accelerator, policy, run.version, run.trainer_state)
    return train(run, rollouts, awm)


if __name__ == "__main__":
    run_main(main)
