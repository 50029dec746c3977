"""The gradient side of an update, the same for every recipe: minibatches, gradient accumulation, clipping,
and optimizer steps guarded against non-finite numbers. No weight sync: the training loop syncs once after an
update that stepped (flywheel/recipe/algorithm.py).

A recipe's update reads:

    grads = GradientSteps(accelerator, transformer, optimizer, named_params, cfg.train, step)
    for m, rows in enumerate(grads.minibatches(len(batch))):
        for k in range(K):                                   # K loss terms per minibatch (timesteps...)
            with grads.microstep(m, last_of_minibatch=k == K - 1):   # the forward too: see `microstep`
                loss, stats = my_loss(...)
                grads.backward(loss / grads.backwards_per_step(K))
            grads.record(stats)
        grads.maybe_step(m)
    return gradient_result(grads.metrics())            # flywheel.recipe.algorithm.UpdateResult
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from engine import PromptEmbeds, Trajectory
from engine.denoise import concat_embeds
from flywheel.guards import check_finite, check_finite_weights


def trajectory_conditioning(traj: Trajectory, use_cfg: bool) -> tuple[PromptEmbeds, PromptEmbeds | None]:
    """(cond, uncond+cond) prompt embeddings of a trajectory batch for a training forward.

    The second is None without guidance (or without negative embeddings): the forward is conditional only.
    """
    cond = PromptEmbeds(traj.prompt_embeds, traj.pooled_prompt_embeds, traj.prompt_mask, traj.condition_extra)
    if not use_cfg or traj.negative_prompt_embeds is None:
        return cond, None
    uncond = PromptEmbeds(traj.negative_prompt_embeds, traj.negative_pooled_prompt_embeds, traj.negative_prompt_mask,
                          traj.condition_extra)
    return cond, concat_embeds(uncond, cond)


def update_generator(seed: int, step: int, rank: int = 0, stream: int = 0) -> torch.Generator:
    """A CPU generator for an update's random draws (flow times, noise): a function of (seed, step, rank,
    stream) only, so a resumed run draws what an uninterrupted one did. `stream` keeps a recipe's draws
    apart from other users of the same seed (numpy's SeedSequence mixes the words; 63 bits for torch)."""
    state = np.random.SeedSequence([seed, step, rank, stream]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state >> np.uint64(1)))


def accumulation_steps(n_minibatches: int, oc) -> int:
    """Minibatches per optimizer step: train.gradient_accumulation_steps, or n / train.updates_per_rollout."""
    if oc.updates_per_rollout is not None:
        if n_minibatches % oc.updates_per_rollout:
            raise ValueError(f"train.updates_per_rollout={oc.updates_per_rollout} does not divide the "
                             f"{n_minibatches} minibatches of a step on this rank: choose a divisor of {n_minibatches}"
                             f" or change train.minibatch_size")
        return n_minibatches // oc.updates_per_rollout
    if n_minibatches % oc.gradient_accumulation_steps:
        raise ValueError(f"{n_minibatches} minibatches per step is not a multiple of "
                         f"train.gradient_accumulation_steps={oc.gradient_accumulation_steps}")
    return oc.gradient_accumulation_steps


class GradientSteps:
    """Backward passes and optimizer steps of one update over this rank's rollouts.

    Stops with NonFiniteError before an optimizer step whose gradient norm is
    not finite, and right after one that leaves a non-finite weight. Gradients
    are all-reduced once per optimizer step (`microstep`: no_sync on the other forward-backwards).
    Metrics are averaged over the recorded minibatch terms; keys ending in
    "max_dev" or "/max" keep their maximum.
    """

    def __init__(self, accelerator, transformer, optimizer, named_params, oc, step: int):
        self.accelerator, self.transformer, self.optimizer = accelerator, transformer, optimizer
        self.named_params, self.oc, self.step = named_params, oc, step
        self.params = [p for _, p in named_params]
        self.accumulation = 1
        self.n_minibatches = 0
        self._totals: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._grad_norms: list[torch.Tensor] = []

    def minibatches(self, n: int) -> list[list[int]]:
        """Row indices of this rank's minibatches (train.minibatch_size rows each, the last may be shorter)."""
        size = self.oc.minibatch_size
        out = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        self.n_minibatches = len(out)
        self.accumulation = accumulation_steps(len(out), self.oc)
        return out

    def backwards_per_step(self, per_minibatch: int) -> int:
        """How many backward passes one optimizer step sums: divide each loss by it to average them."""
        return per_minibatch * self.accumulation

    def microstep(self, minibatch: int, last_of_minibatch: bool) -> contextlib.AbstractContextManager:
        """The context of one loss term's forward and backward: gradients are all-reduced only by the last
        backward before an optimizer step (no_sync around the others).

        The forward must be inside: DDP and FSDP decide at the forward whether its backward reduces. With the
        backward alone in no_sync, every backward reduced, and ranks that ran different numbers of them in a
        minibatch (Flow-GRPO-Fast's per-trajectory windows) mismatched their collectives and stopped."""
        syncs = last_of_minibatch and (minibatch + 1) % self.accumulation == 0
        return contextlib.nullcontext() if syncs else self.accelerator.no_sync(self.transformer)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() (inside `microstep`, which decides whether it all-reduces)."""
        self.accelerator.backward(loss)

    def record(self, stats: dict[str, torch.Tensor]) -> None:
        for k, v in stats.items():
            v = v.detach()
            if k.endswith(("max_dev", "/max")):
                self._totals[k] = torch.maximum(self._totals.get(k, v), v)
                self._counts[k] = 1
            else:
                self._totals[k] = self._totals.get(k, 0.0) + v
                self._counts[k] = self._counts.get(k, 0) + 1

    def maybe_step(self, minibatch: int) -> bool:
        """After minibatch `minibatch`: an optimizer step when its accumulation group is complete."""
        if (minibatch + 1) % self.accumulation:
            return False
        grad_norm = self.accelerator.clip_grad_norm_(self.params, self.oc.max_grad_norm)
        # Gradients are all-reduced: every rank sees the same norm and stops together.
        check_finite(grad_norm, "the gradient norm", self.step + 1, "the loss or the rollouts went NaN/inf")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        check_finite_weights(self.named_params, self.step + 1, "lower train.learning_rate or train.max_grad_norm")
        self._grad_norms.append(grad_norm.detach())
        return True

    def metrics(self) -> dict[str, float]:
        """The update's metrics: mean (or max) of each recorded stat, the grad norm, the optimizer steps taken."""
        out = {k: float(v / self._counts[k]) for k, v in self._totals.items()}
        if self._grad_norms:
            out["grad_norm"] = float(torch.stack(self._grad_norms).mean())
        out["train/optimizer_steps"] = float(len(self._grad_norms))  # the loop counts the steps that took none
        return out
