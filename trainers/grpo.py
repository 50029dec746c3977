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

import contextlib
import copy
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from engine import Engine, PromptEmbeds, Trajectory, get_card, load_model
from engine.loop import concat_embeds, guided_velocity
from engine.sampling import sde_t_cap, step_log_prob, transition_std
from flywheel.sync.async_rollouts import AsyncCollector
from flywheel.runs.checkpoint import load_checkpoint, load_trainable, resolve_resume, save_checkpoint
from flywheel.runs.config import (ConfigChecks, ConfigError, apply_overrides, config_to_dict, config_value, load_config,
                             parse_config, save_config)
from flywheel.cli import run_main
from flywheel.distributed import all_reduce_mean
from flywheel.grids import judged_sample_grid
from flywheel.guards import check_finite, check_finite_weights
from flywheel.hacking_watch import HackingWatch
from flywheel.lora import adapters_disabled, add_lora, save_lora_for_diffusers
from flywheel.loop import Flywheel, RolloutBatch
from flywheel.prompts import PromptSampler, load_prompts
from flywheel.runs.rundir import MetricsLog, RunDir
from flywheel.sync.engine_process import EngineProcess
from flywheel.sync.controller import SharedMemoryTransport, WeightSyncController
from flywheel.runs.tracking import log_images, log_videos, prepare_tracker
from flywheel.video import MiddleFrameRewards, is_video, middle_frame, write_mp4
from rewards import RewardSet

# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    card: str = "toy-digits"
    """model card id (see `engine.list_cards()`)"""
    path: str | None = None
    """local weights folder; None uses the weights the project ships (toy card only)"""
    finetune: Literal["full", "lora"] = "full"
    """train every transformer weight, or a LoRA adapter (peft)"""
    lora_rank: int = 8
    """LoRA rank r"""
    lora_alpha: float = 8.0
    """LoRA alpha (scale = alpha / r)"""
    lora_targets: list[str] | None = None
    """Linear layers to adapt; None uses the card's default"""
    lora_init: Literal["default", "gaussian"] = "default"
    """LoRA A init: peft's Kaiming-uniform, or gaussian N(0, 1/r) as Flow-GRPO (B = 0 either way)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """transformer weight dtype; latents and log-probs stay fp32"""
    compile: bool = False
    """torch.compile the rollout forward (engine/compiling.py): the first rollout pays for compiling, training
    stays eager, and the on-policy ratio is 1 up to rounding (fp32 ~5e-7, bf16 ~1e-5) instead of exactly"""


@dataclass
class DataConfig:
    prompts: str = "toy-digits"
    """training prompts: a built-in dataset name or a .txt / .jsonl file"""
    eval_prompts: str = "toy-digits-heldout"
    """held-out evaluation prompts (same forms as `prompts`)"""
    prompts_per_step: int = 8
    """distinct prompts per step (over all ranks)"""
    group_size: int = 16
    """samples per prompt (G); advantages are normalised within each group"""


@dataclass
class SamplingConfig:
    steps: int = 10
    """denoising steps of a rollout"""
    sampler: Literal["sde", "cps"] = "sde"
    """rollout sampler: Flow-SDE, or coefficients-preserving sampling (noise_level is then eta)"""
    noise_level: float = 0.7
    """Flow-SDE noise level a (CPS: eta in [0, 1))"""
    guidance_scale: float = 1.0
    """classifier-free guidance of rollouts (1 = no unconditional branch)"""
    sde_window: tuple[int, int] | None = None
    """[start, end) of the stochastic (trained) steps; None = all steps"""
    time_shift: float = 1.0
    """SD3-style time shift of the schedule"""
    eval_guidance_scale: float = 1.0
    """guidance of the ODE evaluation samples"""
    eval_seeds: int = 4
    """samples per evaluation prompt (fixed seeds)"""
    eval_steps: int | None = None
    """denoising steps of the ODE evaluation samples; None = `steps`"""
    height: int | None = None
    """image / video height in pixels; None uses the card's native size"""
    width: int | None = None
    """image / video width in pixels; None uses the card's native size"""
    frames: int | None = None
    """video frames (video cards only; None uses the card's default)"""


@dataclass
class TrainConfig:
    learning_rate: float = 3e-4
    """AdamW learning rate"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
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
    adv_clip_max: float = 5.0
    """advantages are clipped to [-adv_clip_max, adv_clip_max]"""
    global_std: bool = False
    """normalise advantages by the std of all the step's rewards (Flow-GRPO's sample.global_std), not each group's"""
    timestep_fraction: float = 1.0
    """fraction of the stochastic steps trained each step"""
    timestep_selection: Literal["random", "first"] = "random"
    """which steps `timestep_fraction` keeps: round(f·n) random ones each step, or the first int(f·n) as Flow-GRPO"""
    cfg_in_train: bool = True
    """apply guidance in the training forward too (when rollouts used it)"""
    minibatch_size: int = 128
    """samples per training forward"""
    gradient_accumulation_steps: int = 1
    """minibatches accumulated into one optimizer step"""
    updates_per_rollout: int | None = None
    """optimizer steps per rollout batch (the minibatches split evenly); None = set by gradient_accumulation_steps"""
    max_masked_steps: int = 3
    """stop with an error after this many consecutive steps whose every sample the rewards masked"""
    gradient_checkpointing: bool = False
    """recompute the transformer's activations in backward (less memory, ~30% slower; diffusers models)"""


@dataclass
class Config:
    run_dir: str = "runs/grpo-toy"
    """where config, metrics, samples and checkpoints go"""
    seed: int = 0
    """seed of prompts, rollouts and timestep choice"""
    steps: int = 80
    """training steps (rollout + update)"""
    rewards: str = "digit_alignment:1.0"
    """reward spec: name:weight,name:weight (remote:http://host:port[:weight] for a served reward)"""
    rewards_mode: Literal["weighted_sum", "sum_of_advantages"] = "weighted_sum"
    """advantages of the weighted sum of raw scores, or the weighted sum of per-reward group advantages"""
    reward_timeout_s: float = 60.0
    """remote rewards: wall-clock bound (s) of one HTTP call to a remote:<url> server, connect to last byte"""
    reward_budget_s: float = 120.0
    """remote rewards: wall-clock bound (s) of all attempts (retries, backoff) to score one batch"""
    async_rollouts: bool = False
    """roll out step s+1 in an engine process while training on step s (one trainer process)"""
    max_staleness: int = 1
    """async rollouts: a batch may lag the trainer by this many weight versions; older ones are regenerated"""
    overlap_scoring: bool = False
    """score each rollout chunk on a background thread while the engine generates the next one"""
    eval_every: int = 20
    """evaluate every N steps (and at the start and end)"""
    sample_every: int = 20
    """save a sample grid every N steps"""
    save_every: int = 20
    """checkpoint every N steps (and at the end)"""
    keep_checkpoints: int = 2
    """checkpoints kept on disk"""
    resume: str | None = None
    """run dir or checkpoint dir to continue from"""
    overwrite: bool = False
    """start a fresh run in a run dir that holds an earlier run, deleting that run's files"""
    tracker: Literal["wandb", "tensorboard", "none"] = "wandb"
    """experiment tracker (wandb runs offline when no account is configured)"""
    project: str = "flywheel"
    """tracker project name"""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# ---------------------------------------------------------------------------------------
# The GRPO loss of one denoising step
# ---------------------------------------------------------------------------------------


def step_conditioning(traj: Trajectory, use_cfg: bool) -> tuple[PromptEmbeds, PromptEmbeds | None]:
    cond = PromptEmbeds(traj.prompt_embeds, traj.pooled_prompt_embeds, traj.prompt_mask)
    if not use_cfg or traj.negative_prompt_embeds is None:
        return cond, None
    uncond = PromptEmbeds(traj.negative_prompt_embeds, traj.negative_pooled_prompt_embeds, traj.negative_prompt_mask)
    return cond, concat_embeds(uncond, cond)


def step_policy(model, transformer, traj: Trajectory, j: int, use_cfg: bool):
    """Step j of a trajectory batch under `transformer`: (log_prob [B], mean, std, cond, uncond_cond)."""
    x, x_next = traj.latents[:, j], traj.latents[:, j + 1]
    t, t_next = traj.timesteps[j], traj.timesteps[j + 1]
    cond, uncond_cond = step_conditioning(traj, use_cfg)
    v = guided_velocity(model, transformer, x, t, cond, uncond_cond, traj.guidance_scale)
    log_prob, mean, std = step_log_prob(traj.sampler, x, x_next, v, t, t_next, traj.noise_levels[j],
                                        sde_t_cap(traj.timesteps))
    return log_prob, mean, std, cond, uncond_cond


def grpo_step_loss(model, transformer, ref_velocity, traj: Trajectory, j: int, advantages: torch.Tensor,
                   usable: torch.Tensor, cfg: TrainConfig,
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

    Stops with NonFiniteError before an optimizer step whose gradient norm is
    not finite, and right after one that leaves a non-finite weight.
    `before_each_step()` runs before every denoising step's forward (async rollouts adjust threads there).
    """
    tc = cfg.train
    traj = batch.trajectory
    params = [p for _, p in named_params]
    steps = chosen_steps(traj, tc.timestep_fraction, torch.Generator().manual_seed(cfg.seed * 7919 + step),
                         tc.timestep_selection)
    n = len(traj)
    minibatches = [list(range(i, min(i + tc.minibatch_size, n))) for i in range(0, n, tc.minibatch_size)]
    accumulation = accumulation_steps(len(minibatches), tc)
    proximal = (proximal_log_probs(model, transformer, traj, minibatches, steps, tc.cfg_in_train)
                if cfg.async_rollouts else None)
    totals: dict[str, torch.Tensor] = {}
    sync_metrics: dict[str, float] = {}
    backwards_per_update = len(steps) * accumulation
    for m, rows in enumerate(minibatches):
        sub = traj.select(rows)
        adv, usable = batch.advantages[rows], batch.usable[rows]
        for i, j in enumerate(steps):
            last_backward = (m + 1) % accumulation == 0 and i == len(steps) - 1
            # Gradients are all-reduced once per optimizer step, not once per backward.
            context = accelerator.no_sync(transformer) if not last_backward else contextlib.nullcontext()
            before_each_step()
            with context:
                loss, stats = grpo_step_loss(model, transformer, ref_velocity, sub, j, adv, usable, tc,
                                             proximal=None if proximal is None else proximal[rows, j])
                accelerator.backward(loss / backwards_per_update)
            for k, v in stats.items():
                if k.endswith(("max_dev", "/max")):
                    totals[k] = torch.maximum(totals.get(k, v), v)
                else:
                    totals[k] = totals.get(k, 0.0) + v / (len(steps) * len(minibatches))
        if (m + 1) % accumulation == 0:
            grad_norm = accelerator.clip_grad_norm_(params, tc.max_grad_norm)
            # Gradients are all-reduced: every rank sees the same norm and stops together.
            check_finite(grad_norm, "the gradient norm", step + 1, "the loss or the rollouts went NaN/inf")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            check_finite_weights(named_params, step + 1, "lower train.learning_rate or train.max_grad_norm")
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + grad_norm.detach() / (len(minibatches) // accumulation)
            sync_metrics = sync()
    metrics = {k: float(v) for k, v in totals.items()}
    metrics.update({k: v for k, v in sync_metrics.items() if k != "weight_version"})
    metrics["weight_version_after"] = sync_metrics["weight_version"]
    return metrics


def accumulation_steps(n_minibatches: int, tc: TrainConfig) -> int:
    """Minibatches per optimizer step: train.gradient_accumulation_steps, or n / train.updates_per_rollout."""
    if tc.updates_per_rollout is not None:
        if n_minibatches % tc.updates_per_rollout:
            raise ValueError(f"train.updates_per_rollout={tc.updates_per_rollout} does not divide the "
                             f"{n_minibatches} minibatches of a step on this rank: choose a divisor of {n_minibatches}"
                             f" or change train.minibatch_size")
        return n_minibatches // tc.updates_per_rollout
    if n_minibatches % tc.gradient_accumulation_steps:
        raise ValueError(f"{n_minibatches} minibatches per step is not a multiple of "
                         f"train.gradient_accumulation_steps={tc.gradient_accumulation_steps}")
    return tc.gradient_accumulation_steps


# ---------------------------------------------------------------------------------------
# Setup helpers
# ---------------------------------------------------------------------------------------


def resolve_config(argv: list[str]) -> Config:
    """CLI config; with resume=RUN, the run's saved config.yaml is the base and the CLI overrides it."""
    cfg = parse_config(Config, argv)
    if cfg.resume:
        if cfg.overwrite:
            raise ConfigError("resume= continues a run and overwrite=true deletes one: give only one of them")
        # The newest checkpoint that verifies (a corrupt newer one is skipped with a warning);
        # a run dir without its config.yaml is refused rather than resumed with defaults.
        run_dir, ckpt = resolve_resume(cfg.resume)
        overrides = [a for a in argv if "=" in a and not a.startswith("--")]
        cfg = apply_overrides(load_config(Config, run_dir / "config.yaml"), overrides)
        cfg.run_dir, cfg.resume, cfg.overwrite = str(run_dir), str(ckpt), False
    return cfg


def validate_config(cfg: Config) -> None:
    """Check every field before anything runs: one ConfigError listing each bad key and what is valid."""
    checks = ConfigChecks(cfg)
    positive = "must be an integer >= 1"
    for key in ("steps", "eval_every", "sample_every", "save_every", "keep_checkpoints", "data.prompts_per_step",
                "sampling.steps", "sampling.eval_seeds", "train.minibatch_size", "train.gradient_accumulation_steps",
                "train.max_masked_steps", "model.lora_rank"):
        checks.require(key, lambda v: v >= 1, positive)
    for key in ("sampling.eval_steps", "sampling.height", "sampling.width", "sampling.frames",
                "train.updates_per_rollout"):
        checks.require(key, lambda v: v >= 1, positive + " or null", allow_none=True)
    checks.require("seed", lambda v: v >= 0, "must be an integer >= 0")
    checks.require("max_staleness", lambda v: v >= 0, "must be an integer >= 0")
    checks.require("data.group_size", lambda v: v >= 2, "must be >= 2: GRPO compares the samples of a group")
    sampler = cfg.sampling.sampler
    if sampler == "cps":
        checks.require("sampling.noise_level", lambda v: 0 < v < 1, "is CPS's eta for sampler=cps: in (0, 1)")
    else:
        checks.require("sampling.noise_level", lambda v: 0 < v <= 10, "is Flow-SDE's a: in (0, 10] (0 trains nothing)")
    for key in ("sampling.guidance_scale", "sampling.eval_guidance_scale"):
        checks.require(key, lambda v: 0 <= v <= 100, "must be in [0, 100] (1 = no guidance)")
    checks.require("sampling.time_shift", lambda v: 0 < v <= 100, "must be in (0, 100] (1 = no shift)")
    checks.require("sampling.sde_window", lambda w: 0 <= w[0] < w[1] <= cfg.sampling.steps,
                   f"must be [start, end) with 0 <= start < end <= sampling.steps ({cfg.sampling.steps})",
                   allow_none=True)
    checks.require("train.learning_rate", lambda v: 0 < v <= 1, "must be in (0, 1]")
    for key in ("reward_timeout_s", "reward_budget_s"):
        checks.require(key, lambda v: v > 0, "must be a number of seconds > 0")
    checks.require("train.weight_decay", lambda v: v >= 0, "must be >= 0")
    checks.require("train.adam_betas", lambda b: len(b) == 2 and all(0 <= x < 1 for x in b),
                   "must be two numbers in [0, 1)")
    for key in ("train.max_grad_norm", "train.clip_range", "train.adv_clip_max", "model.lora_alpha"):
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
    try:
        get_card(cfg.model.card)
    except (KeyError, ValueError) as e:
        checks.fail(f"model.card={cfg.model.card!r}: {e}")
    for key in ("data.prompts", "data.eval_prompts"):
        try:
            load_prompts(config_value(cfg, key))
        except (OSError, ValueError) as e:
            checks.fail(f"{key}={config_value(cfg, key)!r}: {e}")
    checks.raise_if_any()


def build_judges(cfg: Config) -> dict:
    """Independent judges for evaluation (never trained on): catch reward hacking."""
    if cfg.model.card == "toy-digits":
        from rewards.judges import DigitJudge, DigitTypicalityJudge

        # The SVC first: its verdicts frame the sample grid. Typicality sees the saturated blobs it accepts.
        return {"digit_svc": DigitJudge(), "digit_typicality": DigitTypicalityJudge()}
    return {}


def fsdp_full_params(accelerator, module):
    """A context factory that gathers FSDP-sharded parameters whole (a no-op without FSDP).

    Under FSDP (version 1, use_orig_params) the wrapped module's own parameters
    become shards; inside `summon_full_params` they are whole again, so the
    engine can call the plain module for rollouts without per-forward collectives.
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return contextlib.nullcontext
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(module, FullyShardedDataParallel):
        raise ValueError("the FSDP recipe path needs FSDP version 1 (fsdp_version: 1 in the accelerate config, "
                         "see configs/accelerate/fsdp.yaml)")
    return lambda: FullyShardedDataParallel.summon_full_params(module, writeback=False)


def start_engine_process(cfg: Config, accelerator, named_params, version: int):
    """Async rollouts: the engine in its own process, fed the trainer's weights through shared memory."""
    if accelerator.num_processes > 1:
        raise ValueError("async_rollouts=true needs a single trainer process (the engine takes the other cores); "
                         f"this run has {accelerator.num_processes}")
    lora = None
    if cfg.model.finetune == "lora":
        lora = {"rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha,
                "targets": cfg.model.lora_targets or get_card(cfg.model.card).defaults.get("lora_targets")}
    engine = EngineProcess.start(cfg.model.card, path=cfg.model.path, device=str(accelerator.device), threads=1,
                                 lora=lora, weight_version=max(version - 1, 0),
                                 compile=cfg.model.compile)
    controller = WeightSyncController(engine, transport=SharedMemoryTransport())
    # The engine starts one version below the trainer's: the first sync below, which gives it the
    # trainer's weights, lands on the trainer's version, so that a version names the same weights in a
    # resumed run as in one that never stopped (a fresh run: the card's weights 0, the trainer's 1).

    def sync() -> dict:
        return controller.sync({n: p.detach() for n, p in named_params})

    # The engine process starts from the card's weights: give it the trainer's (LoRA init, resume), checked once.
    controller.verify = True
    sync()
    controller.verify = False
    # The trained Parameters move into one buffer laid out like the engine's: each sync is one memcpy.
    controller.transport.share_layout(engine, dict(named_params))
    return engine, controller, sync


def cpu_core_sharing(collector: AsyncCollector | None, accelerator):
    """Async rollouts on a CPU: train on one thread while the engine process rolls out on the other
    core, and on every core once it is done (oversubscribing the cores instead makes the threads of
    a parallel op wait for each other)."""
    if collector is None or accelerator.device.type != "cpu":
        return lambda: None
    cores = torch.get_num_threads()

    def share() -> None:
        wanted = max(1, cores - 1) if collector.rollout_running() else cores
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
    return share


def eval_step(flywheel: Flywheel, cfg: Config, judges: dict, watch: HackingWatch, accelerator, run: RunDir,
              step: int) -> dict:
    """Evaluate on the main process (per-class judge metrics, the hacking watch); save and log a sample grid."""
    if not accelerator.is_main_process:
        return {}
    items = load_prompts(cfg.data.eval_prompts)
    metrics, traj = flywheel.evaluate(items, cfg.sampling.eval_seeds,
                                      {"sampler": "ode", "guidance_scale": cfg.sampling.eval_guidance_scale,
                                       "steps": cfg.sampling.eval_steps or cfg.sampling.steps},
                                      judges)
    watched = watch.update(metrics, step)
    metrics.update(watched.metrics)
    if watched.new:  # printed once when it starts; the progress bar shows it while it lasts
        _progress_write(f"step {step}: {watched.warning}")
    if step % cfg.sample_every == 0 or step == cfg.steps:
        # One image per prompt, first seed: a row per digit for the toy task, framed by the judge's verdict.
        first = slice(None, None, cfg.sampling.eval_seeds)
        shown = traj.images[first].detach().cpu()
        if is_video(shown):
            paths = [write_mp4(v, run.samples_dir / f"step-{step:06d}-{i:02d}.mp4") for i, v in enumerate(shown[:8])]
            log_videos(accelerator, "eval/videos", paths, step)
            shown = middle_frame(shown)
        grid = judged_sample_grid(shown, traj.prompts[first], traj.metadata[first], judges,
                                  nrow=len(items) // 10 or None)
        grid.save(run.sample_path(step))
        log_images(accelerator, "eval/samples", [grid], step)
    return metrics


# ---------------------------------------------------------------------------------------
# Main: setup, loop, save
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    from accelerate import Accelerator

    cfg = resolve_config(sys.argv[1:] if argv is None else argv)
    validate_config(cfg)
    init_kwargs = prepare_tracker(cfg.tracker, Path(cfg.run_dir))
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              log_with=None if cfg.tracker == "none" else cfg.tracker, project_dir=cfg.run_dir)
    # A run dir belongs to one run: a fresh run refuses a used one unless told to overwrite it.
    run = RunDir(cfg.run_dir, mode="resume" if cfg.resume else "overwrite" if cfg.overwrite else "new",
                 tracker_dirs=(cfg.project,),
                 is_main_process=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    if accelerator.device.type == "cpu":
        # One thread per rank: ranks sharing the cores must not oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // accelerator.num_processes))

    # --- model, trainable weights, reference policy -----------------------------------------
    dtype = getattr(torch, cfg.model.dtype)
    model = load_model(cfg.model.card, path=cfg.model.path, device=accelerator.device, dtype=dtype)
    transformer = model.transformer
    card_defaults = get_card(cfg.model.card).defaults
    if cfg.sampling.time_shift != 1.0 and hasattr(model, "schedule"):
        raise ConfigError(f"sampling.time_shift={cfg.sampling.time_shift}: the {cfg.model.card} card takes its "
                          "schedule (and its shift) from the folder's scheduler config, so this key would be "
                          "ignored; leave it at 1.0 and edit scheduler/scheduler_config.json to change the shift")
    if cfg.train.gradient_checkpointing:
        if not hasattr(transformer, "enable_gradient_checkpointing"):
            raise ValueError(f"train.gradient_checkpointing=true: the {cfg.model.card} card's transformer does not "
                             f"support it (diffusers models do)")
        transformer.enable_gradient_checkpointing()
    ref_velocity = None
    need_reference = cfg.train.kl_beta > 0 or cfg.train.log_kl
    if cfg.model.finetune == "lora":
        targets = cfg.model.lora_targets or card_defaults.get("lora_targets")
        add_lora(transformer, cfg.model.lora_rank, cfg.model.lora_alpha, targets, init=cfg.model.lora_init)
        if need_reference:
            def ref_velocity(x, t, cond, uncond_cond, g):  # the base model = adapter switched off
                with adapters_disabled(transformer):
                    return guided_velocity(model, transformer, x, t, cond, uncond_cond, g)
    else:
        transformer.requires_grad_(True)
        if need_reference:
            reference = copy.deepcopy(transformer).requires_grad_(False)

            def ref_velocity(x, t, cond, uncond_cond, g):
                return guided_velocity(model, reference, x, t, cond, uncond_cond, g)
    named_params = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]
    params = [p for _, p in named_params]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.learning_rate, betas=cfg.train.adam_betas,
                                  weight_decay=cfg.train.weight_decay)

    # --- resume -------------------------------------------------------------------------------
    start_step, version, trainer_state = 0, 0, {}
    metrics_log = run.metrics
    if cfg.resume:
        # resolve_resume verified its checksums a moment ago; load checks names, sizes and finiteness.
        state, trainer_state = load_checkpoint(cfg.resume, optimizer=optimizer, named_params=named_params,
                                               checksums=False)
        load_trainable(named_params, state, cfg.resume)  # strict: every trained tensor, nothing else
        start_step, version = trainer_state["step"], trainer_state["weight_version"]
        if accelerator.is_main_process:
            metrics_log.truncate_after(start_step)  # rows a killed run wrote after its last checkpoint
    elif accelerator.is_main_process:
        save_config(cfg, run.path / "config.yaml")

    train_transformer, optimizer = accelerator.prepare(transformer, optimizer)
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)
    # FSDP shards model.transformer's parameters in place; the engine's rollouts (and checkpoints)
    # need them whole: gather them for the duration, on every rank (the gather is a collective).
    full_params = fsdp_full_params(accelerator, train_transformer)

    # --- engine, rewards, flywheel --------------------------------------------------------------
    if cfg.async_rollouts:
        engine, sync_controller, sync = start_engine_process(cfg, accelerator, named_params, version)
    else:  # colocated: the engine serves the trainer's own module
        engine = Engine(model, device=accelerator.device, weight_version=version, time_shift=cfg.sampling.time_shift,
                        compile=cfg.model.compile)
        sync_controller = WeightSyncController(engine, mode="colocated")
        sync = sync_controller.sync
    rewards = RewardSet(cfg.rewards, mode=cfg.rewards_mode, remote_timeout_s=cfg.reward_timeout_s,
                        remote_budget_s=cfg.reward_budget_s)
    if card_defaults.get("video"):
        rewards = MiddleFrameRewards(rewards)  # image scorers see each video's middle frame
    flywheel = Flywheel(
        engine, rewards, PromptSampler(load_prompts(cfg.data.prompts), cfg.data.prompts_per_step,
                                                     cfg.seed),
        cfg.data.group_size,
        request_kwargs=dict(steps=cfg.sampling.steps, sampler=cfg.sampling.sampler, noise_level=cfg.sampling.noise_level,
                            guidance_scale=cfg.sampling.guidance_scale, sde_window=cfg.sampling.sde_window,
                            height=cfg.sampling.height, width=cfg.sampling.width, frames=cfg.sampling.frames),
        seed=cfg.seed, adv_clip=cfg.train.adv_clip_max, overlap_scoring=cfg.overlap_scoring,
        global_std=cfg.train.global_std)
    if cfg.resume and trainer_state["data_position"] != flywheel.sampler.position(start_step):
        raise ValueError(f"resume={cfg.resume}: the checkpoint was at data position {trainer_state['data_position']}"
                         f" but step {start_step} of these prompts is at {flywheel.sampler.position(start_step)}: "
                         "data.prompts or data.prompts_per_step changed since it was saved")
    judges = build_judges(cfg) if accelerator.is_main_process else {}
    watch = HackingWatch()  # reward rising while the judge falls, overall or in one class
    for earlier in (metrics_log.read() if cfg.resume and accelerator.is_main_process else []):
        if "eval/reward/mean" in earlier:  # a resumed run keeps comparing with the evaluations before it
            watch.update(earlier, earlier["step"])
    if cfg.tracker != "none":
        accelerator.init_trackers(cfg.project, config=_flatten(config_to_dict(cfg)), init_kwargs=init_kwargs)

    def log(row: dict) -> None:
        if accelerator.is_main_process:
            metrics_log.append(row)
            accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    # --- the loop -------------------------------------------------------------------------------
    base_eval = None
    if start_step == 0:
        with full_params():
            base_eval = eval_step(flywheel, cfg, judges, watch, accelerator, run, 0)
        log({"step": 0, "weight_version": engine.weight_version, **base_eval})
    progress = _progress(accelerator, start_step, cfg.steps)
    row: dict = {}
    current_version = engine.weight_version
    skipped_steps, masked_run = trainer_state.get("skipped_steps", 0), trainer_state.get("masked_run", 0)
    collector = AsyncCollector(flywheel.collect, cfg.max_staleness) if cfg.async_rollouts else None
    if collector is not None and "async_collector" in trainer_state:
        collector.load_state_dict(trainer_state["async_collector"])  # the staleness counts continue
    share_cores = cpu_core_sharing(collector, accelerator)
    try:
        for step in range(start_step, cfg.steps):
            step_start = time.perf_counter()
            with full_params():
                if collector is None:
                    batch = flywheel.collect(step)
                else:  # generated while the previous step trained; start the next one now
                    batch = collector.get(step, trainer_version=current_version)
                    if step + 1 < cfg.steps:
                        collector.prefetch(step + 1)
            t0 = time.perf_counter()
            signal = all_reduce_mean({"usable": float(batch.usable.sum()), "valid": float(batch.rewards.valid.sum())})
            if signal["usable"] > 0:
                masked_run = 0
                train_metrics = grpo_update(batch, model, train_transformer, ref_velocity, optimizer, accelerator,
                                            sync, named_params, cfg, step, before_each_step=share_cores)
            else:
                # No sample carries a signal (all masked, or every group's rewards equal): an optimizer step
                # would still move the weights through AdamW's momentum and weight decay. Skip it.
                skipped_steps += 1
                masked_run = masked_run + 1 if signal["valid"] == 0 else 0
                if masked_run >= cfg.train.max_masked_steps:
                    raise RuntimeError(f"step {step + 1}: the rewards masked every sample of the last {masked_run} "
                                       f"steps (train.max_masked_steps={cfg.train.max_masked_steps}); see the "
                                       f"reward/*/invalid metrics in {run.metrics_path} and the scorer's errors")
                train_metrics = {"weight_version_after": current_version}
            train_metrics["train/skipped_steps"] = skipped_steps
            train_metrics["time/train_s"] = time.perf_counter() - t0 - train_metrics.get("sync/total_s", 0.0)
            train_metrics["time/wait_s"] = t0 - step_start
            current_version = train_metrics["weight_version_after"]
            row = {"step": step + 1, **all_reduce_mean({**batch.metrics, **train_metrics})}
            row["weight_version"] = batch.trajectory.weight_version
            row["time/step_s"] = time.perf_counter() - step_start
            for key in ("loss", "kl"):
                if key in row:
                    check_finite(row[key], f"the mean {key}", step + 1)
            if collector is not None:
                row.update(collector.metrics())
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                with full_params():
                    row.update(eval_step(flywheel, cfg, judges, watch, accelerator, run, done))
            log(row)
            if done % cfg.save_every == 0 or done == cfg.steps:
                with full_params():
                    if accelerator.is_main_process:
                        save_checkpoint(run.checkpoints_dir, done, {n: p.detach() for n, p in named_params},
                                        raw_optimizer, named_params,
                                        {"step": done, "weight_version": current_version,
                                         "data_position": flywheel.sampler.position(done),
                                         "skipped_steps": skipped_steps, "masked_run": masked_run,
                                         **({"async_collector": collector.state_dict()} if collector is not None else {})},
                                        keep_last=cfg.keep_checkpoints)
                accelerator.wait_for_everyone()
            progress.update(1)
            progress.set_postfix(reward=f"{row.get('reward/mean', float('nan')):.3f}", kl=f"{row.get('kl', 0.0):.2e}",
                                 v=current_version, **({"HACKING?": watch.last.short} if watch.last.short else {}))
    finally:
        progress.close()
        if collector is not None:
            engine.close()  # first: a rollout still in flight then ends at once instead of being waited for
            collector.close()
            sync_controller.close()
    if cfg.model.finetune == "lora" and card_defaults.get("diffusers_pipeline"):
        # The adapter in the format a stock pipeline's load_lora_weights(run_dir / "lora") reads.
        with full_params():
            if accelerator.is_main_process:
                save_lora_for_diffusers(transformer, run.path / "lora", card_defaults["diffusers_pipeline"])
        accelerator.wait_for_everyone()

    # --- report ---------------------------------------------------------------------------------
    final_eval = {k: v for k, v in row.items() if k.startswith("eval/")}
    if accelerator.is_main_process:
        base = base_eval if base_eval is not None else _first_eval(metrics_log)
        print(f"eval reward: base {base.get('eval/reward/mean', float('nan')):.3f} -> "
              f"final {final_eval.get('eval/reward/mean', float('nan')):.3f} "
              f"(run dir {run.path})", flush=True)
    accelerator.end_training()
    if accelerator.is_main_process and "eval/reward/mean" in final_eval:
        # Everything is saved; a NaN final evaluation still makes the run fail rather than exit 0.
        check_finite(final_eval["eval/reward/mean"], "the final evaluation reward", cfg.steps,
                     "every evaluation sample was masked: see the eval/reward/*/invalid metrics")
    return {"base": base_eval, "final": final_eval, "run_dir": str(run.path)}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


def _first_eval(metrics_log: MetricsLog) -> dict:
    rows = [r for r in metrics_log.read() if r.get("step") == 0]
    return rows[0] if rows else {}


def _progress_write(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


def _progress(accelerator, start: int, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="grpo", disable=not accelerator.is_main_process,
                dynamic_ncols=True)


if __name__ == "__main__":
    run_main(main)
