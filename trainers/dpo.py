"""Online Diffusion-DPO (Wallace et al., arXiv 2311.12908) for flow matching: preference pairs from each step's groups.

    accelerate launch trainers/dpo.py                     # the built-in toy task (toy-digits)
    python trainers/dpo.py --config configs/toy_numbers_dpo.yaml
    python trainers/dpo.py train.pairing=all_pairs train.pair_margin=0.1 train.beta=50

Each step the trained policy samples G images per prompt (any sampler, the ODE
by default), the rewards rank each group, and its best and worst sample become a
(winner, loser) pair (`pairing=all_pairs`: every i, j with r_i - r_j >
pair_margin). The paper's loss (Eq. 14), in the rectified-flow form, for each
pair and each of K flow times t, one eps shared by winner and loser:

    x_t^w = (1 - t)·x0^w + t·eps,     x_t^l = (1 - t)·x0^l + t·eps          (same t, same eps)
    e_p(x) = mean over elements |v_p(x_t, t, c) - (eps - x0)|^2              p = theta (trained) or ref
    Delta  = (e_theta(w) - e_ref(w)) - (e_theta(l) - e_ref(l))
    L      = -log sigmoid(-beta·Delta)

averaged over the pairs of a minibatch, then over the K times; -beta·Delta is
the pair's implicit reward margin (`dpo/implicit_acc`: the fraction positive).
The paper's beta·T·omega(lambda_t) is folded into `beta`; norms are element
means. flow_grpo's and Flow-Factory's codes write -beta/2·Delta: their beta is
2·this beta. The reference is the model before any update (the LoRA adapter
switched off, or a frozen copy), and never moves.

Read, facts only: the paper's Eq. 14; flow_grpo's scripts/train_sd3_dpo.py;
Flow-Factory's src/flow_factory/trainers/dpo.py.

Deviations, each on purpose:
- Reference fixed at the base model (flow_grpo copies the learner into it every
  ref_update_step steps and samples with it); the trained policy samples.
- Pairs ranked by the total reward, not an advantage (pair_margin in reward
  units); reward.aggregation=sum_of_advantages is refused.
- Flat groups and masked rewards give no pair; a group split across ranks is
  paired within each rank's share.
- Flow times: "rollout_grid" (default) draws from the rollout's own times;
  "uniform"; "logit_normal" mapped through the rollout schedule's shift, as
  flow_grpo. K = timesteps_per_pair = 2 (flow_grpo: 9 of 10; Flow-Factory: 1).
- ODE rollouts by default (flow_grpo: Flow-SDE); training uses the conditional
  velocity only.
- Times and noise come from a generator seeded by (seed, step, rank).
- `train.kl_beta` (default 1; 0 = the paper's loss) adds a velocity MSE to the
  reference, a term from outside the paper that neither public code has. By default
  (`train.kl_rows=all`) it covers every rollout row of the step (one flow time each,
  an extra forward of the policy and the reference per row), or only the pairs' rows
  (`pairs`). With `ema.enabled` (on by default here, decay 0.85), evaluation and
  best/ use an EMA of the weights, as flow_grpo's scripts do with train.ema (decay
  0.9). Together they keep the toy default from gaming its reward.
- Several ranks run the same number of minibatches (zero-weight padding), so DDP's
  collectives line up; a step with no pair on any rank takes no optimizer step.

Usage, the deviations in full, logged metrics and the measured runs:
docs/recipes/dpo.md (the sweep that chose the defaults: its "Defaults and reward
hacking"; the earlier runs: docs/tuning_dpo.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

import flywheel.quiet_interrupt  # first: run as a script, a Ctrl-C while torch loads is one line, no traceback
flywheel.quiet_interrupt.install(__name__)
import flywheel.openmp_env  # noqa: F401  before torch: OpenMP's idle threads sleep unless the user chose
import torch
import torch.nn.functional as F

from engine import Trajectory
from flywheel.cli import run_main
from flywheel.distributed import all_gather_cat, rank_and_world
from flywheel.rollout_collector import RolloutBatch
from flywheel.recipe.algorithm import ServesTrainedWeights, UpdateResult, gradient_result
from flywheel.recipe.flow_matching import matching_error, noised, velocity_mse
from flywheel.recipe.rollouts import check_layout_options
from flywheel.recipe.policy import Policy
from flywheel.recipe.preflight import warn_split_groups
from flywheel.recipe.rollouts import Rollouts
from flywheel.config.parsing import resolve_config
from flywheel.config.sections import EMAConfig, OptimConfig, RunConfig, SamplingConfig
from flywheel.config.validation import ABOVE_ZERO, check_advantage_unused, check_shared_sections, check_switched_keys
from flywheel.recipe.session import RecipeRun
from flywheel.recipe.training_loop import train
from flywheel.recipe.update import GradientSteps, trajectory_conditioning, update_generator
from rewards.registry import total_reward_span

# The stream of update_generator for DPO's flow times and noise (never equal to another recipe's draws).
DRAW_STREAM = 0x44504F  # "DPO"
ANCHOR_STREAM = 0x44504F41  # "DPOA": the flow times and noise of train.kl_rows=all's rows
PAIRINGS = ("best_worst", "all_pairs")


# ---------------------------------------------------------------------------------------
# Config: the algorithm's own keys (the optimizer and batching keys come from OptimConfig)
# ---------------------------------------------------------------------------------------


@dataclass
class DPOConfig(OptimConfig):
    MINIBATCH_UNIT: ClassVar[str] = "pairs"  # a step's pair count varies, so no divisibility check (rows only)

    learning_rate: float = 1e-3
    """AdamW learning rate (3e-4 is slower on the toy task: see the module docstring)"""
    beta: float = 10.0
    """beta of -log sigmoid(-beta·Delta): the paper's beta·T·omega(lambda_t) in one number (the public codes'
    beta/2); larger keeps the policy closer to the reference (50 was slower on the toy task)"""
    pairing: Literal["best_worst", "all_pairs"] = "best_worst"
    """"best_worst": one pair per group (its highest and lowest reward); "all_pairs": every i, j of a group with
    r_i - r_j > pair_margin"""
    pair_margin: float = 0.0
    """a pair needs r_winner - r_loser > pair_margin (reward units; 0 = any strict preference)"""
    timesteps_per_pair: int = 2
    """flow times K each pair is trained at per step (one shared noise draw per time)"""
    time_sampling: Literal["rollout_grid", "uniform", "logit_normal"] = "rollout_grid"
    """flow times: one of the rollout schedule's times in (0, 1]; t ~ U(0, 1); or sigmoid(N(0, 1)) under the
    schedule's time shift (public codes)"""
    minibatch_size: int = 64
    """pairs per training forward (each pair is two rows, winner and loser)"""
    kl_beta: float = 1.0
    """weight of the velocity MSE to the reference (over kl_rows' rows, mean of ||v_theta - v_ref||^2), added to the
    loss (0 = the paper's loss alone; 1 keeps the toy default from gaming its reward, docs/recipes/dpo.md)"""
    kl_rows: Literal["pairs", "all"] = "all"
    """the rows kl_beta pulls toward the reference: "pairs" (the trained winners and losers) or "all" (every rollout
    row of the step, at one flow time each from time_sampling: a class whose groups give no pair is held too); with
    kl_beta 0 there is no pull, so train.kl_beta=0 alone gives the paper's loss"""
    swap_pairs: bool = False
    """a control for tests: train every pair the wrong way round (loser as the winner); the reward must fall"""


@dataclass
class Config(RunConfig):
    run_dir: str = "runs/dpo-toy"
    """where config, metrics, samples and checkpoints go"""
    train: DPOConfig = field(default_factory=DPOConfig)
    # A pair is two final samples: no per-step log-probability is needed, so rollouts use the ODE.
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(sampler="ode"))
    # Evaluation (and best/) uses an EMA of the weights, as flow_grpo's scripts do with train.ema; its decay 0.85
    # (flow_grpo: 0.9) lags less (docs/recipes/dpo.md, "Defaults and reward hacking").
    ema: EMAConfig = field(default_factory=lambda: EMAConfig(enabled=True, decay=0.85))


# ---------------------------------------------------------------------------------------
# Pairs
# ---------------------------------------------------------------------------------------


@dataclass
class Pairs:
    """(winner, loser) row indices into a rank's rollouts, and each pair's reward gap r_w - r_l (all [P])."""

    winners: torch.Tensor
    losers: torch.Tensor
    reward_gap: torch.Tensor
    groups_used: int
    groups: int

    def __len__(self) -> int:
        return int(self.winners.numel())


def preference_pairs(rewards: torch.Tensor, valid: torch.Tensor, group_ids: torch.Tensor, pairing: str,
                     margin: float = 0.0) -> Pairs:
    """The pairs of one rank's rollouts, group by group in order of first appearance.

    best_worst: the highest and the lowest valid reward of a group (the first row
    of each on ties), if they differ by more than `margin`. all_pairs: every
    (i, j) of a group's valid rows with r_i - r_j > margin, i before j in row
    order for the outer loop. Rows whose reward is masked are never paired.
    """
    if pairing not in PAIRINGS:
        raise ValueError(f"train.pairing={pairing!r}: valid pairings are {', '.join(PAIRINGS)}")
    r = rewards.detach().float().cpu().tolist()
    ok = valid.detach().bool().cpu().tolist()
    members: dict[int, list[int]] = {}
    for row, g in enumerate(group_ids.detach().cpu().tolist()):
        members.setdefault(g, []).append(row)
    winners, losers, gaps, used = [], [], [], 0
    for rows in members.values():
        rows = [i for i in rows if ok[i]]
        if pairing == "best_worst":
            found = []
            if rows:
                best = max(rows, key=lambda i: (r[i], -i))
                worst = min(rows, key=lambda i: (r[i], i))
                found = [(best, worst)] if r[best] - r[worst] > margin else []
        else:
            found = [(i, j) for i in rows for j in rows if r[i] - r[j] > margin]
        used += bool(found)
        for w, lo in found:
            winners.append(w)
            losers.append(lo)
            gaps.append(r[w] - r[lo])
    return Pairs(torch.tensor(winners, dtype=torch.long), torch.tensor(losers, dtype=torch.long),
                 torch.tensor(gaps, dtype=torch.float32), used, len(members))


# ---------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------


def dpo_loss(v_w: torch.Tensor, v_l: torch.Tensor, v_ref_w: torch.Tensor, v_ref_l: torch.Tensor,
             x0_w: torch.Tensor, x0_l: torch.Tensor, noise: torch.Tensor, beta: float,
             weight: torch.Tensor | None = None, kl_beta: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Diffusion-DPO loss of P pairs: sum over pairs of weight·(-log sigmoid(-beta·Delta)), plus kl_beta times the
    pairs' weighted velocity MSE to the reference (1/2 of winner's plus loser's mean ||v_theta - v_ref||^2).

    v_w, v_l [P, ...]: the trained policy's velocities at the winner's and the
    loser's x_t = (1 - t)·x0 + t·noise (one t and one noise per pair); v_ref_*:
    the reference's at the same points (no gradient flows into them); weight [P]
    sums to 1 over the pairs that count (None: the mean over all P).
    """
    p = v_w.shape[0]
    if weight is None:
        weight = torch.full((p,), 1.0 / max(p, 1), device=v_w.device)
    weight = weight.float().to(v_w.device)
    e_w, e_l = matching_error(v_w, x0_w, noise), matching_error(v_l, x0_l, noise)
    ref_w = matching_error(v_ref_w.detach(), x0_w, noise)
    ref_l = matching_error(v_ref_l.detach(), x0_l, noise)
    delta = (e_w - ref_w) - (e_l - ref_l)
    margin = -beta * delta  # the implicit reward margin: > 0 when the policy prefers the winner more than ref
    dpo = (weight * -F.logsigmoid(margin)).sum()
    # The velocity MSE to the reference over both rows of each pair: how far the policy has moved.
    kl = (weight * 0.5 * (velocity_mse(v_w, v_ref_w) + velocity_mse(v_l, v_ref_l))).sum()
    loss = dpo + kl_beta * kl if kl_beta else dpo
    kl = kl.detach()
    m = margin.detach()
    stats = {
        "loss": loss.detach(),
        "ref_mse": kl,  # a velocity MSE, not a KL: its own key (GRPO's "kl" is a Gaussian KL)
        "dpo/implicit_acc": (weight * (m > 0).float()).sum(),
        "dpo/implicit_margin": (weight * m).sum(),
        "dpo/error_w": (weight * e_w.detach()).sum(),
        "dpo/error_l": (weight * e_l.detach()).sum(),
        "dpo/ref_error_w": (weight * ref_w).sum(),
        "dpo/ref_error_l": (weight * ref_l).sum(),
    }
    return loss, stats


# ---------------------------------------------------------------------------------------
# Flow times and noise of one update
# ---------------------------------------------------------------------------------------


def schedule_shift(timesteps: torch.Tensor) -> float:
    """The time shift s of a rollout schedule t_0 = 1 > ... > t_T = 0: t_i = s·l / (1 + (s - 1)·l) at
    l = 1 - i/T, so s = t·(1 - l) / (l·(1 - t)), read at the step nearest the middle (for a schedule that is
    not one shift of the linear one, such as FLUX's resolution-dependent one, the shift of its middle)."""
    t = timesteps.detach().double().cpu()
    steps = len(t) - 1
    if steps < 2:
        return 1.0
    i = steps // 2
    level, ti = 1.0 - i / steps, float(t[i])
    if not 0 < ti < 1:
        return 1.0
    return ti * (1 - level) / (level * (1 - ti))


def draw_times_and_noise(traj: Trajectory, n_pairs: int, tc: DPOConfig, generator: torch.Generator
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(times [P, K], noise [P, K, *latent]) on the CPU, times first: one t and one eps per pair and time."""
    k = tc.timesteps_per_pair
    if tc.time_sampling == "rollout_grid":
        schedule = traj.timesteps.detach().float().cpu()
        choices = schedule[(schedule > 0) & (schedule <= 1)]
        times = choices[torch.randint(len(choices), (n_pairs, k), generator=generator)]
    elif tc.time_sampling == "uniform":
        times = torch.rand((n_pairs, k), generator=generator)
    elif tc.time_sampling == "logit_normal":
        shift = schedule_shift(traj.timesteps)
        u = torch.sigmoid(torch.randn((n_pairs, k), generator=generator))
        times = shift * u / (1 + (shift - 1) * u)
    else:
        raise ValueError(f"train.time_sampling={tc.time_sampling!r}: use rollout_grid, uniform or logit_normal")
    noise = torch.randn((n_pairs, k, *traj.latents.shape[2:]), generator=generator)
    return times, noise


# ---------------------------------------------------------------------------------------
# The update
# ---------------------------------------------------------------------------------------


def padded_pair_count(n_local: int) -> int:
    """The most pairs any rank has this step: every rank runs that many pair slots (DDP needs equal backwards)."""
    _, world = rank_and_world()
    if world == 1:
        return n_local
    return int(all_gather_cat(torch.tensor([n_local], dtype=torch.long)).max())


class DPO(ServesTrainedWeights):
    """Online Diffusion-DPO's update behind the algorithm protocol (flywheel/recipe/algorithm.py): the policy
    (whose `ref_velocity` is the reference's), its optimizer and the config; it samples with the trained weights
    and keeps no tensors of its own. `transformer` is the trained module as prepared (DDP-wrapped on several
    ranks)."""

    def __init__(self, policy: Policy, optimizer, transformer, cfg, accelerator):
        self.policy, self.optimizer, self.transformer, self.cfg = policy, optimizer, transformer, cfg
        self.accelerator = accelerator

    def update(self, batch: RolloutBatch, step: int) -> UpdateResult:
        """One DPO update over this rank's rollouts: pairs, minibatches of pairs x K flow times, optimizer step(s);
        none when no rank has a pair."""
        cfg, tc, policy = self.cfg, self.cfg.train, self.policy
        traj: Trajectory = batch.trajectory
        pairs = preference_pairs(batch.rewards.total, batch.rewards.valid, batch.group_ids, tc.pairing,
                                 tc.pair_margin)
        real = len(pairs)
        slots = padded_pair_count(real)
        pair_metrics = {"dpo/pairs": float(real), "dpo/groups_used": pairs.groups_used / max(pairs.groups, 1),
                        "dpo/reward_gap": float(pairs.reward_gap.mean()) if real else 0.0}
        if slots == 0:
            return UpdateResult({**pair_metrics, "dpo/no_pair": 1.0, "train/optimizer_steps": 0.0}, False,
                                f"no preference pair (no group had a reward gap over train.pair_margin="
                                f"{tc.pair_margin})")
        winners, losers = (pairs.losers, pairs.winners) if tc.swap_pairs else (pairs.winners, pairs.losers)
        # Slots past this rank's pairs hold row 0 against itself with weight 0: forwards for DDP, no gradient.
        fill = torch.zeros(slots - real, dtype=torch.long)
        winners, losers = torch.cat([winners, fill]), torch.cat([losers, fill])
        counts = torch.cat([torch.ones(real), torch.zeros(slots - real)])

        device = traj.latents.device
        x0_all = traj.latents[:, -1].float()
        k = tc.timesteps_per_pair
        times, noise = draw_times_and_noise(traj, slots, tc, update_generator(cfg.seed, step,
                                                                              self.accelerator.process_index,
                                                                              DRAW_STREAM))
        grads = GradientSteps(self.accelerator, self.transformer, self.optimizer, policy.named_params, tc, step)
        minibatches = grads.minibatches(slots)
        anchored = tc.kl_beta > 0 and tc.kl_rows == "all"
        if anchored:
            # Every row of the step, spread over the minibatches (each rank has the same rows and minibatches).
            anchor_rows = [list(range(m, len(traj), len(minibatches))) for m in range(len(minibatches))]
            anchor_t, anchor_eps = draw_times_and_noise(traj, len(traj), replace(tc, timesteps_per_pair=1),
                                                        update_generator(cfg.seed, step,
                                                                         self.accelerator.process_index,
                                                                         ANCHOR_STREAM))
        for m, slot in enumerate(minibatches):
            w_rows, l_rows = winners[slot].tolist(), losers[slot].tolist()
            n = len(slot)
            # Winners then losers in one forward, each with its own prompt's conditioning (the same prompt per pair).
            cond, _ = trajectory_conditioning(traj.select(w_rows + l_rows), use_cfg=False)
            x0 = torch.cat([x0_all[w_rows], x0_all[l_rows]])
            weight = (counts[slot] / counts[slot].sum().clamp(min=1.0)).to(device)
            for i in range(k):
                t = times[slot, i].to(device).repeat(2)
                eps = noise[slot, i].to(device).repeat(2, *([1] * (noise.dim() - 2)))
                x_t = noised(x0, eps, t)
                with torch.no_grad():
                    v_ref = policy.ref_velocity(x_t, t, cond)
                last = i == k - 1 and not (anchored and anchor_rows[m])
                with grads.microstep(m, last_of_minibatch=last):
                    v = policy.velocity(self.transformer, x_t, t, cond)
                    loss, stats = dpo_loss(v[:n], v[n:], v_ref[:n], v_ref[n:], x0[:n], x0[n:], eps[:n], tc.beta,
                                           weight, 0.0 if anchored else tc.kl_beta)
                    grads.backward(loss / grads.backwards_per_step(k))
                grads.record({**stats, "t/mean": (weight * t[:n]).sum()})
            if anchored and anchor_rows[m]:
                rows = anchor_rows[m]
                with grads.microstep(m, last_of_minibatch=True):
                    loss, anchor_mse = self.anchor_loss(traj.select(rows), x0_all[rows], anchor_t[rows, 0].to(device),
                                                        anchor_eps[rows, 0].to(device), tc.kl_beta, len(traj))
                    grads.backward(loss)
                grads.record({"dpo/anchor_mse": anchor_mse})
            grads.maybe_step(m)
        return gradient_result({**grads.metrics(), **pair_metrics, "dpo/no_pair": 0.0})

    def anchor_loss(self, rows: Trajectory, x0: torch.Tensor, t: torch.Tensor, eps: torch.Tensor, kl_beta: float,
                    total_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """train.kl_rows=all: kl_beta times these rows' share of the step's mean velocity MSE to the reference (the
        sum over their rows of mean|v_theta - v_ref|^2, over `total_rows`), and their mean MSE for the log."""
        cond, _ = trajectory_conditioning(rows, use_cfg=False)
        x_t = noised(x0, eps, t)
        with torch.no_grad():
            v_ref = self.policy.ref_velocity(x_t, t, cond)
        v = self.policy.velocity(self.transformer, x_t, t, cond)
        mse = velocity_mse(v, v_ref)
        return kl_beta * mse.sum() / total_rows, mse.detach().mean()


# ---------------------------------------------------------------------------------------
# Config checks
# ---------------------------------------------------------------------------------------


def check_pair_margin_reachable(cfg: Config, checks) -> None:
    """A pair margin at or over the widest reward gap the scorers can give (their declared ranges) makes no pair
    on any step: the run would go through every step, train nothing and exit 3."""
    try:
        span = total_reward_span(cfg.reward.scorers)
    except (KeyError, ValueError, ImportError):
        return  # the reward checks name a bad spec or scorer
    if span is not None and cfg.train.pair_margin >= span:
        checks.fail(f"train.pair_margin={cfg.train.pair_margin:g}: no pair can have a reward gap over it, since "
                    f"reward.scorers={cfg.reward.scorers} spans at most {span:g} (the scorers' ranges times their "
                    f"weights); use 0 <= train.pair_margin < {span:g}")


# DPO's keys that act only when their switch is on (check_switched_keys): set away from the default with the
# switch off, they would be ignored.
DPO_SWITCHED_KEYS = (
    ("train.kl_beta", ABOVE_ZERO, ("train.kl_rows",)),  # kl_beta 0: no pull on any rows
)


MAX_TIMESTEPS_PER_PAIR = 1000  # loss terms a pair, each a forward of both samples: a bound for typos


def validate_config(cfg: Config) -> None:
    """Check every field before anything runs: one ConfigError listing each bad key and what is valid."""
    checks = check_shared_sections(cfg)
    check_switched_keys(cfg, checks, DPO_SWITCHED_KEYS)
    check_layout_options(cfg, checks)  # async, Ray, workflow: the table of what combines
    checks.require("train.beta", lambda v: v > 0, "must be > 0 (the strength of the pull toward the reference)")
    checks.require("train.kl_beta", lambda v: v >= 0, "must be >= 0 (0 = the paper's loss alone)")
    checks.require("train.pair_margin", lambda v: v >= 0, "must be >= 0 (reward units; 0 = any strict preference)")
    check_pair_margin_reachable(cfg, checks)
    checks.require("train.timesteps_per_pair", lambda v: 1 <= v <= MAX_TIMESTEPS_PER_PAIR,
                   f"must be an integer in [1, {MAX_TIMESTEPS_PER_PAIR}]")
    if cfg.train.gradient_accumulation_steps != 1 or cfg.train.updates_per_rollout not in (None, 1):
        checks.fail(f"train.gradient_accumulation_steps={cfg.train.gradient_accumulation_steps}, "
                    f"train.updates_per_rollout={cfg.train.updates_per_rollout}: the number of pairs (so of "
                    "minibatches) changes from step to step; use gradient_accumulation_steps=1 with "
                    "updates_per_rollout=null (one optimizer step per minibatch of pairs) or updates_per_rollout=1 "
                    "(one optimizer step per rollout)")
    if cfg.reward.aggregation != "weighted_sum":
        checks.fail(f"reward.aggregation={cfg.reward.aggregation}: DPO ranks samples by their total reward; use "
                    "reward.aggregation=weighted_sum")
    check_advantage_unused(cfg, checks, "DPO", "it pairs samples by their total reward")
    if cfg.rollout.asynchronous:
        checks.fail("rollout.asynchronous=true: this recipe trains on the current policy's samples; set rollout.asynchronous=false")
    checks.raise_if_any()
    warn_split_groups(cfg, "DPO pairs each group within each process's share, so a group's best and worst samples "
                      "may never be paired")


# ---------------------------------------------------------------------------------------
# Main: the policy and its reference, the algorithm, the rollouts, then the training loop
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    cfg = resolve_config(Config, sys.argv[1:] if argv is None else argv, recipe="dpo")
    validate_config(cfg)
    run = RecipeRun(cfg, recipe="dpo")
    policy, transformer, optimizer = run.trained_policy(reference=True)
    dpo = DPO(policy, optimizer, transformer, cfg, run.accelerator)
    dpo.load_state_dict(run.recipe_tensors)
    rollouts = Rollouts(cfg, run.accelerator, policy, run.version, run.trainer_state)
    return train(run, rollouts, dpo)


if __name__ == "__main__":
    run_main(main)
