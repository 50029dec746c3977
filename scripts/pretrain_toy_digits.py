"""Pretrain a toy card's base model with flow matching and measure it (default: `toy-digits`).

The base model must follow prompts imperfectly, or RL has nothing to do: a
fixed fraction of the training labels is replaced by random digits once,
before training (see engine/toy/pretrain.py). Deterministic for a given
--seed and --threads.

    python scripts/pretrain_toy_digits.py                      # engine/toy/weights/toy-digits.safetensors
    python scripts/pretrain_toy_digits.py --card toy-numbers   # the same as scripts/pretrain_toy_numbers.py
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from engine.toy.pretrain import CARD_DEFAULTS, PretrainArgs, pretrain  # noqa: E402

# What the base is measured on: each card's reward and held-out prompts, as the GRPO recipe measures step 0.
EVALUATION = {"toy-digits": ("digit_alignment", "toy-digits-heldout"),
              "toy-numbers": ("number_alignment", "toy-numbers-heldout")}


def parse_args(card: str, argv: list[str] | None = None) -> tuple[str, PretrainArgs]:
    """(card, its arguments): the card's defaults, overridden by flags (--card picks another card's defaults)."""
    card_parser = argparse.ArgumentParser(add_help=False)
    card_parser.add_argument("--card", choices=sorted(CARD_DEFAULTS), default=card)
    card = card_parser.parse_known_args(argv)[0].card
    parser = argparse.ArgumentParser(description=__doc__, parents=[card_parser],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in vars(CARD_DEFAULTS[card]).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    values = vars(parser.parse_args(argv))
    values.pop("card")
    args = replace(CARD_DEFAULTS[card], **values)
    if args.problems():  # usage and one error line naming the flags, exit 2, before anything trains
        flagged = []
        for problem in args.problems():  # "label_noise=2.0: ..." -> "--label-noise 2.0: ..."
            name, rest = problem.split("=", 1)
            flagged.append(f"--{name.replace('_', '-')} {rest}")
        parser.error("; ".join(flagged))
    return card, args


def evaluate_base(card: str, weights: Path) -> None:
    """The base model's eval reward and judges at guidance 1 and 3, exactly as trainers/grpo.py measures step 0."""
    from engine import Engine, load_model
    from flywheel.rollout_collector import eval_samples
    from flywheel.prompts import load_prompts
    from rewards import RewardSet
    from rewards.judges import judges_for_card

    reward, eval_prompts = EVALUATION[card]
    engine = Engine(load_model(card, path=str(weights)))
    judges = judges_for_card(card)
    for guidance in (1.0, 3.0):
        metrics, _ = eval_samples(engine, RewardSet(reward), load_prompts(eval_prompts), 4,
                              {"steps": 10, "sampler": "ode", "guidance_scale": guidance}, judges)
        judged = ", ".join(f"judge {name} {metrics[f'eval/judge/{name}/mean']:.3f}" for name in judges)
        print(f"base eval at guidance {guidance:g} ({eval_prompts} x 4 seeds, 10 ODE steps): "
              f"{reward} {metrics[f'eval/reward/{reward}/mean']:.3f}, {judged}")


def main(card: str = "toy-digits") -> None:
    card, args = parse_args(card)
    weights = pretrain(card, args)
    if args.evaluate:
        evaluate_base(card, weights)


if __name__ == "__main__":
    main()
