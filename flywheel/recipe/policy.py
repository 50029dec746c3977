"""The policy a recipe trains: the model, its trainable weights (full or LoRA), the reference policy, the optimizer."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import get_card, load_model
from engine.denoise import guided_velocity
from flywheel.lora import adapters_disabled, add_lora
from flywheel.recipe.preflight import check_built_model, check_lora_targets
from flywheel.recipe.swapped_weights import swapped_in
from flywheel.runs.config import ConfigError

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

    @property
    def transformer(self) -> torch.nn.Module:
        return self.model.transformer

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_params]

    def velocity(self, transformer, x, t, cond, uncond_cond=None, guidance: float = 1.0) -> torch.Tensor:
        """The (guided) velocity of `transformer` (the trained module, or its DDP/FSDP wrapper) at x, t."""
        return guided_velocity(self.model, transformer, x, t, cond, uncond_cond, guidance)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A detached copy of the trainable weights (e.g. a recipe's sampling policy)."""
        return {n: p.detach().clone() for n, p in self.named_params}

    def weights_swapped(self, weights: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
        """Run the transformer with `weights` in place of the trainable ones, then put them back (bit for bit).

        For a second policy of the same shape (a sampling policy, an EMA) without a
        second copy of the frozen weights: LoRA swaps only the adapter, and weights of
        the parameters' dtype are exchanged in place (flywheel/recipe/swapped_weights.py).
        """
        return swapped_in(self.named_params, weights)


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
            def ref_velocity(x, t, cond, uncond_cond=None, g=1.0):  # the base model = adapter switched off
                with adapters_disabled(transformer):
                    return guided_velocity(model, transformer, x, t, cond, uncond_cond, g)
    else:
        transformer.requires_grad_(True)
        if reference:
            frozen = copy.deepcopy(transformer).requires_grad_(False)

            def ref_velocity(x, t, cond, uncond_cond=None, g=1.0):
                return guided_velocity(model, frozen, x, t, cond, uncond_cond, g)
    train_chosen_experts(transformer, mc.experts or card_defaults.get("experts"))
    named_params = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]
    return Policy(model, named_params, ref_velocity, card_defaults)


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
