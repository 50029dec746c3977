"""`digit_alignment`: probability, under a small shipped CNN, that an image shows its prompted digit."""

from __future__ import annotations

import json
import math
import operator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

WEIGHTS_PATH = Path(__file__).parent / "weights" / "digit_classifier.safetensors"
REGENERATE = "python scripts/train_digit_classifier.py"
GRID = 8  # load_digits images are 8x8 with values 0..16; [0, 1] images are value / 16.


def digit_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X_train, X_test, y_train, y_test) of load_digits: X is [N, 8, 8] in 0..16, y is [N] int.

    The toy model's split, reshaped to images: the classifier, the judge and the
    generator never see each other's held-out images.
    """
    from engine.toy.data import digit_split as toy_digit_split

    x_train, x_test, y_train, y_test = toy_digit_split()
    return x_train.reshape(-1, GRID, GRID), x_test.reshape(-1, GRID, GRID), y_train, y_test


class DigitCNN(nn.Module):
    """Two 3x3 convs, one 2x2 max-pool, two linear layers: [B, 1, 8, 8] in [0, 1] -> logits [B, 10]."""

    def __init__(self, conv1: int = 16, conv2: int = 32, hidden: int = 64):
        super().__init__()
        self.config = {"conv1": conv1, "conv2": conv2, "hidden": hidden}
        self.conv1 = nn.Conv2d(1, conv1, 3, padding=1)
        self.conv2 = nn.Conv2d(conv1, conv2, 3, padding=1)
        self.fc1 = nn.Linear(conv2 * (GRID // 2) ** 2, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def to_digit_grid(images: torch.Tensor) -> torch.Tensor:
    """Images [B, C, H, W] in [0, 1] -> gray [B, 1, 8, 8] float32 (mean over channels, area resize)."""
    if images.ndim != 4:
        raise ValueError(f"expected images [B, C, H, W], got shape {tuple(images.shape)}")
    gray = images.float().mean(dim=1, keepdim=True)
    if gray.shape[-2:] != (GRID, GRID):
        # Area averaging is the exact inverse of a nearest-neighbour upscale by an integer factor.
        gray = F.interpolate(gray, size=(GRID, GRID), mode="area")
    return gray


def _metadata_digit(value, row: int) -> int:
    """A metadata "digit" as an int in 0..9 (int, numpy or 0-d torch integer)."""
    try:
        digit = operator.index(value)
    except TypeError:
        raise ValueError(f"metadata[{row}]['digit'] = {value!r} is not an integer; expected 0..9") from None
    if not 0 <= digit <= 9:
        raise ValueError(f"metadata[{row}]['digit'] = {digit} is out of range; expected 0..9")
    return digit


def prompted_digits(prompts: list[str], metadata: list[dict]) -> list[int | None]:
    """The digit each row asks for: metadata["digit"] if present, else parsed from the prompt (None if absent)."""
    if len(prompts) != len(metadata):
        raise ValueError(f"got {len(prompts)} prompts and {len(metadata)} metadata dicts; they must match")
    out: list[int | None] = []
    parse_digit = None
    for row, (prompt, meta) in enumerate(zip(prompts, metadata)):
        if meta and meta.get("digit") is not None:
            out.append(_metadata_digit(meta["digit"], row))
            continue
        if parse_digit is None:
            # Imported late: the prompt grammar belongs to the toy model in engine.
            from engine.toy.prompts import parse_digit
        out.append(parse_digit(prompt))
    return out


def prob_of_prompted(probs: torch.Tensor, digits: list[int | None]) -> torch.Tensor:
    """probs [B, 10] -> float32 [B] probability of each row's digit, NaN where the prompt names none."""
    if probs.shape[0] != len(digits):
        raise ValueError(f"got {probs.shape[0]} images and {len(digits)} prompts; they must match")
    index = torch.tensor([-1 if d is None else d for d in digits], device=probs.device)
    picked = probs.gather(1, index.clamp(min=0)[:, None])[:, 0]
    return torch.where(index >= 0, picked, torch.full_like(picked, math.nan)).float()


def load_classifier(path: str | Path = WEIGHTS_PATH, device: str | torch.device = "cpu") -> tuple[DigitCNN, dict]:
    """The shipped CNN in eval mode and its safetensors metadata (seed, epochs, heldout_accuracy, config)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"digit classifier weights not found at {path}; regenerate them with `{REGENERATE}`")
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    if "config" not in meta:
        raise ValueError(f"{path} has no 'config' in its safetensors metadata; regenerate it with `{REGENERATE}`")
    model = DigitCNN(**json.loads(meta["config"]))
    model.load_state_dict(load_file(str(path)))
    return model.to(device).eval().requires_grad_(False), meta


class DigitAlignment:
    """Scorer: softmax probability of the prompted digit under the shipped CNN (NaN if no digit is named)."""

    name = "digit_alignment"

    def __init__(self, weights_path: str | Path = WEIGHTS_PATH, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model, self.weights_meta = load_classifier(weights_path, self.device)

    @torch.no_grad()
    def probs(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities [B, 10] on this scorer's device."""
        return self.model(to_digit_grid(images.to(self.device))).softmax(dim=-1)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host."""
        digits = prompted_digits(prompts, metadata)
        return prob_of_prompted(self.probs(images), digits).cpu()
