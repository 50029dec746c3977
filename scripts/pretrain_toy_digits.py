"""Pretrain the `toy-digits` base model (ToyDiT + ToyPromptEncoder) with flow matching.

The base model must follow prompts imperfectly, or RL has nothing to do: a
fixed fraction of the training labels is replaced by random digits once,
before training (see shared/CALIBRATION.md; early stopping is not a stable
way to get there). Deterministic for a given --seed and --threads.

    python scripts/pretrain_toy_digits.py            # writes engine/toy/weights/toy-digits.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from engine.toy.card import DEFAULT_WEIGHTS, weights_metadata, weights_state_dict  # noqa: E402
from engine.toy.data import load_digit_tensors  # noqa: E402
from engine.toy.model import ToyDiT, ToyDiTConfig  # noqa: E402
from engine.toy.prompts import TRAIN_TEMPLATES, make_prompt  # noqa: E402
from engine.toy.text import ToyPromptEncoder, ToyTextConfig, ToyTokenizer  # noqa: E402


@dataclass
class Args:
    """Pretraining arguments."""

    out: str = str(DEFAULT_WEIGHTS)  # where the safetensors file is written (atomically)
    seed: int = 0  # seeds model init, label noise, batches, prompts and noise
    steps: int = 1500  # optimizer steps (~5-8 steps/s on 2 CPU cores)
    batch_size: int = 128  # samples per step
    lr: float = 1e-3  # AdamW learning rate (constant)
    weight_decay: float = 0.0  # AdamW weight decay
    label_noise: float = 0.4  # fraction of train images whose label is replaced by a uniformly random digit
    prompt_dropout: float = 0.1  # fraction of prompts replaced by "" so classifier-free guidance works
    threads: int = 2  # torch threads; fixed because results depend on it
    evaluate: bool = True  # print the base eval reward of the written weights (as the GRPO recipe measures it)


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in vars(Args()).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    return Args(**vars(parser.parse_args()))


def noisy_labels(labels: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """Replace the labels of a fixed random `fraction` of examples by uniform random digits (may hit the true one)."""
    n = labels.shape[0]
    chosen = torch.randperm(n, generator=generator)[: round(fraction * n)]
    noisy = labels.clone()
    noisy[chosen] = torch.randint(0, 10, (chosen.shape[0],), generator=generator)
    return noisy


def evaluate_base(weights: Path) -> None:
    """The base model's eval reward, measured exactly as trainers/grpo.py measures step 0."""
    from engine import Engine, load_model
    from flywheel.loop import evaluate
    from flywheel.prompts import load_prompts
    from rewards import RewardSet
    from rewards.judges import DigitJudge

    engine = Engine(load_model("toy-digits", path=str(weights)))
    for guidance in (1.0, 3.0):
        metrics, _ = evaluate(engine, RewardSet("digit_alignment"), load_prompts("toy-digits-heldout"), 4,
                              {"steps": 10, "sampler": "ode", "guidance_scale": guidance},
                              {"digit_svc": DigitJudge()})
        print(f"base eval at guidance {guidance:g} (held-out prompts x 4 seeds, 10 ODE steps): "
              f"digit_alignment {metrics['eval/reward/digit_alignment/mean']:.3f}, "
              f"judge {metrics['eval/judge/digit_svc/mean']:.3f}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # The backward of a row gather (index_put_ with accumulate) is otherwise
    # nondeterministic across runs on the CPU; the same seed must give the same file.
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    x0, clean_labels = load_digit_tensors("train")
    labels = noisy_labels(clean_labels, args.label_noise, gen)
    print(f"train split: {len(labels)} images; label noise {args.label_noise:g} "
          f"({float((labels != clean_labels).float().mean()):.1%} of labels wrong)")

    tokenizer = ToyTokenizer()
    text_config = ToyTextConfig(vocab_size=tokenizer.vocab_size)
    transformer = ToyDiT(ToyDiTConfig(text_dim=text_config.dim))
    text_encoder = ToyPromptEncoder(text_config)
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    print(f"parameters: transformer {sum(p.numel() for p in transformer.parameters()):,}, "
          f"text encoder {sum(p.numel() for p in text_encoder.parameters()):,}")

    # Every prompt the batches can draw, tokenized once: row d * T + j is digit d with
    # template j; the last row is the empty (unconditional) prompt.
    n_templates = len(TRAIN_TEMPLATES)
    table = [make_prompt(d, t) for d in range(10) for t in TRAIN_TEMPLATES] + [""]
    table_ids, table_mask = tokenizer(table, max_length=text_config.max_length)
    empty_row = len(table) - 1

    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    transformer.train()
    text_encoder.train()
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="pretrain toy-digits", mininterval=1.0)
    ema_loss = None
    for _ in bar:
        idx = torch.randint(0, len(labels), (args.batch_size,), generator=gen)
        x = x0[idx]
        rows = labels[idx] * n_templates + torch.randint(0, n_templates, (args.batch_size,), generator=gen)
        drop = torch.rand(args.batch_size, generator=gen) < args.prompt_dropout
        rows = torch.where(drop, torch.full_like(rows, empty_row), rows)
        t = torch.rand(args.batch_size, generator=gen)
        eps = torch.randn(x.shape, generator=gen)

        x_t = (1 - t)[:, None, None, None] * x + t[:, None, None, None] * eps
        # Encode the small prompt table once and gather rows: the same gradients as
        # encoding the batch's prompts, for a fraction of the text-encoder work.
        table_embeds, table_pooled = text_encoder(table_ids, table_mask)
        v = transformer(x_t, table_embeds[rows], table_pooled[rows], t * 1000.0, table_mask[rows])
        loss = F.mse_loss(v, eps - x)

        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()  # host sync is fine here: this is a CPU training script, not the denoise loop
        ema_loss = value if ema_loss is None else 0.98 * ema_loss + 0.02 * value
        bar.set_postfix(loss=f"{ema_loss:.4f}", refresh=False)
    elapsed = time.perf_counter() - start
    print(f"trained {args.steps} steps in {elapsed:.1f} s ({args.steps / elapsed:.1f} steps/s); "
          f"final loss {value:.4f} (EMA {ema_loss:.4f})")

    transformer.eval()
    text_encoder.eval().requires_grad_(False)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    meta = weights_metadata(transformer, text_encoder, tokenizer, seed=args.seed, steps=args.steps,
                            batch_size=args.batch_size, lr=args.lr, label_noise=args.label_noise,
                            prompt_dropout=args.prompt_dropout, threads=args.threads,
                            final_loss=f"{value:.5f}", final_loss_ema=f"{ema_loss:.5f}")
    save_file(weights_state_dict(transformer, text_encoder), str(tmp), metadata=meta)
    os.chmod(tmp, 0o644)  # safetensors creates the file owner-only; the shipped weights are for everyone to read
    os.replace(tmp, out)  # atomic: a reader never sees a half-written file
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")

    if args.evaluate:
        evaluate_base(out)


if __name__ == "__main__":
    main()
