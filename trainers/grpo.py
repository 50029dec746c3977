"""Flow-GRPO (arXiv 2505.05470): group-relative policy optimisation of a flow-matching model.

    accelerate launch trainers/grpo.py                     # the built-in toy task
    python trainers/grpo.py model.finetune=lora reward.scorers=digit_alignment:1.0,jpeg_compressibility:0.1
    python trainers/grpo.py train.variant=mixgrpo          # or fast; train.guard=true; train.flash_compress=0.4

Each step: G samples for each of P prompts with the Flow-SDE sampler (per-step
log-probs recorded), rewards, advantages normalised within each prompt's group
over all ranks, then a PPO-clip update on the per-step probability ratios, with
an optional KL penalty to the reference policy; every optimizer step syncs the
new weights into the engine and bumps the version. The file reads top to
bottom: config, the loss, the windows, setup, the loop, save.

The loss (Eq. 8), per sample and trained step, r = pi_theta / pi_old:
    loss = max(-A·r, -A·clip(r, 1 - eps, 1 + eps)) + beta·KL(pi_theta || pi_ref)
averaged over the usable samples; the Flow-SDE transition is Eq. 9. KL "exact"
(default) is the Gaussian KL |mu - mu_ref|^2 / (2 std^2); "flow_grpo" is the
released code's, the exact KL times |dt| (its issue #78). Async rollouts use
decoupled PPO (AReaL, arXiv 2505.24298): the ratio against the update's
proximal log-probs is clipped, a truncated importance weight corrects the lag.
Trained steps: null trains the first int(0.99·T) stochastic steps, as the
released timestep_fraction 0.99 (9 of 10); an explicit fraction trains
round(f·T) random steps or the first int(f·T).

Options (train.*), each independent of the others:
- variant=mixgrpo (MixGRPO, arXiv 2507.21802; facts from the authors' code, the
  paper's text was not readable here): ODE rollouts with an SDE window of w = 4
  steps, the only ones trained, moving by s = 1 every tau = 25 training steps and
  restarting at step 0. Deviations: the window is always w steps (the code's
  shrinks near the end); population std + 1e-4 instead of torch's unbiased
  .std() + 1e-8 (advantages sqrt(G/(G-1)) times the code's).
- flash_compress=f (MixGRPO-Flash): the ODE steps after the window run
  DPM-Solver++(2M) over max(1, int(n·f)) of the n steps left, through the
  schedule's own points (the code keeps one fewer). Rollouts only.
- variant=fast (Flow-GRPO-Fast, flow_grpo's *_fast pipelines): a random window of
  w steps in the first half, ODE elsewhere; drawn per trajectory (the code: per
  sampling call; train.window_per=step: per training step).
- guard=true (GRPO-Guard, arXiv 2510.22319; formulas from public descriptions of
  the release, see `grpo_step_loss`): the log-ratio re-centred and scaled per step
  (RatioNorm), each step's term divided by |dt|; mu_old is recomputed, not stored.

Every window is a function of (config, seed, step) alone, so async prefetching and
resume draw the same ones. Flash is refused with async rollouts.

Usage, every equation and deviation in full, logged metrics, the measured runs
and Flow-GRPO's published settings (configs/sd3_pickscore.yaml): docs/recipes/grpo.md;
the sweep behind the toy default: docs/tuning_grpo.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import flywheel.quiet_interrupt  # first: run as a script, a Ctrl-C while torch loads is one line, no traceback
flywheel.quiet_interrupt.install(__name__)
import flywheel.openmp_env  # noqa: F401  before torch: OpenMP's idle threads sleep unless the user chose
import torch

from engine import Trajectory
from engine.denoise import guided_velocity
from engine.sampling import gaussian_kl, sde_t_cap, step_log_prob, transition_std
from flywheel.cli import run_main
from flywheel.rollout_collector import RolloutBatch
from flywheel.recipe.algorithm import ServesTrainedWeights, UpdateResult, gradient_result
from flywheel.recipe.dppo import dppo_loss
from flywheel.recipe.rollouts import check_layout_options
from flywheel.recipe.policy import Policy
from flywheel.recipe.preflight import fsdp_requested, optimizer_steps_per_update
from flywheel.recipe.rollouts import Rollouts, cpu_core_sharing
from flywheel.config.parsing import resolve_config
from flywheel.config.sections import OptimConfig, RunConfig, SamplingConfig
from flywheel.config.validation import (ANY_VALUE, card_flag, check_shared_sections, check_switched_keys,
                                        set_away_from_default)
from flywheel.recipe.session import RecipeRun
from flywheel.recipe.training_loop import train
from flywheel.recipe.update import GradientSteps, trajectory_conditioning, update_generator

# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


@dataclass
class GRPOConfig(OptimConfig):
    learning_rate: float = 6e-4
    """AdamW learning rate (toy-digits sweep: docs/tuning_grpo.md)"""
    clip_range: float = 1e-4
    """PPO clip range on the per-step probability ratio"""
    kl_beta: float = 0.1
    """weight of the KL penalty to the reference policy (0 = off); 0.1 keeps the toy default from gaming its
    reward (docs/tuning_grpo.md)"""
    kl_form: Literal["exact", "flow_grpo"] = "exact"
    """KL per step: "exact" Gaussian KL |mu - mu_ref|^2 / (2 std^2), or Flow-GRPO's, which leaves |dt| out of the
    variance (the exact KL times |dt|: the same kl_beta is 1/|dt| times weaker); flow_grpo needs sampler=sde"""
    log_kl: bool = True
    """measure the KL to the reference even when kl_beta = 0 (one extra no-grad forward per step)"""
    importance_cap: float = 2.0
    """async rollouts: truncation of the importance weight pi_current / pi_rollout"""
    timestep_fraction: float | None = None
    """fraction of the stochastic steps trained each step; null = the released code's: Flow-GRPO's 0.99 with
    timestep_selection=first for variant=flow_grpo (the first int(0.99·n) = n - 1 of n steps: 9 of 10, the last
    one untrained), every window step for mixgrpo and fast"""
    timestep_selection: Literal["random", "first"] = "random"
    """which steps an explicit `timestep_fraction` keeps: round(f·n) random ones each step, or the first int(f·n)
    as Flow-GRPO (a null fraction always keeps the first)"""
    cfg_in_train: bool = True
    """apply guidance in the training forward too (when rollouts used it)"""
    variant: Literal["flow_grpo", "mixgrpo", "fast"] = "flow_grpo"
    """which steps are stochastic, hence trained: "flow_grpo" those of sampling.sde_window (default every step);
    "mixgrpo" a window of window_size steps that slides over the schedule as training proceeds (MixGRPO);
    "fast" a window of window_size steps at a random position per trajectory (Flow-GRPO-Fast); ODE elsewhere"""
    window_size: int | None = None
    """mixgrpo / fast: stochastic (trained) steps per rollout, w; null = the variant's released value: 4 for
    mixgrpo (its scripts: 4 of 25 steps), 2 for fast (Flow-GRPO-Fast's configs: 2, some 3)"""
    window_shift_every: int = 25
    """mixgrpo: training steps between two moves of the window, the shift interval tau (released: 25)"""
    window_stride: int = 1
    """mixgrpo: steps the window moves each time, s (released: 1)"""
    window_end: Literal["restart", "stay"] = "restart"
    """mixgrpo: once the window has reached the last steps, start again at step 0 ("restart", the released
    scripts' --roll_back) or stay there ("stay", start = min(s·floor(step/tau), T - w))"""
    window_range: tuple[int, int] | None = None
    """fast: [lo, hi) of the steps the random window lies in; null = the first half, (0, T // 2), as
    Flow-GRPO-Fast's sde_window_range"""
    window_per: Literal["trajectory", "step"] = "trajectory"
    """fast: draw a window for every trajectory ("trajectory": the rows of one window run as one engine batch)
    or one window per training step shared by all its trajectories ("step": one batch, fewer forwards)"""
    flash_compress: float | None = None
    """MixGRPO-Flash: the ODE steps after the SDE window run DPM-Solver++(2M) through max(1, int(n·f)) of their n
    steps (its released Flash scripts: f = 0.4, Flash*: 0.2); null = Euler on every step (evaluation never changes)"""
    guard: bool = False
    """GRPO-Guard (arXiv 2510.22319): ratio normalisation (the per-step bias and scale of the log-ratio removed)
    and 1/|dt| gradient reweighting of each step's policy term; its ratios are small: use a smaller clip_range"""
    policy_loss: Literal["clip", "dppo"] = "clip"
    """"clip": PPO's ratio clip (clip_range); "dppo": Flow-DPPO (arXiv 2606.11025, flywheel/recipe/dppo.py), no
    clip: a sample-step's gradient is dropped once its exact Gaussian KL to the behaviour policy passes
    dppo_kl_threshold in the direction of its advantage (acts only when an update takes several optimizer steps)"""
    dppo_kl_threshold: float = 1e-5
    """policy_loss=dppo: the trust region's bound on the per-step KL (mean over the latent's elements) to the
    behaviour policy (verl-omni's default kl_mask_threshold; Flow-Factory's is 1e-6)"""


@dataclass
class Config(RunConfig):
    run_dir: str = "runs/grpo-toy"
    """where config, metrics, samples and checkpoints go"""
    steps: int = 70
    """training steps (rollout + update)"""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """the rollout sampler (Flow-SDE by default) and the evaluation samples"""
    train: GRPOConfig = field(default_factory=GRPOConfig)
    """the optimizer and the GRPO loss"""


# ---------------------------------------------------------------------------------------
# The GRPO loss of one denoising step
# ---------------------------------------------------------------------------------------


def step_level(traj: Trajectory, j: int) -> torch.Tensor:
    """Step j's noise level, shared by the rows of `traj` (the rows trained together at a step share it)."""
    level = traj.levels_at(j)
    if level.dim() == 0:
        return level
    if not bool((level == level[0]).all()):
        raise ValueError(f"the rows of this batch have different noise levels at step {j}: train together only "
                         f"rows that share it (trained_mask selects them)")
    return level[0]


def step_policy(model, transformer, traj: Trajectory, j: int, use_cfg: bool):
    """Step j of a trajectory batch under `transformer`: (log_prob [B], mean, std, cond, uncond_cond)."""
    x, x_next = traj.latents[:, j], traj.latents[:, j + 1]
    t, t_next = traj.timesteps[j], traj.timesteps[j + 1]
    cond, uncond_cond = trajectory_conditioning(traj, use_cfg)
    v = guided_velocity(model, transformer, x, t, cond, uncond_cond, traj.guidance_scale)
    log_prob, mean, std = step_log_prob(traj.sampler, x, x_next, v, t, t_next, step_level(traj, j),
                                        sde_t_cap(traj.timesteps))
    return log_prob, mean, std, cond, uncond_cond


def grpo_step_loss(model, transformer, ref_velocity, traj: Trajectory, j: int, advantages: torch.Tensor,
                   usable: torch.Tensor, cfg: GRPOConfig, proximal: torch.Tensor | None = None,
                   old_mean: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                   decoupled: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss (+ beta·KL) of stochastic step j of a trajectory batch under the current weights.

    Flow-GRPO (arXiv 2505.05470, Eq. 8): per sample and step, with r = pi_theta / pi_old,
        loss = max(-A·r, -A·clip(r, 1 - eps, 1 + eps)) + beta·KL(pi_theta || pi_ref),
    averaged over the usable samples (those whose group has a spread of rewards). `weight` [B]
    replaces that average's weights (usable / number usable) when rows are weighted otherwise
    (per-trajectory windows: each row's mean over its own trained steps); the stats stay
    averages over the usable rows given.

    `proximal` is for rollouts that lag the trainer (async): decoupled PPO as in
    AReaL (arXiv 2505.24298). The log-probs of step j under the weights at the
    start of this update (computed once, before any optimizer step) are the
    proximal policy: r = pi_theta / pi_prox is clipped, and the truncated
    importance weight min(pi_prox / pi_behaviour, cap) corrects for the lag.
    `decoupled` with `proximal` None: the current weights are the proximal ones
    (no optimizer step of the update yet), so this forward's own log-probs,
    detached, are pi_prox: the values a separate no-grad pass would give.

    GRPO-Guard (`cfg.guard`, arXiv 2510.22319). Both policies of the ratio are
    Gaussians with the step's std s (s = sigma_t·sqrt(|dt|) for Flow-SDE), so with
    x_next = mu_old + s·eps and D = mu_theta - mu_old (means over elements)
        log r = -mean(D²)/(2s²) + mean(eps·D)/s:
    a negative shift that grows as s shrinks (the ratio's mean below 1 that keeps
    positive-advantage samples out of the clip) and a spread of order |D|/s that
    differs from step to step. RatioNorm adds the shift back and scales by s,
        r_guard = exp(s·(log r + mean(D²)/(2s²))) = exp(mean(eps·D)),
    a ratio centred on 1 with the same spread at every step; the PPO-clip term of
    step j is then divided by |dt_j| (gradient reweighting: D is proportional to
    dt, so each step's gradient no longer scales with its step size). mu_old is
    `old_mean` (the means under the weights that sampled, or the proximal ones);
    None means those weights are the current ones (the first optimizer step of an
    on-policy update), where D's value and gradient are both 0. The KL term is not
    reweighted.

    KL of two Gaussians with the same std: |mu - mu_ref|^2 / (2 std^2) per element
    ("exact"), or Flow-GRPO's form, which divides by 2 sigma_t^2 where the
    transition's variance is sigma_t^2·|dt| (its issue #78): the exact KL times |dt|.

    Flow-DPPO (`cfg.policy_loss == "dppo"`, flywheel/recipe/dppo.py): the PPO-clip
    term is replaced by -A·r·M, M dropping a sample once its exact KL to the
    behaviour policy, mean(|mu - mu_old|^2)/(2 s^2), passes `cfg.dppo_kl_threshold`
    in the direction of its advantage. mu_old is `old_mean` as for Guard (None: the
    current means, KL 0, nothing dropped); with async rollouts it and the ratio are
    the proximal policy's, and the importance weight corrects for the lag.
    """
    log_prob, mean, std, cond, uncond_cond = step_policy(model, transformer, traj, j, cfg.cfg_in_train)
    t, t_next = traj.timesteps[j], traj.timesteps[j + 1]
    behaviour = traj.log_probs[:, j]
    if decoupled and proximal is None:
        proximal = log_prob.detach()
    log_ratio = log_prob - (behaviour if proximal is None else proximal)
    guard_shift = torch.zeros_like(log_prob)
    if cfg.guard:
        mean_old = mean.detach() if old_mean is None else old_mean
        guard_shift = ((mean - mean_old) ** 2).flatten(1).mean(1) / (2 * std**2)
        log_ratio = std * (log_ratio + guard_shift)
    ratio = torch.exp(log_ratio)
    if proximal is None:
        is_weight = torch.ones_like(ratio)
    else:
        is_weight = torch.exp(proximal - behaviour).clamp(max=cfg.importance_cap)
    average = usable.float() / usable.float().sum().clamp(min=1.0)
    weight = average if weight is None else weight
    if cfg.policy_loss == "dppo":
        mean_old = mean.detach() if old_mean is None else old_mean
        kl_old = gaussian_kl(mean.detach(), mean_old, std**2)
        loss, keep = dppo_loss(ratio, advantages, kl_old, cfg.dppo_kl_threshold, is_weight * weight)
    else:
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_range, 1.0 + cfg.clip_range)
        loss = (is_weight * torch.maximum(unclipped, clipped) * weight).sum()
    if cfg.guard:
        loss = loss / (t - t_next)

    kl = torch.zeros((), device=log_prob.device)
    if ref_velocity is not None:
        x, x_next = traj.latents[:, j], traj.latents[:, j + 1]
        with torch.no_grad():
            v_ref = ref_velocity(x, t, cond, uncond_cond, traj.guidance_scale)
            _, mean_ref, _ = step_log_prob(traj.sampler, x, x_next, v_ref, t, t_next, step_level(traj, j),
                                           sde_t_cap(traj.timesteps))
        variance = std**2 if cfg.kl_form == "exact" else std**2 / (t - t_next)
        kl_per_sample = gaussian_kl(mean, mean_ref, variance)  # per element for a joint audio+video latent
        kl = (kl_per_sample * weight).sum()
        loss = loss + cfg.kl_beta * kl

    deviation = (ratio.detach() - 1).abs()
    stats = {
        "loss": loss.detach(),
        "ratio/mean": (ratio.detach() * average).sum(),
        # Exactly 0 on the first minibatch of a step: the rollout's (or proximal) weights, recomputed.
        "ratio/max_dev": (deviation * usable).max(),
        # Trainer-vs-rollout log-prob gap: 0 on-policy, the policy's drift when rollouts lag.
        "logprob_gap/max": ((log_prob.detach() - behaviour).abs() * usable).max(),
        "is_weight/mean": (is_weight * average).sum(),
    }
    if cfg.policy_loss == "dppo":  # the fraction of usable samples the mask dropped, and their KL to mu_old
        stats["dppo/masked_frac"] = ((~keep).float() * average).sum()
        stats["dppo/kl_old"] = (kl_old * average).sum()
        stats["dppo/kl_old/max"] = (kl_old * usable).max()
    else:
        stats["clipfrac"] = ((deviation > cfg.clip_range).float() * average).sum()
    if ref_velocity is not None:  # measured (train.kl_beta > 0 or train.log_kl); otherwise no "kl" key, not a 0
        stats["kl"] = kl.detach()
    if cfg.guard:
        stats["guard/shift"] = (guard_shift.detach() * average).sum()
    return loss, stats


def stochastic_mask(traj: Trajectory) -> torch.Tensor:
    """[B, T]: whether each row's step has a transition with a positive std (a log-probability to train)."""
    return transition_std(traj.sampler, traj.timesteps, traj.row_noise_levels) > 0


def stochastic_steps(traj: Trajectory) -> list[int]:
    """The steps stochastic in at least one row: the only ones with a log-probability to train."""
    return stochastic_mask(traj).any(0).nonzero().flatten().tolist()


def trained_mask(traj: Trajectory, steps: list[int]) -> torch.Tensor:
    """[B, T]: the (row, step) pairs an update trains: the chosen steps where the row is stochastic."""
    chosen = torch.zeros(traj.num_steps, dtype=torch.bool)
    chosen[steps] = True
    return stochastic_mask(traj).cpu() & chosen


# Flow-GRPO's train.timestep_fraction (config/grpo.py): it trains the first int(0.99·T) steps of a T-step rollout.
FLOW_GRPO_TIMESTEP_FRACTION = 0.99


def trained_fraction(tc: GRPOConfig) -> tuple[float, str]:
    """(fraction, selection) of the stochastic steps an update trains: train.timestep_fraction and
    train.timestep_selection when the fraction is set; when it is null, the released code's choice: Flow-GRPO's
    first int(0.99·n) for variant=flow_grpo, and the whole window for mixgrpo and fast."""
    if tc.timestep_fraction is not None:
        return tc.timestep_fraction, tc.timestep_selection
    if tc.variant == "flow_grpo":
        return FLOW_GRPO_TIMESTEP_FRACTION, "first"
    return 1.0, "first"


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


# ---------------------------------------------------------------------------------------
# The SDE window of each step: MixGRPO's sliding window, Flow-GRPO-Fast's random one
# ---------------------------------------------------------------------------------------


def window_span(sampler: str, num_steps: int) -> int:
    """How many leading steps a window may cover: all T for Flow-SDE; T - 1 for CPS, whose last step is
    deterministic (std t_next·sin(eta·pi/2) = 0 at t_next = 0) and has no log-probability to train."""
    return num_steps - 1 if sampler == "cps" else num_steps


# train.window_size when null: the released value of each variant.
DEFAULT_WINDOW_SIZE = {"mixgrpo": 4, "fast": 2}


def window_size(tc: GRPOConfig) -> int:
    return tc.window_size if tc.window_size is not None else DEFAULT_WINDOW_SIZE[tc.variant]


def mixgrpo_window(step: int, span: int, tc: GRPOConfig) -> tuple[int, int]:
    """MixGRPO's window [start, start + w) at training step `step` (0-based), over steps [0, span).

    The window moves by the stride s every tau steps: start = s·floor(step/tau).
    Past the last start that fits (T - w), "restart" begins again at 0 (the
    released scripts' --roll_back: positions 0, s, 2s, ..., s·floor((T - w)/s),
    then 0 again) and "stay" keeps start = min(s·floor(step/tau), T - w).
    """
    w, s, tau = window_size(tc), tc.window_stride, tc.window_shift_every
    moves = step // tau
    if tc.window_end == "restart":
        start = s * (moves % ((span - w) // s + 1))
    else:
        start = min(s * moves, span - w)
    return start, start + w


# update_generator's stream for Flow-GRPO-Fast's window positions (apart from every other draw of a step).
FAST_WINDOW_STREAM = 0x46415354  # "FAST"


def fast_window(seed: int, step: int, span: int, tc: GRPOConfig, row: int | None = None) -> tuple[int, int]:
    """Flow-GRPO-Fast's window [start, start + w): start uniform in [lo, hi - w] of train.window_range
    (default (0, T // 2)), drawn from (seed, step, row) alone (row None: one window for the step), so a
    resumed or async run, and every rank, draw the same windows."""
    lo, hi = tc.window_range if tc.window_range is not None else (0, span // 2)
    # The step's own window is rank 0 of the stream; trajectory `row` (a global row index) is rank row + 1.
    generator = update_generator(seed, step, rank=0 if row is None else row + 1, stream=FAST_WINDOW_STREAM)
    w = window_size(tc)
    start = lo + int(torch.randint(hi - lo - w + 1, (1,), generator=generator))
    return start, start + w


def rollout_window(cfg: Config, step: int, row: int) -> tuple[int, int] | None:
    """The SDE window of trajectory `row` (global index) of step `step`: sampling.sde_window for flow_grpo,
    else the variant's (Flow-GRPO-Fast's per trajectory unless train.window_per=step)."""
    tc = cfg.train
    span = window_span(cfg.sampling.sampler, cfg.sampling.steps)
    if tc.variant == "mixgrpo":
        return mixgrpo_window(step, span, tc)
    if tc.variant == "fast":
        return fast_window(cfg.seed, step, span, tc, row if tc.window_per == "trajectory" else None)
    return cfg.sampling.sde_window


def window_request(cfg: Config, step: int, row: int) -> dict:
    """The request fields of trajectory `row`'s rollout at `step`: its SDE window, and (sampling.cache_threshold /
    early_exit) the plain loop when that window reaches the last step: the adaptive loop skips only the ODE steps
    after a window, and such a window leaves none."""
    window = rollout_window(cfg, step, row)
    fields = {"sde_window": window}
    adaptive = cfg.sampling.cache_threshold > 0 or cfg.sampling.early_exit is not None
    if adaptive and window[1] >= cfg.sampling.steps:
        fields.update(cache_threshold=0.0, early_exit=None)
    return fields


def rows_at(trained: torch.Tensor, j: int) -> list[int]:
    """The rows (of a minibatch's [b, T] trained mask) trained at step j: the ones its forward runs on."""
    return trained[:, j].nonzero().flatten().tolist()


def step_rows(traj: Trajectory, rows: list[int]) -> Trajectory:
    """The trajectory rows of one step's forward; the batch itself when that is every row (no copy)."""
    return traj if len(rows) == len(traj) else traj.select(rows)


@torch.no_grad()
def start_of_update_steps(model, transformer, traj: Trajectory, minibatches: list[list[int]],
                          trained: torch.Tensor, use_cfg: bool,
                          before_each_step: Callable[[], None] = lambda: None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [N, T], means [N, T, *latent]) of the trained (row, step) pairs of `minibatches` under the
    weights now, before any optimizer step of the update: the proximal policy of async rollouts, and
    GRPO-Guard's and DPPO's mu_old (rows of other minibatches stay 0).

    Computed with the row groups and forwards the loss will use, so a ratio
    against them is exactly 1 until the weights move. The update passes only
    the minibatches trained after its first optimizer step: before it, the
    loss's own forward gives these values (`grpo_step_loss(decoupled=True)`).
    """
    log_probs = torch.zeros_like(traj.log_probs)
    means = torch.zeros_like(traj.latents[:, 1:])
    for rows in minibatches:
        sub, mask = traj.select(rows), trained[rows]
        for j in range(traj.num_steps):
            local = rows_at(mask, j)
            if local:
                before_each_step()
                at = [rows[i] for i in local]
                log_probs[at, j], means[at, j] = step_policy(model, transformer, step_rows(sub, local), j,
                                                             use_cfg)[:2]
    return log_probs, means


def decoupled_ppo(cfg: Config, batch: RolloutBatch) -> bool:
    """Whether the update needs decoupled PPO's proximal policy: async rollouts whose batch lags the trainer.

    At staleness 0 (the first batch, a regenerated one) the weights that sampled
    are the weights at the start of the update, so the recorded log-probs are
    the proximal ones and the importance weight is 1: the synchronous loss. A
    batch without a staleness (not from the async collector) counts as lagged.
    """
    return bool(cfg.rollout.asynchronous) and batch.metrics.get("staleness", 1) > 0


class GRPO(ServesTrainedWeights):
    """Flow-GRPO's update behind the algorithm protocol (flywheel/recipe/algorithm.py): the policy, its
    optimizer and the config; it samples with the trained weights and keeps no tensors of its own.

    `transformer` is the trained module as prepared (DDP-wrapped on several ranks). `before_each_step()` runs
    before every denoising step's forward and its backward (async rollouts adjust the threads there).
    """

    def __init__(self, policy: Policy, optimizer, transformer, cfg: Config, accelerator,
                 before_each_step: Callable[[], None] = lambda: None):
        self.policy, self.optimizer, self.transformer, self.cfg = policy, optimizer, transformer, cfg
        self.accelerator, self.before_each_step = accelerator, before_each_step

    def update(self, batch: RolloutBatch, step: int) -> UpdateResult:
        """One GRPO update over this rank's rollouts: minibatches x chosen steps, optimizer step(s).

        Each row's loss is the mean over its own trained steps (every chosen step when
        all rows share one window; its window's steps under per-trajectory windows,
        where a step's forward runs on the rows trained there), and rows are averaged
        over the usable ones, as Flow-GRPO averages over samples and steps.
        """
        cfg, tc, model, transformer = self.cfg, self.cfg.train, self.policy.model, self.transformer
        traj = batch.trajectory
        fraction, selection = trained_fraction(tc)
        steps = chosen_steps(traj, fraction, torch.Generator().manual_seed(cfg.seed * 7919 + step), selection)
        trained = trained_mask(traj, steps)
        per_row = trained.sum(1)
        grads = GradientSteps(self.accelerator, transformer, self.optimizer, self.policy.named_params, tc, step)
        minibatches = grads.minibatches(len(traj))
        decoupled = decoupled_ppo(cfg, batch)
        # The policy before any optimizer step (decoupled PPO's proximal log-probs, Guard's and DPPO's mu_old)
        # costs a pass only for the minibatches trained after the first optimizer step: before it the current
        # weights are that policy, and each loss forward's own values, detached, are it exactly.
        later = minibatches[grads.accumulation:]
        start = (start_of_update_steps(model, transformer, traj, later, trained, tc.cfg_in_train,
                                       self.before_each_step)
                 if later and (decoupled or tc.guard or tc.policy_loss == "dppo") else None)
        for m, rows in enumerate(minibatches):
            moved = m >= grads.accumulation  # an optimizer step of this update came before this minibatch
            sub, mask = traj.select(rows), trained[rows]
            adv, usable = batch.advantages[rows], batch.usable[rows]
            # usable / number usable, times K / (the row's own trained steps): exactly 1 when every row has all K.
            weight = (usable.float() / usable.float().sum().clamp(min=1.0)
                      * (len(steps) / per_row[rows].clamp(min=1)).to(usable.device))
            here = [j for j in steps if mask[:, j].any()]
            for i, j in enumerate(here):
                self.before_each_step()
                local = rows_at(mask, j)
                at = [rows[r] for r in local]
                with grads.microstep(m, last_of_minibatch=i == len(here) - 1):
                    loss, stats = grpo_step_loss(model, transformer, self.policy.ref_velocity, step_rows(sub, local),
                                                 j, adv[local], usable[local], tc,
                                                 proximal=start[0][at, j] if decoupled and moved else None,
                                                 old_mean=start[1][at, j] if start is not None and moved else None,
                                                 weight=weight[local], decoupled=decoupled)
                    self.before_each_step()  # the backward is half a step's work: it too gets the cores freed
                    grads.backward(loss / grads.backwards_per_step(len(steps)))
                grads.record(stats)
            grads.maybe_step(m)
        # Which steps were trained (the SDE windows of mixgrpo / fast): the first of any row, the mean first
        # step over rows, and the mean count per row, in the step's metrics row.
        first_per_row = torch.where(trained, torch.arange(traj.num_steps), traj.num_steps).amin(1)
        return gradient_result({**grads.metrics(), "trained_steps/first": float(steps[0]),
                                "trained_steps/first_mean": float(first_per_row.float().mean()),
                                "trained_steps/count": float(per_row.float().mean())})


# ---------------------------------------------------------------------------------------
# Config checks
# ---------------------------------------------------------------------------------------


# GRPO's keys that act only when their switch is on (check_switched_keys): set away from the default with the
# switch off, they would be ignored.
GRPO_SWITCHED_KEYS = (
    ("train.variant", ("mixgrpo", "fast"), ("train.window_size",)),
    ("train.variant", "mixgrpo", ("train.window_shift_every", "train.window_stride", "train.window_end")),
    ("train.variant", "fast", ("train.window_range", "train.window_per")),
    # null: the released code's choice of steps (trained_fraction), whatever the selection says
    ("train.timestep_fraction", ANY_VALUE, ("train.timestep_selection",)),
    ("rollout.asynchronous", True, ("train.importance_cap",)),  # it truncates the lagged rollouts' weight
)


def validate_config(cfg: Config) -> None:
    """Check every field before anything runs: one ConfigError listing each bad key and what is valid."""
    checks = check_shared_sections(cfg)
    check_switched_keys(cfg, checks, GRPO_SWITCHED_KEYS)
    if cfg.train.kl_beta == 0 and not cfg.train.log_kl and not cfg.resume \
            and set_away_from_default(cfg, ["train.kl_form"]):
        checks.fail(f"train.kl_form={cfg.train.kl_form} with train.kl_beta=0 and train.log_kl=false: no KL is "
                    "computed, so it would be ignored; set train.kl_beta > 0 or train.log_kl=true, or leave it out")
    if cfg.train.kl_beta > 0 and not cfg.train.log_kl and not cfg.resume:
        checks.fail(f"train.log_kl=false with train.kl_beta={cfg.train.kl_beta}: the KL penalty measures (and logs) "
                    "the KL anyway, so it would be ignored; set train.kl_beta=0 as well for no reference forward, or "
                    "leave train.log_kl out")
    sampler = cfg.sampling.sampler
    if sampler == "ode":
        checks.fail("sampling.sampler=ode: GRPO trains the per-step log-probabilities of a stochastic sampler; "
                    "use sampler=sde or cps (or a recipe that trains on ODE samples: trainers/nft.py, awm.py)")
    for key in ("train.clip_range",):
        checks.require(key, lambda v: v > 0, "must be > 0")
    checks.require("train.kl_beta", lambda v: v >= 0, "must be >= 0 (0 = no KL penalty)")
    checks.require("train.importance_cap", lambda v: v >= 1, "must be >= 1 (the truncation of pi / pi_rollout)")
    checks.require("train.timestep_fraction", lambda v: 0 < v <= 1,
                   "must be in (0, 1], or null for the released code's (0.99 of the steps, the first ones)",
                   allow_none=True)
    if cfg.train.kl_form == "flow_grpo" and sampler != "sde":
        checks.fail(f"train.kl_form=flow_grpo is Flow-GRPO's Flow-SDE KL; with sampling.sampler={sampler} use "
                    "train.kl_form=exact")
    check_window_keys(cfg, checks)
    check_dppo_keys(cfg, checks)
    check_trust_region_acts(cfg, checks)
    check_layout_options(cfg, checks)  # async, Ray, workflow, Flash: the table of what combines
    if cfg.train.guard and card_flag(cfg.model.card, "audio"):
        checks.fail(f"train.guard=true with model.card={cfg.model.card}: GRPO-Guard rescales each step by its one "
                    "transition std, and a joint audio+video card has one per modality (its video-only path "
                    "included); set train.guard=false")
    if not cfg.train.cfg_in_train and cfg.sampling.guidance_scale != 1.0:
        # The rollouts sampled the guided policy; training the unguided one is off-policy from the first step.
        checks.fail(f"train.cfg_in_train=false with sampling.guidance_scale={cfg.sampling.guidance_scale}: the "
                    "training forward would score a policy other than the one that sampled (every ratio far "
                    "from 1). Set train.cfg_in_train=true, or sampling.guidance_scale=1")
    elif not cfg.train.cfg_in_train:
        checks.fail("train.cfg_in_train=false with sampling.guidance_scale=1.0: the rollouts use no guidance, so the "
                    "training forward has none to leave out and the key would be ignored; leave it out")
    checks.raise_if_any()


def check_trust_region_acts(cfg: Config, checks) -> None:
    """The trust region's own value (clip_range, or DPPO's KL threshold) set away from its default where it cannot
    act: with synchronous rollouts and one optimizer step per update, every loss term scores the rollout's own
    policy, recomputed, so each ratio is 1 and each per-step KL 0 (to rounding under model.compile), and neither
    the clip nor the mask ever applies (docs/recipes/grpo.md)."""
    if cfg.resume or trust_region_can_act(cfg) or optimizer_steps_per_update(cfg) is None:
        return
    key, inert = (("train.clip_range", "every ratio is 1, so the clip never applies")
                  if cfg.train.policy_loss == "clip" else
                  ("train.dppo_kl_threshold", "every per-step KL is 0, so the mask never applies"))
    for key, value in set_away_from_default(cfg, [key]):
        checks.fail(f"{key}={value:g} with one optimizer step per update and synchronous rollouts: each loss term "
                    f"scores the policy that sampled it, {inert} and the value would be ignored; take several "
                    f"optimizer steps a rollout (train.updates_per_rollout > 1, or train.minibatch_size under a "
                    f"process's rows), or leave it out")


def check_dppo_keys(cfg: Config, checks) -> None:
    """train.policy_loss=dppo's keys: a threshold >= 0, and no key of the other loss set (it would be ignored)."""
    tc, defaults = cfg.train, GRPOConfig()
    checks.require("train.dppo_kl_threshold", lambda v: v >= 0,
                   "must be >= 0 (the bound on the per-step KL to the behaviour policy)")
    if tc.policy_loss == "dppo":
        if tc.clip_range != defaults.clip_range:
            checks.fail(f"train.clip_range={tc.clip_range} with train.policy_loss=dppo: DPPO has no ratio clip, "
                        "so it would be ignored; set train.dppo_kl_threshold instead, or train.policy_loss=clip")
        if tc.guard:
            checks.fail("train.guard=true with train.policy_loss=dppo: GRPO-Guard rescales PPO's clipped ratio and "
                        "DPPO has no clip; choose one (train.guard=false or train.policy_loss=clip)")
    elif tc.dppo_kl_threshold != defaults.dppo_kl_threshold:
        checks.fail(f"train.dppo_kl_threshold={tc.dppo_kl_threshold} with train.policy_loss={tc.policy_loss}: the "
                    "threshold is DPPO's and would be ignored; set train.policy_loss=dppo, or leave it unset")


def trust_region_can_act(cfg: Config, world_size: int | None = None) -> bool:
    """Whether an update takes several optimizer steps (or lags, async), the only case where a ratio can leave 1
    (or DPPO's KL to the behaviour policy rise above 0): with one step per rollout every sample is on-policy when
    it is trained, so neither the clip nor the mask applies. `world_size`: default, the launcher's."""
    steps = optimizer_steps_per_update(cfg, world_size)
    return cfg.rollout.asynchronous or (steps is not None and steps > 1)


def check_window_keys(cfg: Config, checks) -> None:
    """The keys of the mixgrpo and fast variants (their windows must fit the rollout's steps) and of Flash."""
    tc = cfg.train
    if tc.flash_compress is not None:
        checks.require("train.flash_compress", lambda v: 0 < v <= 1, "must be in (0, 1] (the fraction of the ODE "
                       "steps after the window kept), or null for no Flash", allow_none=True)
        if tc.variant == "flow_grpo" and cfg.sampling.sde_window is None:
            checks.fail("train.flash_compress needs ODE steps after the SDE window: use train.variant=mixgrpo or "
                        "fast, or a sampling.sde_window that ends before the last step")
        if cfg.sampling.cache_threshold > 0 or cfg.sampling.early_exit is not None:
            checks.fail("train.flash_compress with sampling.cache_threshold / early_exit: both change the ODE steps "
                        "after the window (Flash compresses them, the cache skips model calls on them); set "
                        "train.flash_compress=null or sampling.cache_threshold=0 and early_exit=null")
    if tc.variant == "flow_grpo":
        return
    span = window_span(cfg.sampling.sampler, cfg.sampling.steps)
    if cfg.sampling.sde_window is not None:
        checks.fail(f"sampling.sde_window={list(cfg.sampling.sde_window)} with train.variant={tc.variant}: the "
                    "variant places the window itself each step; set sampling.sde_window=null, or "
                    "train.variant=flow_grpo for a fixed window")
    checks.require("train.window_size", lambda v: 1 <= v <= span,
                   f"must be in [1, {span}] or null: the steps a window may cover (sampling.steps="
                   f"{cfg.sampling.steps}{', less the deterministic last step of cps' if cfg.sampling.sampler == 'cps' else ''})",
                   allow_none=True)
    w = window_size(tc)
    if tc.variant == "mixgrpo":
        checks.require("train.window_shift_every", lambda v: v >= 1, "must be an integer >= 1 (training steps)")
        checks.require("train.window_stride", lambda v: v >= 1, "must be an integer >= 1 (denoising steps)")
    if tc.variant == "fast":
        checks.require("train.window_range", lambda r: len(r) == 2 and 0 <= r[0] and r[1] <= span
                       and r[1] - r[0] >= w,
                       f"must be [lo, hi) with 0 <= lo, hi <= {span} and hi - lo >= the window size ({w}), or "
                       f"null for (0, {span // 2})", allow_none=True)
        if tc.window_range is None and span // 2 < w <= span:
            checks.fail(f"the window size {w} does not fit the default train.window_range (0, {span // 2}) of a "
                        f"{cfg.sampling.steps}-step rollout: lower train.window_size or set train.window_range")
        if tc.window_per == "trajectory" and tc.flash_compress is not None:
            checks.fail("train.flash_compress with train.variant=fast and train.window_per=trajectory: Flash "
                        "compresses the steps after each window, so trajectories of different windows have "
                        "different schedules and cannot be trained as one batch; set train.window_per=step")
        if tc.window_per == "trajectory" and fsdp_requested():
            # Each rank runs a forward per step its rows' windows cover, a different count on each rank, and
            # every FSDP forward gathers the weights with the other ranks (DDP's forwards need no partner).
            checks.fail("train.variant=fast with train.window_per=trajectory and an FSDP launch: each rank trains "
                        "a different number of denoising steps, and FSDP's forwards are collectives that every "
                        "rank must run alike; set train.window_per=step, or launch with DDP")
        if tc.window_per == "trajectory" and tc.timestep_fraction not in (None, 1.0):
            checks.fail(f"train.timestep_fraction={tc.timestep_fraction} with train.variant=fast and "
                        "train.window_per=trajectory: each trajectory trains every step of its own window (use "
                        "train.window_size for fewer steps); set train.timestep_fraction=null or 1.0")


# ---------------------------------------------------------------------------------------
# Main: setup, loop, save
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    cfg = resolve_config(Config, sys.argv[1:] if argv is None else argv, recipe="grpo")
    validate_config(cfg)
    run = RecipeRun(cfg, recipe="grpo")
    if cfg.train.policy_loss == "dppo" and not trust_region_can_act(cfg, run.accelerator.num_processes):
        print("warning: train.policy_loss=dppo with one optimizer step per rollout: every sample is trained on-policy "
              "(KL 0 to the behaviour policy), so the mask never acts and the loss is the unclipped policy gradient; "
              "lower train.minibatch_size (or set train.updates_per_rollout > 1) for a trust region that acts",
              file=sys.stderr, flush=True)
    policy, transformer, optimizer = run.trained_policy(reference=cfg.train.kl_beta > 0 or cfg.train.log_kl)
    grpo = GRPO(policy, optimizer, transformer, cfg, run.accelerator)
    grpo.load_state_dict(run.recipe_tensors)
    rollouts = Rollouts(cfg, run.accelerator, policy, run.version, run.trainer_state)
    if cfg.train.variant != "flow_grpo":  # the window of each step's rollouts, a function of the step alone
        rollouts.flywheel.request_overrides = lambda step, row: window_request(cfg, step, row)
    rollouts.engine.flash_compress = cfg.train.flash_compress  # rollouts only: evaluation samples the ODE
    grpo.before_each_step = cpu_core_sharing(rollouts.collector, run.accelerator)
    return train(run, rollouts, grpo)


if __name__ == "__main__":
    run_main(main)
