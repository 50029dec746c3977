"""Rewards of the toy tasks, under a small shipped digit CNN.

- `digit_alignment` (toy-digits): the probability that an image shows its prompted digit.
- `number_alignment` (toy-numbers): the product of the probabilities that the left
  half of an image shows the prompted number's tens digit and the right half
  its units digit, each half scored on its own as an 8x8 digit.
"""

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
    output_range = (0.0, 1.0)  # a probability
    differentiable = True  # softmax of a CNN over an area resize: d score / d pixels exists everywhere
    prompt_needs = 'a digit, as metadata "digit" or in the text ("a handwritten 7", "a seven")'

    @staticmethod
    def scored_rows(prompts: list[str], metadata: list[dict]) -> list[bool]:
        """Which rows name a digit (the others score NaN: masked), checked before a run starts."""
        return [digit is not None for digit in prompted_digits(prompts, metadata)]

    def __init__(self, weights_path: str | Path = WEIGHTS_PATH, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model, self.weights_meta = load_classifier(weights_path, self.device)

    def probs(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities [B, 10] on this scorer's device (a graph only when the images require grad: the
        CNN is frozen)."""
        return self.model(to_digit_grid(images.to(self.device))).softmax(dim=-1)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host."""
        digits = prompted_digits(prompts, metadata)
        return prob_of_prompted(self.probs(images), digits).cpu()


def to_digit_halves(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [B, C, H, 2H] in [0, 1] (two digits side by side) -> (left, right) gray halves [B, 1, 8, 8] each."""
    if images.ndim != 4 or images.shape[-1] != 2 * images.shape[-2]:
        raise ValueError(f"expected images [B, C, H, 2H] (two square digits side by side, e.g. 8x16), "
                         f"got shape {tuple(images.shape)}")
    half = images.shape[-1] // 2
    return to_digit_grid(images[..., :half]), to_digit_grid(images[..., half:])


def _metadata_pair(meta: dict, row: int) -> tuple[int, int] | None:
    """(left, right) digits from metadata "digits" [a, b] and/or "number" 10..99 (they must agree); None if absent."""
    pair = None
    if meta.get("digits") is not None:
        digits = meta["digits"]
        if isinstance(digits, (str, bytes)) or not hasattr(digits, "__len__") or len(digits) != 2:
            raise ValueError(f"metadata[{row}]['digits'] = {digits!r}; expected two digits [left, right], e.g. [4, 2]")
        pair = tuple(_metadata_digit(d, row) for d in digits)
    if meta.get("number") is not None:
        try:
            number = operator.index(meta["number"])
        except TypeError:
            number = None
        if number is None or not 10 <= number <= 99:
            raise ValueError(f"metadata[{row}]['number'] = {meta['number']!r}; expected an integer in 10..99")
        if pair is not None and pair != divmod(number, 10):
            raise ValueError(f"metadata[{row}] names number {number} but digits {list(pair)}; they must agree")
        pair = divmod(number, 10)
    return pair


def prompted_number_digits(prompts: list[str], metadata: list[dict]) -> list[tuple[int, int] | None]:
    """The (left, right) digits each row asks for: from metadata ("digits", "number"), else parsed from the
    prompt ("the number 42", "forty-two"); None where the prompt names no two-digit number."""
    if len(prompts) != len(metadata):
        raise ValueError(f"got {len(prompts)} prompts and {len(metadata)} metadata dicts; they must match")
    out: list[tuple[int, int] | None] = []
    parse_number = None
    for row, (prompt, meta) in enumerate(zip(prompts, metadata)):
        pair = _metadata_pair(meta, row) if meta else None
        if pair is None:
            if parse_number is None:
                # Imported late: the prompt grammar belongs to the toy model in engine.
                from engine.toy.numbers import parse_number
            number = parse_number(prompt)
            pair = None if number is None else divmod(number, 10)
        out.append(pair)
    return out


def prob_of_prompted_pair(left_probs: torch.Tensor, right_probs: torch.Tensor,
                          pairs: list[tuple[int, int] | None]) -> torch.Tensor:
    """[B] float32: left_probs[i, a_i] * right_probs[i, b_i] for each row's pair (a_i, b_i); NaN where None."""
    left = prob_of_prompted(left_probs, [None if p is None else p[0] for p in pairs])
    right = prob_of_prompted(right_probs, [None if p is None else p[1] for p in pairs])
    return left * right


class NumberAlignment:
    """Scorer: P(left half = tens digit) x P(right half = units digit) under the shipped CNN (NaN if no number).

    The product is high only when both digits are right: a number with one
    wrong digit scores at most the right digit's probability times the
    wrong one's, which the CNN puts near 0.
    """

    name = "number_alignment"
    output_range = (0.0, 1.0)  # a product of two probabilities
    differentiable = True  # the product of two DigitAlignment probabilities
    prompt_needs = 'a two-digit number, as metadata "number" or "digits", or in the text ("the number 42")'

    @staticmethod
    def scored_rows(prompts: list[str], metadata: list[dict]) -> list[bool]:
        """Which rows name a two-digit number (the others score NaN: masked), checked before a run starts."""
        return [pair is not None for pair in prompted_number_digits(prompts, metadata)]

    def __init__(self, weights_path: str | Path = WEIGHTS_PATH, device: str | torch.device = "cpu"):
        self.digits = DigitAlignment(weights_path, device)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host."""
        pairs = prompted_number_digits(prompts, metadata)
        left, right = to_digit_halves(images)
        return prob_of_prompted_pair(self.digits.probs(left), self.digits.probs(right), pairs).cpu()
