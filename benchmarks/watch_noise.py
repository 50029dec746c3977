"""How far do the judges' per-class means move on noise alone, against the hacking watch's class tolerance?

    python benchmarks/watch_noise.py --json out.json     # both toy cards, 12 evaluation sets, 4 and 16 seeds
    python benchmarks/watch_noise.py --quick             # toy-digits, 4 sets of 4 seeds (under a minute)

What runs: each toy card's shipped base model, never trained, evaluated as a recipe evaluates it (its
held-out prompts, the default sampler and eval guidance, the card's judges), on `--repeats` disjoint seed
sets (`eval_samples(..., seed_offset=...)`) of `--eval-seeds` seeds a prompt (the recipes' default,
`eval.seeds`, is 4). Nothing changes between two sets but the seeds, so every difference is noise: the
noise of which seeds an evaluation happens to use. (A run evaluates at fixed seeds, so between two of its
evaluations the seeds are the same and the model has moved; how much of a class's movement there is noise
is not measured here.)

What it reports, per card and seeds a prompt, as medians over the judges' class series (10 classes x 2
judges on the toy cards):
- `sd`: the std over the sets of a class's judge mean; `drop_sd`: the std of the difference of two sets'
  means (what the watch compares with its class tolerance, 0.1);
- `over_tolerance`: the fraction of those differences above the class tolerance, across all series;
- `false_alarm_rising`: the sets replayed (in `--orders` shuffled orders) as the evaluations of a run
  whose reward rises at every evaluation while its judge is pure noise, through the watch as shipped;
  the fraction of evaluations after the first at which it fired.

JSON (flat): `<card>_s<seeds>_sd_median`, `_drop_sd_median`, `_over_tolerance`, `_false_alarm_rising`,
`_eval_s` (seconds an evaluation), and `repeats`, `orders`, `class_tolerance`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import Column, add_report_args, print_table, write_json  # noqa: E402 (shared flags, table, JSON)
from flywheel.rollout_collector import RESERVED_CLASS_NAMES  # noqa: E402 (eval/judge/<name>/<these> are not classes)

CARDS = {"toy-digits": "digit_alignment", "toy-numbers": "number_alignment"}
SEED_STRIDE = 1_000  # seed sets [offset, offset + seeds) never overlap (seeds a prompt stays under this)


def evaluate(card: str, repeats: int, seeds: int) -> list[dict[str, float]]:
    """The base model of `card` evaluated on `repeats` disjoint sets of `seeds` seeds a prompt."""
    from tqdm import tqdm

    from engine import Engine, load_model
    from flywheel.config.sections import EvalConfig, SamplingConfig, eval_request_kwargs
    from flywheel.prompts import load_prompts
    from flywheel.rollout_collector import EVAL_SEED_OFFSET, eval_samples
    from rewards import RewardSet
    from rewards.judges import judges_for_card

    engine = Engine(load_model(card))
    rewards, judges = RewardSet(CARDS[card]), judges_for_card(card)
    items = load_prompts(f"{card}-heldout")
    kwargs = eval_request_kwargs(SamplingConfig(), EvalConfig())
    return [eval_samples(engine, rewards, items, seeds, kwargs, judges,
                         seed_offset=EVAL_SEED_OFFSET + r * SEED_STRIDE)[0]
            for r in tqdm(range(repeats), desc=f"{card}, {seeds} seeds: evaluation sets", unit="set")]


def class_series(evals: list[dict[str, float]]) -> dict[str, list[float]]:
    """judge/class -> its mean in each evaluation, for every per-class judge key present in all of them."""
    keys = [k for k in evals[0] if k.startswith("eval/judge/") and k.count("/") == 3
            and k.rsplit("/", 1)[1] not in RESERVED_CLASS_NAMES]
    return {k[len("eval/judge/"):]: [e[k] for e in evals] for k in keys if all(k in e for e in evals)}


def noise_figures(evals: list[dict[str, float]], class_tolerance: float) -> dict[str, float]:
    """Medians over the class series of the std of a class mean and of a difference of two evaluations' means,
    and the fraction of all those differences above `class_tolerance`."""
    series = class_series(evals)
    if not series:
        raise ValueError("the evaluations hold no per-class judge means (eval/judge/<name>/<class>)")
    diffs = {k: [a - b for i, a in enumerate(m) for b in m[i + 1:]] for k, m in series.items()}
    every = [d for ds in diffs.values() for d in ds]
    return {"sd_median": statistics.median(statistics.stdev(m) for m in series.values()),
            # A difference a - b and b - a are the same pair: its std is that of the signed differences.
            "drop_sd_median": statistics.median(statistics.pstdev(ds + [-d for d in ds]) for ds in diffs.values()),
            "over_tolerance": sum(abs(d) > class_tolerance for d in every) / len(every),
            "class_series": float(len(series))}


def rising(evals: list[dict[str, float]]) -> list[dict[str, float]]:
    """The same evaluations with every reward metric replaced by a ramp that rises at each one."""
    return [{k: (float(i) if k.startswith("eval/reward/") else v) for k, v in e.items()} for i, e in enumerate(evals)]


def false_alarm_rate(evals: list[dict[str, float]], orders: int, seed: int = 0) -> float:
    """The fraction of evaluations (after each replay's first) at which the shipped watch fired, over `orders`
    shuffled replays of `evals` with a rising reward."""
    from flywheel.hacking_watch import HackingWatch

    rng = random.Random(seed)
    fired = total = 0
    for _ in range(orders):
        order = list(evals)
        rng.shuffle(order)
        watch = HackingWatch()
        for i, metrics in enumerate(rising(order)):
            result = watch.observe(metrics, step=10 * i)
            if i:
                fired += bool(result.signals)
                total += 1
    return fired / total


def parse_ints(text: str, flag: str, parser: argparse.ArgumentParser, minimum: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{flag} must be comma-separated integers, got {text!r}")
    if not values or any(v < minimum for v in values):
        parser.error(f"{flag} must be integers >= {minimum}, got {text!r}")
    return values


def main() -> None:
    from flywheel.hacking_watch import HackingWatch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cards", default=",".join(CARDS), help=f"comma-separated, of {', '.join(CARDS)}")
    parser.add_argument("--repeats", type=int, default=12, help="evaluation sets per card (default 12, >= 3)")
    parser.add_argument("--eval-seeds", default="4,16", help="seeds a prompt, comma-separated (default 4,16)")
    parser.add_argument("--orders", type=int, default=50, help="shuffled replays of the sets (default 50)")
    add_report_args(parser, quick="toy-digits only, 4 sets of 4 seeds (under a minute)")
    args = parser.parse_args()
    cards = ["toy-digits"] if args.quick else [c.strip() for c in args.cards.split(",") if c.strip()]
    unknown = [c for c in cards if c not in CARDS]
    if unknown or not cards:
        parser.error(f"--cards: unknown or none ({', '.join(unknown)}); valid: {', '.join(CARDS)}")
    repeats = 4 if args.quick else args.repeats
    if repeats < 3:
        parser.error(f"--repeats must be >= 3 (a std over sets, and a run of evaluations), got {repeats}")
    if args.orders < 1:
        parser.error(f"--orders must be >= 1, got {args.orders}")
    seeds_list = [4] if args.quick else parse_ints(args.eval_seeds, "--eval-seeds", parser, 2)
    if max(seeds_list) >= SEED_STRIDE:
        parser.error(f"--eval-seeds must stay under {SEED_STRIDE} (the sets would overlap)")

    tolerance = HackingWatch().class_tolerance
    result: dict = {"repeats": repeats, "orders": args.orders, "class_tolerance": tolerance}
    rows = []
    for card in cards:
        for seeds in seeds_list:
            start = time.perf_counter()
            evals = evaluate(card, repeats, seeds)
            name = f"{card.replace('-', '_')}_s{seeds}"
            figures = noise_figures(evals, tolerance)
            figures["eval_s"] = (time.perf_counter() - start) / repeats
            figures["false_alarm_rising"] = false_alarm_rate(evals, args.orders)
            result.update({f"{name}_{k}": v for k, v in figures.items()})
            rows.append([card, seeds, figures["sd_median"], figures["drop_sd_median"], figures["over_tolerance"],
                         figures["false_alarm_rising"], figures["eval_s"]])
    print_table([Column("card", 13, align="<"), Column("seeds", 6), Column("sd", 8, ".3f"),
                 Column("drop sd", 9, ".3f"), Column(f"> {tolerance:g}", 8, ".2f"),
                 Column("fired", 8, ".2f"), Column("eval s", 8, ".2f")], rows)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
