"""Train the `digit_alignment` CNN on the load_digits train split and ship its weights.

Usage: python scripts/train_digit_classifier.py [--seed 0] [--epochs 30] [--out PATH]
Deterministic for a given seed on a given machine; refuses to write weights
below the accuracy floor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

# Runnable from a checkout without installing the package: put the repo root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rewards.digits import WEIGHTS_PATH, DigitCNN, digit_split  # noqa: E402

MIN_ACCURACY = 0.95


def random_shift(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Shift each image in [B, 1, 8, 8] by -1..1 pixels in x and y, filling with 0 (the background)."""
    b, _, h, w = x.shape
    padded = F.pad(x, (1, 1, 1, 1))
    dy = torch.randint(0, 3, (b,), generator=gen)
    dx = torch.randint(0, 3, (b,), generator=gen)
    rows = dy[:, None] + torch.arange(h)  # [B, H]
    cols = dx[:, None] + torch.arange(w)  # [B, W]
    return padded[torch.arange(b)[:, None, None], 0, rows[:, :, None], cols[:, None, :]][:, None]


def accuracy(model: DigitCNN, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of `model` on images x [N, 1, 8, 8] with labels y."""
    with torch.no_grad():
        return (model(x).argmax(-1) == y).float().mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seeds the initialisation, shuffling and augmentation")
    parser.add_argument("--epochs", type=int, default=30, help="passes over the train split")
    parser.add_argument("--batch-size", type=int, default=64, help="images per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--out", type=Path, default=WEIGHTS_PATH, help="where to write the safetensors file")
    args = parser.parse_args(argv)
    problems = [f"--{name} {getattr(args, name.replace('-', '_'))}: must be a whole number >= 1"
                for name in ("epochs", "batch-size") if getattr(args, name.replace("-", "_")) < 1]
    if not (math.isfinite(args.lr) and args.lr > 0):
        problems.append(f"--lr {args.lr}: must be a finite number > 0")
    if args.out.is_dir():
        problems.append(f"--out {args.out} is a directory: give the path of the safetensors file to write")
    if problems:  # usage and one error line, exit 2, before the epochs run
        parser.error("; ".join(problems))

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    x_train, x_test, y_train, y_test = digit_split()
    # Same scaling as the scorer sees: pixel value / 16 puts load_digits into [0, 1].
    x_train = torch.tensor(x_train, dtype=torch.float32)[:, None] / 16.0
    x_test = torch.tensor(x_test, dtype=torch.float32)[:, None] / 16.0
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)

    model = DigitCNN()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=gen)
        for i in range(0, len(order), args.batch_size):
            idx = order[i:i + args.batch_size]
            loss = F.cross_entropy(model(random_shift(x_train[idx], gen)), y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    seconds = time.perf_counter() - start
    model.eval()
    acc = accuracy(model, x_test, y_test)
    print(f"trained {args.epochs} epochs in {seconds:.1f} s; held-out accuracy {acc:.4f} "
          f"({len(x_test)} images); train accuracy {accuracy(model, x_train, y_train):.4f}")
    if acc < MIN_ACCURACY:
        raise SystemExit(f"held-out accuracy {acc:.4f} is below {MIN_ACCURACY}; not writing {args.out}")

    metadata = {
        "config": json.dumps(model.config),
        "seed": str(args.seed),
        "epochs": str(args.epochs),
        "heldout_accuracy": f"{acc:.6f}",
        "split": "load_digits train_test_split(test_size=0.2, random_state=0, stratify=y)",
        "input": "[B, 1, 8, 8] gray in [0, 1] = load_digits value / 16",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    # Written beside the target and renamed, so a reader never sees a half-written file.
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp), metadata=metadata)
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
