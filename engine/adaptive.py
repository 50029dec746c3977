"""The content-adaptive denoise loop: reuse a row's cached velocity while it barely changes, exit on convergence.

`engine.denoise.denoise` calls the transformer at every step. This loop calls it
only for the rows that need it (the cache idea of TeaCache and cache-dit),
for ODE requests (evaluation, serving) and for the deterministic tail of a
rollout.

When a row is skipped. Each row keeps the velocity of its last model call
and how fast its velocity has been changing: after two calls at flow times
t_j > t_k, `rate = d(v_j, v_k) / (t_j - t_k)`, with d the relative L1 change
mean|v_k - v_j| / mean|v_k|. At a later step t_m the change since the last
call is estimated as `rate · (t_k - t_m)`: it grows with every skipped step
(the skipped change accumulates, so a long run of skips forces a call), and
the row is skipped while it is below the row's `cache_threshold`. A call
resets the estimate and measures the rate again over the interval it spans.
So `cache_threshold` reads as "the relative velocity change a row may go
without a model call"; 0 never skips. Why the velocity and not the input:
along an ODE the input x moves by dt·v at every step whatever the model
predicts, so its change says little; the velocity is what is reused.

What a skipped step uses (`cache_order`, per row). 1 (the default): the line
through the row's last two calls, v_k + (v_k - v_j)·(t_k - t_m) / (t_j - t_k),
evaluated at t_m, so a velocity that drifts steadily is followed instead of
frozen (the forecasting idea of TaylorSeer, first order); its correction is at
most the estimated change, so the threshold bounds it too. On toy-digits at
10 steps it halves the image change of plain reuse at the same number of
calls (benchmarks/adaptive_loop.py). 0: the last call's velocity as it is.

Early exit. After a call the row's data prediction x0 = x - t·v is compared
with the one of its previous call: its relative change per unit flow time,
times the flow time left (t → 0), is the change still to come if it went on
at that pace. When that is below the row's `early_exit` tolerance the row
has converged and every later step takes its last call's velocity (order 0,
whatever its `cache_order`) without a call.
Measured per unit time, so a tolerance means the same at 10 steps as at 50
(a change per step would shrink with the step size and exit ever earlier).
Euler steps with a fixed v keep
x - t·v fixed, so the row lands on that prediction at t = 0: the same point
as jumping to t = 0 with the last velocity. The steps are still taken one
by one (one vector op each, no model) so that every row keeps its T + 1
states and a ragged batch keeps one shape.

Rollouts (sampler "sde" / "cps"). Only the ODE steps after the last
stochastic step may be skipped (`skip_from`): every step before it is
computed exactly as the plain loop does, so the states and log-probs of the
trained steps equal the plain loop's bit for bit. Skipping the ODE steps
before the window would move the state the window starts from, so it is not
done. A `skip_from` that leaves a stochastic step skippable is an error.

Ragged batches. Rows decide alone. The rows that need the model at a step
run as one sub-batch (the whole batch when all do, nothing when none does),
and the others keep their cached velocity. A row's result therefore equals
running it alone up to the model's batch-size rounding (<= 1e-5 on CPU, as
the plain engine documents); a skip decision whose estimate sits within that
rounding of its threshold could go either way. A row that asks for nothing
(threshold 0, no early exit) but shares a batch with rows that do runs here
too: it calls the model at every step, in a sub-batch when others skip, so it
equals the plain loop within that same rounding, not bit for bit.

The host. Unlike the plain loop this one reads two numbers per computed row
per step back to the host (the velocity and prediction changes) and
branches on them: skipping a model call is a host decision (TeaCache and
cache-dit make it the same way). With every threshold 0 and no early exit it
reads nothing and takes the plain loop's steps, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.cards import FlowModel, PromptEmbeds
from engine.denoise import guided_velocity
from engine.sampling import cps_step, ode_step, sde_step, sde_t_cap


@dataclass
class RowCache:
    """What one row remembers between steps (host values; its cached velocity lives in the batch tensor)."""

    last_t: float | None = None
    """flow time of the row's last model call (None: never called)"""
    previous_t: float | None = None
    """flow time of the call before it (None: fewer than two calls)"""
    rate: float | None = None
    """relative velocity change per unit flow time between its last two calls (None: fewer than two)"""
    exited: bool = False
    """converged (early exit): every later skippable step reuses the cached velocity"""

    def estimated_change(self, t: float) -> float | None:
        """The relative velocity change accumulated since the last call, at flow time t (None: unknown)."""
        if self.rate is None or self.last_t is None:
            return None
        return self.rate * (self.last_t - t)

    def should_skip(self, t: float, threshold: float) -> bool:
        """Whether a skippable step at flow time t may reuse the cached velocity."""
        if self.exited:
            return True
        change = self.estimated_change(t)
        return change is not None and change < threshold

    def record_call(self, t: float, velocity_change: float | None, prediction_change: float | None,
                    early_exit: float | None) -> None:
        """Update after a model call at t; the changes are relative to the previous call (None on the first)."""
        if self.last_t is not None and self.last_t > t:
            if velocity_change is not None:
                self.rate = velocity_change / (self.last_t - t)
            if early_exit is not None and prediction_change is not None:
                still_to_come = prediction_change / (self.last_t - t) * t
                self.exited = still_to_come < early_exit
        self.previous_t, self.last_t = self.last_t, t

    def extrapolation(self, t: float, order: int) -> float:
        """The weight w of a skipped step at t: it uses v_last + w·(v_last - v_previous), the line through the
        last two calls at order 1; 0 (the last call's velocity) at order 0, after an early exit, or with fewer
        than two calls."""
        if order == 0 or self.exited or self.previous_t is None or self.last_t is None:
            return 0.0
        return (self.last_t - t) / (self.previous_t - self.last_t)


@dataclass
class AdaptiveResult:
    """latents [B, T+1 or 1, *latent], log_probs [B, T] on the device; computed [B, T] bool on the host (True:
    the step called the model for that row), where the skip decisions were made."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    computed: torch.Tensor

    @property
    def steps_computed(self) -> torch.Tensor:
        """Model calls per row [B] (int64, host)."""
        return self.computed.sum(dim=1)


def relative_change(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Per-row relative L1 change mean|new - old| / mean|new| [B] (0 / 0 reads as 0)."""
    size = new.abs().flatten(1).mean(dim=1)
    diff = (new - old).abs().flatten(1).mean(dim=1)
    return diff / size.clamp(min=torch.finfo(size.dtype).tiny)


def select_embeds(embeds: PromptEmbeds, index: torch.Tensor) -> PromptEmbeds:
    """The rows `index` of a conditioning (every batch-first tensor, extra included)."""
    return PromptEmbeds(embeds.embeds.index_select(0, index), embeds.pooled.index_select(0, index),
                        None if embeds.mask is None else embeds.mask.index_select(0, index),
                        None if embeds.extra is None else {k: v.index_select(0, index) for k, v in embeds.extra.items()})


CACHE_ORDERS = (0, 1)


def first_skippable_step(noise_levels: Sequence[float]) -> int:
    """The first step after the last stochastic one (0 for an ODE run): where skipping may start."""
    stochastic = [k for k, level in enumerate(noise_levels) if level != 0.0]
    return stochastic[-1] + 1 if stochastic else 0


class AdaptiveLoop:
    """The adaptive denoise loop with per-row settings (see the module docstring).

    cache_thresholds: per row, the relative velocity change it may go without a model call (0 = never skip);
    early_exits: per row, the projected relative change of the data prediction until t = 0 below which it has
    converged (None = never exits); cache_orders: per row, what a skipped step uses, 1 = the line through the
    last two calls, 0 = the last call's velocity (None = 1 for every row).
    """

    def __init__(self, cache_thresholds: Sequence[float], early_exits: Sequence[float | None],
                 cache_orders: Sequence[int] | None = None):
        cache_orders = [1] * len(cache_thresholds) if cache_orders is None else list(cache_orders)
        if not len(cache_thresholds) == len(early_exits) == len(cache_orders):
            raise ValueError(f"one cache threshold, early-exit setting and cache order per row: got "
                             f"{len(cache_thresholds)} thresholds, {len(early_exits)} early-exit settings and "
                             f"{len(cache_orders)} orders")
        for i, threshold in enumerate(cache_thresholds):
            if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
                raise ValueError(f"cache_thresholds[{i}]={threshold!r}: a cache threshold is a finite number >= 0 "
                                 f"(0 = never skip)")
        for i, tolerance in enumerate(early_exits):
            if tolerance is not None and not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance)
                                              and tolerance > 0):
                raise ValueError(f"early_exits[{i}]={tolerance!r}: an early-exit tolerance is a finite number > 0, "
                                 f"or None for no early exit")
        for i, order in enumerate(cache_orders):
            if order not in CACHE_ORDERS or isinstance(order, bool):
                raise ValueError(f"cache_orders[{i}]={order!r}; valid: 0 (reuse the last call's velocity) or 1 "
                                 f"(extrapolate from the last two calls)")
        self.cache_thresholds = [float(x) for x in cache_thresholds]
        self.early_exits = [None if x is None else float(x) for x in early_exits]
        self.cache_orders = [int(x) for x in cache_orders]

    @property
    def adaptive(self) -> bool:
        """Whether any row may ever skip (otherwise the loop is the plain one, with no host reads)."""
        return any(x > 0 for x in self.cache_thresholds) or any(x is not None for x in self.early_exits)

    @torch.no_grad()
    def __call__(self, model: FlowModel, transformer: nn.Module, initial_noise: torch.Tensor,
                 step_noise: torch.Tensor | None, timesteps: torch.Tensor, noise_levels: list[float],
                 cond: PromptEmbeds, uncond_cond: PromptEmbeds | None, guidance_scale: float,
                 keep_trajectory: bool = True, sampler: str = "sde", skip_from: int | None = None) -> AdaptiveResult:
        """Run from noise to data; the arguments are `engine.denoise.denoise`'s.

        skip_from: the first step that may be skipped; None = after the last stochastic step (the only
        place a rollout may skip). A value that leaves a stochastic step skippable is refused.
        """
        batch, steps = initial_noise.shape[0], len(noise_levels)
        if batch != len(self.cache_thresholds):
            raise ValueError(f"the loop has settings for {len(self.cache_thresholds)} rows but the batch has {batch}")
        earliest = first_skippable_step(noise_levels) if step_noise is not None else 0
        if skip_from is None:
            skip_from = earliest
        if skip_from < earliest:
            raise ValueError(f"skip_from={skip_from} would let stochastic step {earliest - 1} be skipped: a trained "
                             f"step's log-prob must come from its own model call; valid: skip_from >= {earliest} "
                             f"(after the last stochastic step)")
        x = initial_noise.float()
        latents = torch.empty((batch, steps + 1 if keep_trajectory else 1, *x.shape[1:]), dtype=torch.float32,
                              device=x.device)
        log_probs = torch.zeros((batch, steps), dtype=torch.float32, device=x.device)
        computed = torch.ones((batch, steps), dtype=torch.bool)  # host: decisions are made there
        if keep_trajectory:
            latents[:, 0] = x
        adaptive = self.adaptive
        times = timesteps.tolist() if adaptive else None  # one read before the loop
        state = _BatchCache([RowCache() for _ in range(batch)])
        t_cap = sde_t_cap(timesteps)
        for k in range(steps):
            t, t_next = timesteps[k], timesteps[k + 1]
            stochastic = step_noise is not None and noise_levels[k] != 0.0
            if adaptive and k >= skip_from:
                need = [i for i in range(batch) if not state.rows[i].should_skip(times[k], self.cache_thresholds[i])]
            else:
                need = list(range(batch))
            if len(need) == batch:  # every row: one call on the whole batch, as the plain loop
                v = guided_velocity(model, transformer, x, t, cond, uncond_cond, guidance_scale)
            else:
                v = self._skipped_velocity(state, times[k], x.device)
                if need:
                    index = torch.tensor(need, dtype=torch.long, device=x.device)
                    v = v.index_copy(0, index, self._call(model, transformer, x, t, cond, uncond_cond,
                                                          guidance_scale, index).to(v.dtype))
                for i in set(range(batch)) - set(need):
                    computed[i, k] = False
            if adaptive and need:
                self._record_calls(state, need, x, v, t, times[k])
            if stochastic and sampler == "cps":
                x, log_probs[:, k] = cps_step(x, v, t, t_next, noise_levels[k], step_noise[:, k])
            elif stochastic:
                x, log_probs[:, k] = sde_step(x, v, t, t_next, noise_levels[k], step_noise[:, k], t_cap)
            else:
                x = ode_step(x, v, t, t_next)
            if keep_trajectory:
                latents[:, k + 1] = x
        if not keep_trajectory:
            latents[:, 0] = x
        return AdaptiveResult(latents, log_probs, computed)

    @staticmethod
    def _call(model: FlowModel, transformer: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds,
              uncond_cond: PromptEmbeds | None, guidance_scale: float, index: torch.Tensor) -> torch.Tensor:
        """The model's velocity for the rows `index` only (a sub-batch)."""
        batch = x.shape[0]
        # The unconditional branch is stacked before the conditional one: row i sits at i and batch + i.
        sub_uncond = None if uncond_cond is None else select_embeds(uncond_cond, torch.cat([index, index + batch]))
        return guided_velocity(model, transformer, x.index_select(0, index), t, select_embeds(cond, index),
                               sub_uncond, guidance_scale)

    def _skipped_velocity(self, state: "_BatchCache", t: float, device: torch.device) -> torch.Tensor:
        """Every row's velocity from its cache at t: the last call's, plus w·(its change since the call before)."""
        weights = [row.extrapolation(t, order) for row, order in zip(state.rows, self.cache_orders)]
        if not any(weights):
            return state.last
        w = torch.tensor(weights, dtype=state.last.dtype, device=device).view(-1, *[1] * (state.last.dim() - 1))
        return state.last + w * (state.last - state.previous)

    def _record_calls(self, state: "_BatchCache", need: list[int], x: torch.Tensor, v: torch.Tensor,
                      t: torch.Tensor, t_host: float) -> None:
        """Measure each called row's velocity and prediction change since its previous call (one host read),
        update its RowCache, and keep the called rows' velocities and data predictions."""
        index = torch.tensor(need, dtype=torch.long, device=x.device)
        fresh = v.index_select(0, index)
        prediction = (x - t * v).index_select(0, index)
        if state.last is None:
            changes = [(None, None)] * len(need)
        else:
            changes = torch.stack([relative_change(fresh, state.last.index_select(0, index)),
                                   relative_change(prediction, state.prediction.index_select(0, index))],
                                  dim=1).tolist()
        for i, (velocity_change, prediction_change) in zip(need, changes):
            first_call = state.rows[i].last_t is None
            state.rows[i].record_call(t_host, None if first_call else velocity_change,
                                      None if first_call else prediction_change, self.early_exits[i])
        if state.last is None:  # the first step calls every row
            state.last, state.previous, state.prediction = v, v, x - t * v
            return
        state.previous = state.previous.index_copy(0, index, state.last.index_select(0, index))
        state.last = state.last.index_copy(0, index, fresh)
        state.prediction = state.prediction.index_copy(0, index, prediction)


@dataclass
class _BatchCache:
    """The rows' host state and their cached device tensors [B, *latent]: the velocity of each row's last call,
    of the call before it, and the data prediction x - t·v of its last call (None before the first step)."""

    rows: list[RowCache]
    last: torch.Tensor | None = None
    previous: torch.Tensor | None = None
    prediction: torch.Tensor | None = None


def adaptive_loop_for(requests: Sequence) -> AdaptiveLoop | None:
    """The adaptive loop for a batch of GenerationRequests when any asks for it (None: the plain loop).

    Rows that ask for nothing get threshold 0 and no early exit: they call the model at every step.
    """
    if not any(r.adaptive for r in requests):
        return None
    return AdaptiveLoop([r.cache_threshold for r in requests], [r.early_exit for r in requests],
                        [r.cache_order for r in requests])


def check_adaptive_path(card_id: str, sampler: str, folder_scheduler: bool, multistep: bool,
                        joint_audio: bool) -> None:
    """Refuse, naming the reason, the engine paths the adaptive loop does not take (it reuses velocities in
    the engine's own Euler, Flow-SDE and CPS steps only)."""
    if folder_scheduler:
        raise ValueError(f"cache_threshold / early_exit: card {card_id!r} steps ODE requests with its folder's own "
                         f"scheduler (not plain Euler), whose multistep state a reused velocity would corrupt; "
                         f"valid: cache_threshold=0 and early_exit=None on this card")
    if multistep:
        raise ValueError("cache_threshold / early_exit cannot combine with MixGRPO-Flash's compressed tail "
                         "(Engine.flash_compress), which already thins the ODE steps after the window; use one")
    if joint_audio and sampler != "ode":
        raise ValueError(f"cache_threshold / early_exit: rollouts of card {card_id!r} step audio and video elements "
                         f"at their own noise levels, which the adaptive loop does not take; valid there: "
                         f"sampler='ode' (evaluation, serving)")
