"""The algorithm protocol: what a recipe (trainers/<algo>.py) gives the training loop.

A recipe is a class that holds its policy, its optimizer and its config, and
answers four calls. The training loop (`flywheel.recipe.training_loop`) calls
them; nothing else does.

    class MyAlgorithm:                                   # trainers/<algo>.py
        def update(self, batch, step) -> UpdateResult     # the gradient steps of one training step
        def serving_weights(self) -> ContextManager       # the weights rollouts and weight sync see
        def state_dict(self) -> dict[str, Tensor]         # the recipe's own tensors, for a checkpoint
        def load_state_dict(self, state) -> None          # ... and back, on resume (strict)

`update(batch, step)`: run this rank's backward passes and optimizer steps on
the `RolloutBatch` of training step `step` (0-based), and move whatever the
algorithm keeps beside the trained weights (NFT's theta_old, AWM's EMA anchor)
once the optimizer steps are done. Return `UpdateResult(metrics, stepped)`:
`metrics` are floats (they are averaged over the ranks and logged, and must
include "train/optimizer_steps", the count `GradientSteps.metrics()` gives);
`stepped` says whether any optimizer step was taken, and `skip_reason` why
not when none was. The update never syncs weights and never touches the
weight version: it has no handle on the engine.

`serving_weights()`: a context manager inside which the trained module holds
the weights the rollouts must sample with. The loop enters it around every
rollout collection and every weight sync, so a sync pushes those weights into
serving. It is `contextlib.nullcontext()` for a recipe whose sampling policy is
the trained one (GRPO, AWM, DPO); NFT swaps theta_old in (`Policy.weights_swapped`).
Evaluation samples the trained weights (or the EMA average), never these.

`state_dict()` / `load_state_dict(state)`: the tensors of the recipe's own
(name -> tensor), checkpointed under "recipe/" beside the trained weights and
handed back on resume before the first step; `{}` for a recipe with none.
Their names are the checkpoint format: keep them stable.

Who owns the weight version: the loop. After an update that stepped, it calls
`Rollouts.sync()` once (inside `serving_weights()`), which publishes the new
weights to the engine and bumps the version by one; an update that took no
optimizer step is not synced, and the version stays. So the version counts the
updates that moved the weights, not optimizer steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class UpdateResult:
    """What one update did: its metrics, whether an optimizer step moved the weights, and why not if none did."""

    metrics: dict[str, float]
    stepped: bool
    skip_reason: str | None = field(default=None)

    def __post_init__(self):
        if "train/optimizer_steps" not in self.metrics:
            raise ValueError("an update's metrics must hold 'train/optimizer_steps' (how many optimizer steps it "
                             "took: GradientSteps.metrics gives it)")
        if self.stepped != (self.metrics["train/optimizer_steps"] > 0):
            raise ValueError(f"UpdateResult(stepped={self.stepped}) disagrees with its train/optimizer_steps="
                             f"{self.metrics['train/optimizer_steps']}")


@runtime_checkable
class Algorithm(Protocol):
    """The four calls the training loop makes on a recipe (see the module docstring)."""

    def update(self, batch, step: int) -> UpdateResult: ...

    def serving_weights(self) -> contextlib.AbstractContextManager: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    # Optional: False for a recipe that trains every valid sample, not advantages (DRaFT): the loop then calls
    # `update` on a step whose groups are all flat, and counts no flat streak (`trains_on_advantages` below).


def trains_on_advantages(algorithm) -> bool:
    """Whether a step needs a usable sample (a group with spread) to carry a signal: True unless the recipe
    says otherwise with a class attribute `trains_on_advantages = False`."""
    return getattr(algorithm, "trains_on_advantages", True)


class ServesTrainedWeights:
    """The three protocol calls of a recipe that samples with the trained weights and keeps no tensors of its
    own (GRPO, DPO): inherit them, write `update`."""

    def serving_weights(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the engine samples the trained weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        refuse_recipe_tensors(state)


def gradient_result(metrics: dict[str, float], skip_reason: str = "the update took none") -> UpdateResult:
    """The UpdateResult of an update whose metrics come from `GradientSteps.metrics()` (plus its own keys)."""
    stepped = metrics["train/optimizer_steps"] > 0
    return UpdateResult(metrics, stepped, None if stepped else skip_reason)


def refuse_recipe_tensors(state: dict[str, torch.Tensor]) -> None:
    """`load_state_dict` of a recipe that keeps no tensors of its own: a checkpoint holding some is another's."""
    if state:
        raise ValueError(f"this recipe keeps no tensors of its own, but the checkpoint holds {len(state)} "
                         f"(e.g. recipe/{next(iter(state))}): it was written by another recipe")
