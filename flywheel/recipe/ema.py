"""Exponential moving averages of the trained weights: the `ema` section of every recipe, and the math AWM's
anchor reuses.

    EMA <- decay·EMA + (1 - decay)·weights

`WeightEMA` holds one average (float32, on the weights' device) and moves it
with a given decay; `train_ema_decay` is the schedule of `ema.enabled`, which
`RecipeRun` applies after every training step, evaluates with and checkpoints.

The `ema` section follows Flow-GRPO (github.com/yifan123/flow_grpo: flow_grpo/ema.py,
scripts/train_sd3.py, config/grpo.py, which sets train.ema = True for its
released runs): the average starts at the trainable weights before the first
update (the LoRA adapter for LoRA runs), its decay is 0.9 and ramps up as
min(0.9, (1 + n)/(10 + n)), it moves every 8 steps, evaluation swaps it in for
the trained weights and puts them back afterwards, and the saved weights are the
average. Where this module differs, on purpose:

- n counts training steps (rollout + update), the unit of every other step key
  (steps, eval.every, save_every), and the average moves after the step's whole
  update. Flow-GRPO counts optimizer steps (two per rollout batch in its
  configs) and calls its update after every micro-batch, so in a group of
  accumulated micro-batches it moves the average once per micro-batch toward the
  same weights (decay d^accumulation in effect). With the toy defaults (one
  optimizer step per training step) the step counts agree.
- It moves when n is a multiple of ema.update_every (8, 16, ...);
  Flow-GRPO moves when n + 1 is (7, 15, ...).
- ema.start_step (not in Flow-GRPO, which starts at 0): until then the
  average is the trained weights (decay 0), and n counts from it, so the ramp
  starts over there.
- A LoRA run exports both adapters: lora/ the trained one, lora_ema/ the average
  (Flow-GRPO saves only the average), and the run warns at its end when the
  average has not moved yet (a run shorter than its first move).
- The average is kept in float32 whatever the weights' dtype (Flow-GRPO keeps
  the weights' dtype; a bf16 average would round away (1 - d)·(w - EMA) steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

# Flow-GRPO's warm-up min(decay, (1 + n) / (WARMUP_OFFSET + n)): 0.18 after one step, 0.5 after 8, 0.9 after 80.
WARMUP_OFFSET = 10


class WeightEMA:
    """An exponential moving average of named weights (float32 copies on the weights' device).

    The average is a dict name -> tensor (`shadow`) with the trained parameters'
    names, so `Policy.weights_swapped(ema.shadow)` runs the trained module with it.
    `what` names it in error messages ("the EMA average", "the EMA anchor").
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], what: str = "EMA"):
        self.what = what
        self.shadow = {name: p.detach().to(dtype=torch.float32, copy=True) for name, p in named_params}
        # Whether the average differs from the weights it started from: an update that met weights unlike it
        # (or a checkpoint's average, loaded). A run's end warns while it is False (an average that never moved).
        self.moved = False

    @torch.no_grad()
    def update(self, named_params: Iterable[tuple[str, torch.Tensor]], decay: float) -> None:
        """EMA <- decay·EMA + (1 - decay)·weights (decay 0 copies the weights exactly)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"{self.what}: decay {decay} is outside [0, 1]")
        for name, p in named_params:
            if not self.moved and decay < 1.0:
                self.moved = not torch.equal(self.shadow[name], p.detach().float())
            self.shadow[name].mul_(decay).add_(p.detach().float(), alpha=1.0 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Strict: the same names and shapes as the trained parameters; values are cast to float32."""
        if state.keys() != self.shadow.keys():
            odd = sorted(set(state) ^ set(self.shadow))
            raise ValueError(f"{self.what}: the state's names differ from the trained parameters' ({len(odd)} "
                             f"differ, e.g. {odd[:3]}); was model.finetune or the LoRA changed?")
        for name, value in state.items():
            if value.shape != self.shadow[name].shape:
                raise ValueError(f"{self.what} {name!r}: shape {tuple(value.shape)} in the state, "
                                 f"{tuple(self.shadow[name].shape)} trained")
        for name, value in state.items():
            self.shadow[name].copy_(value)
        self.moved = True  # a checkpoint's: whether it moved before is not recorded (the zero-adapter check still is)


def train_ema_decay(steps_done: int, ec) -> float | None:
    """The decay the `ema` section's average takes after `steps_done` training steps, or None when it does not
    move then.

    `ec` is the run's `ema` section (an EMAConfig). With n = steps_done - start_step: n <= 0 gives 0 (the
    average is the weights), otherwise it moves when n is a multiple of update_every, with
    min(decay, (1 + n)/(10 + n)).
    """
    n = steps_done - ec.start_step
    if n <= 0:
        return 0.0
    if n % ec.update_every:
        return None
    return min(ec.decay, (1 + n) / (WARMUP_OFFSET + n))


def first_ema_move(ec) -> int:
    """The first training step after which the `ema` section's average moves (`train_ema_decay` is not None).

    Step 1 when start_step >= 1 (until then the average copies the weights), else update_every:
    a run of fewer steps exports an average that is still the weights it started from.
    """
    return 1 if ec.start_step >= 1 else ec.update_every


# Where an EMA anchor's tensors sit among a recipe's checkpointed tensors (AWM and DRaFT).
ANCHOR_PREFIX = "ema_anchor/"


def anchor_checkpoint(average: WeightEMA | None) -> dict[str, torch.Tensor]:
    """An EMA anchor's tensors under ANCHOR_PREFIX, for the recipe's state_dict ({} without an anchor)."""
    return {} if average is None else {ANCHOR_PREFIX + n: v for n, v in average.state_dict().items()}


def checkpointed_anchor(checkpointed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The anchor's tensors in `checkpointed` (`RecipeRun.recipe_tensors`), names without the prefix; {} for a
    fresh run. ValueError when a resumed checkpoint holds none: its run trained without an anchor."""
    saved = {k[len(ANCHOR_PREFIX):]: v for k, v in checkpointed.items() if k.startswith(ANCHOR_PREFIX)}
    if checkpointed and not saved:
        raise ValueError("resume: the checkpoint holds no EMA anchor (its run had train.anchor_beta=0); resume "
                         "with train.anchor_beta=0, or start a fresh run")
    return saved


class EMAAnchored:
    """The algorithm-protocol methods (flywheel/recipe/algorithm.py) of a recipe whose engine samples the trained
    weights and whose own tensors are an EMA anchor (AWM, DRaFT). The recipe's class sets `build_anchor`, its
    (policy, cfg.train, checkpointed) -> anchor or None, whose `.average` is a WeightEMA; it reads
    `self.policy`, `self.cfg` and `self.anchor`."""

    build_anchor: Callable

    def serving_weights(self):
        return contextlib.nullcontext()  # the engine samples the trained weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        return anchor_checkpoint(None if self.anchor is None else self.anchor.average)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """A checkpoint's anchor (strict names); a fresh run's state is {} and keeps the anchor at the weights."""
        self.anchor = self.build_anchor(self.policy, self.cfg.train, state)
