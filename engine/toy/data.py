"""The digits data of the toy task, with the one fixed train/held-out split every component shares."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SPLITS = ("train", "test")


def digit_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X_train, X_test, y_train, y_test) of sklearn's digits: X [N, 64] in 0..16, fixed 80/20 stratified split."""
    digits = load_digits()
    # Fixed seed and stratification: the toy model and the reward classifier
    # must agree on which images are held out.
    return train_test_split(digits.data, digits.target, test_size=0.2, random_state=0, stratify=digits.target)


def to_latents(x: np.ndarray) -> torch.Tensor:
    """Digits pixels [N, 64] in 0..16 to latents [N, 1, 8, 8] in [-1, 1] (fp32)."""
    return torch.as_tensor(np.asarray(x), dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0 * 2.0 - 1.0


def load_digit_tensors(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0 [N, 1, 8, 8] in [-1, 1], labels [N] long) of the "train" or "test" (held-out) split."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not known; valid splits: {', '.join(SPLITS)}")
    x_train, x_test, y_train, y_test = digit_split()
    x, y = (x_train, y_train) if split == "train" else (x_test, y_test)
    return to_latents(x), torch.as_tensor(y, dtype=torch.long)
