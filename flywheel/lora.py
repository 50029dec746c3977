"""LoRA through peft, injected in place so the engine keeps serving the same module.

With the adapter disabled the module computes exactly the base model, which
makes it the KL reference for free (no second copy of the weights).
"""

from __future__ import annotations

import contextlib

from torch import nn


def add_lora(module: nn.Module, rank: int, alpha: float, target_modules: list[str]) -> list[str]:
    """Inject a LoRA adapter into `module`; only adapter weights stay trainable. Returns their names."""
    from peft import LoraConfig, inject_adapter_in_model

    if not target_modules:
        raise ValueError("LoRA needs target_modules (names of Linear layers to adapt)")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        init_lora_weights=True)
    inject_adapter_in_model(config, module)
    trainable = []
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)
        if "lora_" in name:
            trainable.append(name)
    if not trainable:
        raise ValueError(f"no layer of the model matched LoRA target_modules={list(target_modules)}")
    return trainable


@contextlib.contextmanager
def adapters_disabled(module: nn.Module):
    """Run the base model: every LoRA layer's adapter switched off for the duration."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
