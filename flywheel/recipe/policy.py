"""The policy a recipe trains: the model, its trainable weights (full or LoRA), the reference policy, the optimizer,
and other weights swapped into the one trained module (`swapped_in`).

Other weights swapped in: a second policy of the same shape without a second model. The EMA average, AWM's EMA
anchor and DiffusionNFT's sampling policy theta_old are each a dict of the trained parameters' names to tensors
(the LoRA adapter's alone for a LoRA run). `swapped_in` runs the trained module with such a dict in place of its
trainable weights and puts them back, bit for bit; the frozen base weights are never copied.

Where a tensor has its parameter's dtype and device the two exchange values in place (one tensor's worth of
scratch memory at a time), so a full fine-tune swaps without a second copy of the weights either; the dict
then holds the trained values until the context ends. Other tensors (a float32 average of bf16 weights) are
copied in, with the trained values saved aside.

DiffusionNFT's rollouts use it through the "swapped" layout (flywheel/recipe/rollouts.py `SwappedIn`): the engine
serves the trainer's own module, and the loop swaps theta_old in around every rollout and sync.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine import get_card, load_model
from engine.denoise import guided_velocity
from flywheel.lora import adapters_disabled, add_lora
from flywheel.recipe.preflight import (check_built_model, check_lora_targets, fsdp_requested,
                                      warn_frozen_expert_sde_steps)
from flywheel.recipe.weight_motion import check_step_size
from flywheel.config.parsing import ConfigError

# velocity(x, t, cond, uncond_cond, guidance) of a frozen policy (the reference, or a recipe's sampling policy).
FrozenVelocity = Callable[..., torch.Tensor]


@dataclass
class Policy:
    """The trained model: `model.transformer` is the module the optimizer updates and the engine serves."""

    model: object
    named_params: list[tuple[str, torch.nn.Parameter]]
    ref_velocity: FrozenVelocity | None
    """the reference policy's velocity (no grad), None when the recipe asked for none"""
    card_defaults: dict
    whole_weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """a context in which `named_params` hold whole tensors: under FSDP the gather of its flat shards
    (`RecipeRun.prepare` sets it), else nothing to do"""

    @property
    def transformer(self) -> torch.nn.Module:
        return self.model.transformer

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_params]

    def velocity(self, transformer, x, t, cond, uncond_cond=None, guidance: float = 1.0) -> torch.Tensor:
        """The (guided) velocity of `transformer` (the trained module, or its DDP/FSDP wrapper) at x, t."""
        return guided_velocity(self.model, transformer, x, t, cond, uncond_cond, guidance)

    def pushed_weights(self) -> dict[str, torch.Tensor]:
        """The trainable weights as another process gets them (an engine process, Ray replicas): whole.
        Under FSDP a copy made inside the gather: a transport may move a tensor's storage into shared memory
        (Ray's put does), and FSDP must then still free the gathered storage ("storage that is not
        resizable" otherwise)."""
        if self.whole_weights is contextlib.nullcontext:
            return {n: p.detach() for n, p in self.named_params}
        with self.whole_weights():
            return {n: p.detach().clone() for n, p in self.named_params}

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A detached copy of the trainable weights (e.g. a recipe's sampling policy)."""
        return {n: p.detach().clone() for n, p in self.named_params}

    def weights_swapped(self, weights: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
        """Run the transformer with `weights` in place of the trainable ones, then put them back (bit for bit).

        For a second policy of the same shape (a sampling policy, an EMA) without a
        second copy of the frozen weights: LoRA swaps only the adapter, and weights of
        the parameters' dtype are exchanged in place (`swapped_in`, below).
        """
        return swapped_in(self.named_params, weights)


# ---- other weights swapped into the one trained module ---------------------------------------------------------


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


def build_policy(cfg, device: torch.device, reference: bool) -> Policy:
    """Load the card's model, make its weights (or a LoRA adapter) trainable, and the reference if asked for.

    The reference is the model before any update: with LoRA the adapter switched
    off (no copy), with full fine-tuning a frozen copy of the transformer.
    """
    mc = cfg.model
    model = load_model(mc.card, path=mc.path, device=device, dtype=getattr(torch, mc.dtype))
    transformer = model.transformer
    card_defaults = get_card(mc.card).defaults
    if cfg.sampling.time_shift != 1.0 and hasattr(model, "schedule"):
        raise ConfigError(f"sampling.time_shift={cfg.sampling.time_shift}: the {mc.card} card takes its "
                          "schedule (and its shift) from the folder's scheduler config, so this key would be "
                          "ignored; leave it at 1.0 and edit scheduler/scheduler_config.json to change the shift")
    check_built_model(cfg, model)  # the card's size and frame rules, before the run dir is written
    warn_frozen_expert_sde_steps(cfg, model)
    if cfg.train.gradient_checkpointing:
        if not hasattr(transformer, "enable_gradient_checkpointing"):
            raise ConfigError(f"train.gradient_checkpointing=true: the {mc.card} card's transformer does not "
                             f"support it (diffusers models do)")
        transformer.enable_gradient_checkpointing()
    ref_velocity = None
    if mc.finetune == "lora":
        check_lora_targets(cfg, transformer, lora_targets(cfg))
        # peft draws A from torch's global generator, which no recipe seeds: seeded here from the run's seed,
        # a LoRA run starts from the same adapter every time (and the caller's generator is left as it was).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            add_lora(transformer, mc.lora_rank, mc.lora_alpha, lora_targets(cfg), init=mc.lora_init)
        if reference:
            ref_velocity = AdapterOffVelocity(model, transformer)
    else:
        transformer.requires_grad_(True)
        if reference:
            frozen = copy.deepcopy(transformer).requires_grad_(False)

            def ref_velocity(x, t, cond, uncond_cond=None, g=1.0):
                return guided_velocity(model, frozen, x, t, cond, uncond_cond, g)
    train_chosen_experts(transformer, mc.experts or card_defaults.get("experts"))
    named_params = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]
    # Still before the run directory exists.
    check_step_size(cfg.train.learning_rate, cfg.train.max_grad_norm, named_params)
    return Policy(model, named_params, ref_velocity, card_defaults)


class AdapterOffVelocity:
    """A LoRA run's reference velocity: the base model's, the trained module with its adapters switched off
    (no second copy of the weights).

    `forward_module` is what the forward calls: the trained module itself, or, under FSDP, its wrapper
    (`RecipeRun.prepare` sets it), whose forward gathers the sharded base weights: outside the wrapper, and
    outside the rollouts' gather, the module holds only this rank's flat shards."""

    def __init__(self, model, transformer: torch.nn.Module):
        self.model, self.transformer, self.forward_module = model, transformer, transformer

    def __call__(self, x, t, cond, uncond_cond=None, g: float = 1.0) -> torch.Tensor:
        with adapters_disabled(self.transformer):
            return guided_velocity(self.model, self.forward_module, x, t, cond, uncond_cond, g)


def train_chosen_experts(transformer, experts: str | None) -> None:
    """On a two-expert card (wan2.2-t2v: `transformer` holds `high` and `low`), freeze the experts that
    `experts` (both, high or low) leaves out: their LoRA (or weights) stay as loaded and out of the optimizer."""
    if experts is None or experts == "both" or not hasattr(transformer, "diffusers_experts"):
        return
    for name, param in transformer.named_parameters():
        if name.split(".", 1)[0] != experts:
            param.requires_grad_(False)


def lora_targets(cfg) -> list[str] | None:
    """The Linear layers a LoRA adapts: model.lora_targets, or the card's default."""
    return cfg.model.lora_targets or get_card(cfg.model.card).defaults.get("lora_targets")


def make_optimizer(policy: Policy, oc) -> torch.optim.Optimizer:
    """AdamW over the trainable weights, from a recipe's `train` section (an OptimConfig)."""
    return torch.optim.AdamW(policy.params, lr=oc.learning_rate, betas=oc.adam_betas, weight_decay=oc.weight_decay)


def fsdp_not_applied(accelerator) -> str | None:
    """The warning for a launch whose accelerate config asks for FSDP (ACCELERATE_USE_FSDP, set by `accelerate
    launch` from `distributed_type: FSDP`) where accelerate does not apply it: on CPUs it silently falls back to
    plain data parallelism, every rank holding the whole model. None when FSDP runs or was not asked for."""
    if not fsdp_requested() or uses_fsdp(accelerator):
        return None
    return (f"the accelerate config asks for FSDP, but accelerate applies it on GPUs only: this run is "
            f"{accelerator.distributed_type.value} data parallelism, every rank holding the whole model and its "
            f"optimizer state (nothing is sharded)")


def fsdp_full_params(accelerator, module):
    """A context factory that gathers FSDP-sharded parameters whole (a no-op without FSDP).

    Under FSDP (version 1, use_orig_params) the wrapped module's own parameters
    become shards; inside `summon_full_params` they are whole again, so the
    engine can call the plain module for rollouts without per-forward collectives.
    """
    if not uses_fsdp(accelerator):
        return contextlib.nullcontext
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(module, FullyShardedDataParallel):
        raise ValueError("the FSDP recipe path needs FSDP version 1 (fsdp_version: 1 in the accelerate config, "
                         "see configs/accelerate/fsdp.yaml)")
    return lambda: FullyShardedDataParallel.summon_full_params(module, writeback=False)


def uses_fsdp(accelerator) -> bool:
    """Whether accelerate shards this run's model with FSDP (known before `prepare`)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def fsdp_optimizer_state(module, optimizer: torch.optim.Optimizer) -> dict:
    """The full optimizer state of an FSDP-wrapped `module`, each parameter named by its FQN in the unwrapped
    module (the names of `Policy.named_params`): on an accelerator gathered to the main process's CPU memory
    (the other ranks get {}), on a CPU run to every rank. A collective: every rank calls it. Each rank's own
    optimizer state holds only its flat shards, which a checkpoint of the main process's state would save as
    if they were the parameters (and a resume would then fail on their sizes)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    # Offloaded to the CPU on an accelerator (no rank holds the whole state in device memory). Not on a CPU
    # run: there torch 2.13's offload keeps the gather's reused buffer, so every state tensor of a parameter
    # (exp_avg, exp_avg_sq) comes back as the same tensor, the last one gathered.
    on_cpu = next(module.parameters()).device.type == "cpu"
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=not on_cpu))


def load_fsdp_optimizer_state(module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full, named optimizer state (`fsdp_optimizer_state`'s, or a plain run's checkpoint) into the
    shards of this rank. Every rank calls it with the whole state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
