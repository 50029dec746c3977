"""A LoRA file fused into served weights: W' = W + s·B·A for each adapted Linear layer.

Reads the files a run exports (`flywheel.lora.save_lora_for_diffusers`, i.e. diffusers'
`save_lora_weights`: keys "<component>.<module>.lora_A.weight" / "...lora_B.weight", the peft
config in the metadata entry "lora_adapter_metadata") and peft's own naming (the same keys
without the component prefix). The scale s is peft's: lora_alpha / r (alpha / sqrt(r) with
rsLoRA), with the config's per-module rank_pattern / alpha_pattern; a file without a config
gets s = alpha / r from a per-module "<module>.alpha" tensor if there is one, else 1 (what
diffusers' loader assumes). DoRA, LoRA biases and convolution LoRAs are refused by name.

Fusing changes the weights, not the module, so the served model keeps its state-dict names
(later full-weight pushes still fit) and costs nothing per step; it computes (W + s·B·A)·x where
the trained module computed W·x + s·B·(A·x), equal up to float rounding.
"""

from __future__ import annotations

import json
import math
import re

import torch

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
METADATA_KEY = "lora_adapter_metadata"  # diffusers' safetensors metadata entry for the adapter config
OTHER_FORMATS = ("lora_down", "lora_up", ".lora.down.", ".lora.up.", "lora_magnitude_vector", ".lora_B.bias")


def is_lora(names) -> bool:
    """Whether a file's tensor names are a LoRA adapter's (rather than full weights)."""
    return any(n.endswith(LORA_SUFFIXES) or any(f in n for f in OTHER_FORMATS) for n in names)


def adapter_config(metadata: dict | None, component: str) -> dict:
    """The peft config saved with the file (its keys without the "<component>." prefix); {} if none."""
    raw = (metadata or {}).get(METADATA_KEY)
    if not raw:
        return {}
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"the LoRA file's {METADATA_KEY!r} metadata is not JSON: {exc}") from None
    prefix = component + "."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in config.items()}


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def lora_deltas(tensors: dict[str, torch.Tensor], metadata: dict | None, component: str,
                state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{weight name in `state`: s·B·A (float32)} of a LoRA file's tensors; ValueError naming what does not fit."""
    other = sorted(n for n in tensors if any(f in n for f in OTHER_FORMATS))
    if other:
        raise ValueError(f"LoRA tensors {other[:3]} are in a format this server does not fuse (kohya lora_down/up, "
                         "DoRA magnitudes or LoRA biases); send a peft/diffusers LoRA of Linear layers "
                         "(<module>.lora_A.weight / .lora_B.weight)")
    config = adapter_config(metadata, component)
    if config.get("use_dora"):
        raise ValueError("the LoRA was trained with DoRA (use_dora=true), which this server does not fuse")
    prefix = component + "."
    modules: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        key = name[len(prefix):] if name.startswith(prefix) else name
        if key.endswith(".alpha"):
            alphas[key[:-len(".alpha")]] = tensor
            continue
        for suffix in LORA_SUFFIXES:
            if key.endswith(suffix):
                modules.setdefault(key[:-len(suffix)], {})[suffix[6]] = tensor  # "A" or "B"
                break
        else:
            raise ValueError(f"tensor {name!r} of the LoRA file is neither a lora_A nor a lora_B weight")
    half = sorted(m for m, parts in modules.items() if len(parts) != 2)
    if half:
        raise ValueError(f"LoRA layer(s) {half[:5]} have lora_A without lora_B or the reverse")
    missing = sorted(m for m in modules if m + ".weight" not in state)
    if missing:
        raise ValueError(f"{len(missing)} LoRA layer(s) are not Linear layers of the served {component}: "
                         f"{missing[:5]}; the adapter was trained on another model (examples of layers here: "
                         f"{[n[:-len('.weight')] for n in state if n.endswith('.weight')][:5]})")
    deltas = {}
    for module, parts in sorted(modules.items()):
        a, b = parts["A"].float(), parts["B"].float()
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"LoRA layer {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                             "the two matrices of a Linear layer's adapter")
        rank = a.shape[0]
        if config:
            alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", rank)))
            rank = int(_pattern_value(config.get("rank_pattern"), module, config.get("r", rank)))
        else:
            alpha = float(alphas[module]) if module in alphas else float(rank)
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        delta = scale * (b @ a)
        target = state[module + ".weight"]
        if tuple(delta.shape) != tuple(target.shape):
            raise ValueError(f"LoRA layer {module!r} gives a {tuple(delta.shape)} update for the served weight of "
                             f"shape {tuple(target.shape)}")
        if not bool(torch.isfinite(delta).all()):
            raise ValueError(f"LoRA layer {module!r}: its update s·B·A has non-finite values")
        deltas[module + ".weight"] = delta
    return deltas
