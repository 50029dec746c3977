"""LoRA through peft, injected in place so the engine keeps serving the same module.

With the adapter disabled the module computes exactly the base model, which
makes it the KL reference for free (no second copy of the weights).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def add_lora(module: nn.Module, rank: int, alpha: float, target_modules: list[str], init: str = "default") -> list[str]:
    """Inject a LoRA adapter into `module`; only adapter weights stay trainable. Returns their names.

    `init`: peft's "default" (Kaiming-uniform A) or "gaussian" (A ~ N(0, 1/r), as Flow-GRPO); B = 0
    either way, so the adapted model starts equal to the base.
    """
    if init not in ("default", "gaussian"):
        raise ValueError(f"LoRA init {init!r} is not known; valid: default, gaussian")
    from peft import LoraConfig, inject_adapter_in_model

    if not target_modules:
        raise ValueError("LoRA needs target_modules (names of Linear layers to adapt)")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        init_lora_weights=True if init == "default" else init)
    inject_adapter_in_model(config, module)
    trainable = []
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)
        if "lora_" in name:
            trainable.append(name)
            if param.dtype in (torch.float16, torch.bfloat16):
                # peft makes the adapter in the base layer's dtype. A 16-bit adapter trained by AdamW keeps its
                # state in 16 bits, where float16 rounds eps (1e-8) and small squared gradients to 0 (the first
                # step's update is inf) and bfloat16 rounds most small updates away: the adapter is float32, as
                # peft's autocast_adapter_dtype and diffusers' cast_training_params make it (peft casts the
                # input to the adapter's dtype and the output back).
                param.data = param.data.float()
    if not trainable:
        raise ValueError(f"no layer of the model matched LoRA target_modules={list(target_modules)}")
    return trainable


@contextlib.contextmanager
def adapters_disabled(module: nn.Module):
    """Run the base model: every LoRA layer's adapter switched off for the duration."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    # peft's enable_adapters(True) marks every active adapter trainable again: an adapter frozen on purpose
    # (Wan2.2's expert left out by model.experts) would then get gradients and be exported as trained.
    frozen = [p for layer in layers for p in layer.parameters() if not p.requires_grad]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p in frozen:
            p.requires_grad_(False)


def lora_state_dict(module: nn.Module) -> dict:
    """The adapter's tensors in peft's saved naming (no adapter name), contiguous on the CPU."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(module).items()}


def save_lora_for_diffusers(module: nn.Module, directory, pipeline_class: str) -> str:
    """Save the transformer's LoRA where a stock diffusers pipeline's `load_lora_weights(directory)` reads it.

    `pipeline_class` names the diffusers pipeline (e.g. "StableDiffusion3Pipeline");
    its `save_lora_weights` writes the file with diffusers' key prefixes, and the
    adapter's config (rank, alpha, targets) goes into the file's metadata so the
    loaded scale equals the trained one. Returns the file path.
    """
    import diffusers

    module = getattr(module, "module", module)  # a DDP wrapper holds the model in .module
    cls = getattr(diffusers, pipeline_class, None)
    if cls is None or not hasattr(cls, "save_lora_weights"):
        raise ValueError(f"pipeline_class={pipeline_class!r} is not a diffusers pipeline that saves LoRA weights")
    config = module.peft_config["default"].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    experts = getattr(module, "diffusers_experts", None)
    if experts is None:
        cls.save_lora_weights(str(directory), transformer_lora_layers=lora_state_dict(module),
                              transformer_lora_adapter_metadata=config, safe_serialization=True)
        return str(directory) + "/pytorch_lora_weights.safetensors"
    # A two-expert module (Wan2.2: `high`, `low`): one file per trained expert, under the weight name its
    # pipeline component loads (the low-noise one: load_lora_weights(..., weight_name=..., load_into_transformer_2=True)).
    state = lora_state_dict(module)
    trained = {n.split(".", 1)[0] for n, p in module.named_parameters() if "lora_" in n and p.requires_grad}
    paths = []
    for prefix, (_, weight_name) in experts.items():
        if prefix in trained:
            part = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
            cls.save_lora_weights(str(directory), transformer_lora_layers=part, weight_name=weight_name,
                                  transformer_lora_adapter_metadata=config, safe_serialization=True)
            paths.append(f"{directory}/{weight_name}")
    if not paths:
        raise ValueError("no expert of the module has a trainable LoRA: nothing to save")
    return paths[0]
