"""Other weights swapped into the one trained module: a second policy of the same shape without a second model.

the EMA average, AWM's EMA anchor and DiffusionNFT's sampling policy theta_old are each a dict of the
trained parameters' names to tensors (the LoRA adapter's alone for a LoRA run). `swapped_in` runs the trained
module with such a dict in place of its trainable weights and puts them back, bit for bit; the frozen base
weights are never copied.

Where a tensor has its parameter's dtype and device the two exchange values in place (one tensor's worth of
scratch memory at a time), so a full fine-tune swaps without a second copy of the weights either; the dict
then holds the trained values until the context ends. Other tensors (a float32 average of bf16 weights) are
copied in, with the trained values saved aside.

DiffusionNFT's rollouts use it through the "swapped" layout (flywheel/recipe/layouts.py `SwappedIn`): the engine
serves the trainer's own module, and the loop swaps theta_old in around every rollout and sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _pairs(named_params, weights: dict[str, torch.Tensor], what: str) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, tensor) by name, checked before anything moves."""
    named = list(named_params)
    missing = [n for n, _ in named if n not in weights]
    if missing:
        raise ValueError(f"{what}: no tensor for {len(missing)} of the {len(named)} trained parameters "
                         f"(e.g. {missing[0]!r}); was model.finetune or the LoRA changed?")
    for n, p in named:
        if weights[n].shape != p.shape:
            raise ValueError(f"{what} {n!r}: shape {tuple(weights[n].shape)}, the trained parameter's is "
                             f"{tuple(p.shape)}")
    return [(p, weights[n]) for n, p in named]


def _exchangeable(p: torch.Tensor, w: torch.Tensor) -> bool:
    return w.dtype == p.dtype and w.device == p.device


@torch.no_grad()
def _exchange(p: torch.Tensor, w: torch.Tensor) -> None:
    """Swap the values of two tensors of one dtype and device in place."""
    if w.data_ptr() == p.data_ptr():
        return  # the same storage: nothing to swap
    scratch = p.detach().clone()
    p.copy_(w)
    w.copy_(scratch)


@contextlib.contextmanager
def swapped_in(named_params, weights: dict[str, torch.Tensor], what: str = "swapped weights") -> Iterator[None]:
    """Run the module of `named_params` with `weights` (name -> tensor) as its trainable weights, then restore them.

    The copies run without grad; the body runs as the caller's does (a no-grad forward, or an evaluation).
    Tensors exchanged in place (same dtype and device as their parameter) hold the trained values inside the
    context: read `weights` only outside it. The trained weights are back, bit for bit, however the body ends.
    """
    pairs = _pairs(named_params, weights, what)
    saved: dict[int, torch.Tensor] = {}
    done = 0
    try:
        with torch.no_grad():
            for i, (p, w) in enumerate(pairs):
                if _exchangeable(p, w):
                    _exchange(p, w)
                else:
                    saved[i] = p.detach().clone()
                    p.copy_(w)
                done = i + 1
        yield
    finally:
        with torch.no_grad():
            for i, (p, w) in enumerate(pairs[:done]):
                if i in saved:
                    p.copy_(saved[i])
                else:
                    _exchange(p, w)
