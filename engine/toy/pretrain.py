"""Flow-matching pretraining of a toy card's base model (ToyDiT + ToyPromptEncoder), deterministic.

The base model must follow prompts imperfectly, or RL has nothing to do: a
fixed fraction of the training labels is replaced by random digits once,
before training (see shared/CALIBRATION.md; early stopping is not a stable
way to get there). The same seed, thread count and CPU give the same file,
bit for bit. The scripts `scripts/pretrain_toy_digits.py` and
`scripts/pretrain_toy_numbers.py` call `pretrain` and then measure the base.

Each card draws its batches its own way (`draw_digits`, `draw_numbers`): a
batch is clean images x [B, 1, H, W] in [-1, 1] and, for each, the row of a
fixed prompt table that captions it under the noisy labels.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from engine.toy import numbers as number_prompts
from engine.toy import prompts as digit_prompts
from engine.toy.card import DIGITS, NUMBERS, SPECS, ToyCardSpec, weights_metadata, weights_state_dict
from engine.toy.data import load_digit_tensors
from engine.toy.model import ToyDiT, ToyDiTConfig
from engine.toy.text import ToyPromptEncoder, ToyTextConfig, ToyTokenizer

# draw(batch_size) -> (x0 [B, 1, H, W], prompt-table rows [B]); it draws from the pretraining generator.
BatchDrawer = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PretrainArgs:
    """Pretraining arguments (defaults: toy-digits; `CARD_DEFAULTS` has each card's)."""

    out: str = str(DIGITS.default_weights)  # where the safetensors file is written (atomically)
    seed: int = 0  # seeds model init, label noise, batches, prompts and noise
    steps: int = 1500  # optimizer steps
    batch_size: int = 128  # samples per step
    lr: float = 1e-3  # AdamW learning rate (constant)
    weight_decay: float = 0.0  # AdamW weight decay
    label_noise: float = 0.4  # fraction of train images whose label is replaced by a uniformly random digit
    prompt_dropout: float = 0.1  # fraction of prompts replaced by "" so classifier-free guidance works
    threads: int = 2  # torch threads; fixed because results depend on it
    evaluate: bool = True  # the scripts print the base eval reward of the written weights

    def problems(self) -> list[str]:
        """What no pretraining can run with, one line each (empty when every value is valid)."""
        found = []
        for name in ("steps", "batch_size", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                found.append(f"{name}={value!r}: must be a whole number >= 1")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            found.append(f"lr={self.lr!r}: must be a finite number > 0")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay)
                and self.weight_decay >= 0):
            found.append(f"weight_decay={self.weight_decay!r}: must be a finite number >= 0")
        if not (isinstance(self.label_noise, (int, float)) and 0 <= self.label_noise <= 1):
            found.append(f"label_noise={self.label_noise!r}: must be in [0, 1] (the fraction of relabelled images)")
        # 1 would drop every prompt: nothing conditional is learned.
        if not (isinstance(self.prompt_dropout, (int, float)) and 0 <= self.prompt_dropout < 1):
            found.append(f"prompt_dropout={self.prompt_dropout!r}: must be in [0, 1)")
        if Path(self.out).is_dir():
            found.append(f"out={self.out!r} is a directory: give the path of the safetensors file to write")
        return found


CARD_DEFAULTS = {
    DIGITS.card_id: PretrainArgs(),
    # One thread, so that the reproduction test can rerun it bit for bit on any machine's spare core
    # (~2 min unloaded). lr 3e-3: at toy-digits' 1e-3 the binding of digits to halves comes far later.
    NUMBERS.card_id: PretrainArgs(out=str(NUMBERS.default_weights), steps=1500, lr=3e-3, label_noise=0.4, threads=1),
}


def noisy_labels(labels: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """Replace the labels of a fixed random `fraction` of examples by uniform random digits (may hit the true one)."""
    n = labels.shape[0]
    chosen = torch.randperm(n, generator=generator)[: round(fraction * n)]
    noisy = labels.clone()
    noisy[chosen] = torch.randint(0, 10, (chosen.shape[0],), generator=generator)
    return noisy


def draw_digits(x0: torch.Tensor, labels: torch.Tensor, n_templates: int, gen: torch.Generator) -> BatchDrawer:
    """toy-digits: a random train image; its caption is row label·T + template of a digit-major table."""

    def draw(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(labels), (batch_size,), generator=gen)
        rows = labels[idx] * n_templates + torch.randint(0, n_templates, (batch_size,), generator=gen)
        return x0[idx], rows

    return draw


def draw_numbers(x0: torch.Tensor, labels: torch.Tensor, numbers: tuple[int, ...], n_templates: int,
                 gen: torch.Generator) -> BatchDrawer:
    """toy-numbers: a uniform number of `numbers`, drawn as a train image labelled with its tens digit beside
    one labelled with its units digit; its caption is row k·T + template of a number-major table."""
    # Images grouped by label: those of digit d are order[starts[d] : starts[d] + counts[d]].
    order = torch.argsort(labels, stable=True)
    counts = torch.bincount(labels, minlength=10)
    starts = torch.cumsum(counts, 0) - counts
    if (counts == 0).any():
        raise ValueError(f"no train image is labelled {counts.eq(0).nonzero().flatten().tolist()}")
    table_numbers = torch.tensor(numbers)

    def pick(digits: torch.Tensor) -> torch.Tensor:
        offset = (torch.rand(digits.shape, generator=gen) * counts[digits]).long()
        return order[starts[digits] + offset]

    def draw(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.randint(0, len(numbers), (batch_size,), generator=gen)
        tens, units = table_numbers[k] // 10, table_numbers[k] % 10
        x = torch.cat([x0[pick(tens)], x0[pick(units)]], dim=-1)  # tens digit left, units digit right
        return x, k * n_templates + torch.randint(0, n_templates, (batch_size,), generator=gen)

    return draw


def train_flow_matching(transformer: ToyDiT, text_encoder: ToyPromptEncoder, table: list[str],
                        tokenizer: ToyTokenizer, draw: BatchDrawer, args: PretrainArgs, gen: torch.Generator,
                        desc: str) -> tuple[float, float]:
    """Rectified-flow training on captioned batches; returns (final loss, its EMA). `table[-1]` must be ""."""
    if table[-1] != "":
        raise ValueError("the prompt table's last row must be the empty (unconditional) prompt")
    table_ids, table_mask = tokenizer(table, max_length=text_encoder.config.max_length)
    empty_row = len(table) - 1
    params = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    transformer.train()
    text_encoder.train()
    bar = tqdm(range(args.steps), desc=desc, mininterval=1.0)
    ema_loss = value = None
    for _ in bar:
        x, rows = draw(args.batch_size)
        drop = torch.rand(args.batch_size, generator=gen) < args.prompt_dropout
        rows = torch.where(drop, torch.full_like(rows, empty_row), rows)
        t = torch.rand(args.batch_size, generator=gen)
        eps = torch.randn(x.shape, generator=gen)

        x_t = (1 - t)[:, None, None, None] * x + t[:, None, None, None] * eps
        if len(table) <= args.batch_size:
            # A small table is encoded whole and its rows gathered: the same gradients as
            # encoding the batch's prompts, for a fraction of the text-encoder work.
            embeds, pooled = text_encoder(table_ids, table_mask)
            mask = table_mask
        else:  # a large one: only the rows this batch uses, once each
            used, rows = torch.unique(rows, return_inverse=True)
            embeds, pooled = text_encoder(table_ids[used], table_mask[used])
            mask = table_mask[used]
        v = transformer(x_t, embeds[rows], pooled[rows], t * 1000.0, mask[rows])
        loss = F.mse_loss(v, eps - x)

        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()  # host sync is fine here: this is a CPU training script, not the denoise loop
        ema_loss = value if ema_loss is None else 0.98 * ema_loss + 0.02 * value
        bar.set_postfix(loss=f"{ema_loss:.4f}", refresh=False)
    transformer.eval()
    text_encoder.eval().requires_grad_(False)
    return value, ema_loss


@dataclass
class ToyTask:
    """What a card pretrains: its tokenizer, prompt table (last row ""), batch drawer and module shapes."""

    tokenizer: ToyTokenizer
    table: list[str]
    draw: BatchDrawer
    transformer_config: ToyDiTConfig
    text_config: ToyTextConfig


def _task(spec: ToyCardSpec, args: PretrainArgs, gen: torch.Generator) -> ToyTask:
    """A card's pretraining task, with its noisy labels drawn from `gen`."""
    x0, clean_labels = load_digit_tensors("train")
    labels = noisy_labels(clean_labels, args.label_noise, gen)
    print(f"train split: {len(labels)} images; label noise {args.label_noise:g} "
          f"({float((labels != clean_labels).float().mean()):.1%} of labels wrong)")
    if spec is DIGITS:
        templates = digit_prompts.TRAIN_TEMPLATES
        table = [digit_prompts.make_prompt(d, t) for d in range(10) for t in templates] + [""]
        tokenizer = ToyTokenizer()
        text_config = ToyTextConfig(vocab_size=tokenizer.vocab_size)
        return ToyTask(tokenizer, table, draw_digits(x0, labels, len(templates), gen),
                       ToyDiTConfig(text_dim=text_config.dim), text_config)
    templates, train_numbers = number_prompts.TRAIN_TEMPLATES, number_prompts.TRAIN_NUMBERS
    table = [number_prompts.make_number_prompt(n, t) for n in train_numbers for t in templates] + [""]
    tokenizer = ToyTokenizer(number_prompts.VOCABULARY, numerals_apart=True)
    # Prompts are at most 9 tokens and <bos>: 10 positions, not 16, is a shorter joint sequence.
    text_config = ToyTextConfig(vocab_size=tokenizer.vocab_size, max_length=10)
    # Patch 4: 8 image tokens, not 32, a quarter of the attention and MLP work, so pretraining fits
    # in a test. Position embeddings at scale 1: the model learns which half draws which digit in
    # a few hundred steps, where 0.02 takes over a thousand (measured; see the README).
    transformer_config = ToyDiTConfig(sample_size=spec.height, sample_width=spec.width, patch_size=4,
                                      pos_embed_std=1.0, text_dim=text_config.dim)
    return ToyTask(tokenizer, table, draw_numbers(x0, labels, train_numbers, len(templates), gen),
                   transformer_config, text_config)


def pretrain(card_id: str, args: PretrainArgs | None = None) -> Path:
    """Pretrain a toy card's base model and write its weights to `args.out` (atomically); returns the path.

    Sets torch's thread count and deterministic mode for the process (the scripts' job; a caller that
    needs them back restores them).
    """
    if card_id not in SPECS:
        raise ValueError(f"no toy card {card_id!r}; valid: {', '.join(SPECS)}")
    spec = SPECS[card_id]
    args = replace(CARD_DEFAULTS[card_id]) if args is None else args
    if args.problems():  # before any step: a bad value found after minutes of training loses them
        raise ValueError(f"pretraining {card_id}: {'; '.join(args.problems())}")
    torch.set_num_threads(args.threads)
    # The backward of a row gather (index_put_ with accumulate) is otherwise
    # nondeterministic across runs on the CPU; the same seed must give the same file.
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    task = _task(spec, args, gen)
    tokenizer = task.tokenizer
    transformer = ToyDiT(task.transformer_config)
    text_encoder = ToyPromptEncoder(task.text_config)
    print(f"parameters: transformer {sum(p.numel() for p in transformer.parameters()):,}, "
          f"text encoder {sum(p.numel() for p in text_encoder.parameters()):,}")

    start = time.perf_counter()
    value, ema_loss = train_flow_matching(transformer, text_encoder, task.table, tokenizer, task.draw, args, gen,
                                          desc=f"pretrain {card_id}")
    elapsed = time.perf_counter() - start
    print(f"trained {args.steps} steps in {elapsed:.1f} s ({args.steps / elapsed:.1f} steps/s); "
          f"final loss {value:.4f} (EMA {ema_loss:.4f})")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    meta = weights_metadata(transformer, text_encoder, tokenizer, spec, seed=args.seed, steps=args.steps,
                            batch_size=args.batch_size, lr=args.lr, label_noise=args.label_noise,
                            prompt_dropout=args.prompt_dropout, threads=args.threads,
                            final_loss=f"{value:.5f}", final_loss_ema=f"{ema_loss:.5f}")
    save_file(weights_state_dict(transformer, text_encoder), str(tmp), metadata=meta)
    os.chmod(tmp, 0o644)  # safetensors creates the file owner-only; the shipped weights are for everyone to read
    os.replace(tmp, out)  # atomic: a reader never sees a half-written file
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    return out
