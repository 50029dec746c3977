"""The adaptive (cached) denoise loop against the plain loop: images/s and what it costs in quality.

    python benchmarks/adaptive_loop.py --json out.json
    python benchmarks/adaptive_loop.py --quick          # about a minute

Toy (toy-digits, the shipped weights): the recipes' evaluation as it runs in
training (`flywheel.rollout_collector.eval_samples`: the toy-digits-heldout prompts x 4 fixed
seeds, ODE, guidance 1, `--toy-steps` steps, 10 being the recipes' default),
with the `digit_alignment` reward. Each setting (a cache threshold, or an
early-exit tolerance alone) runs the same evaluation; its eval reward is
compared with the plain loop's (reward_drop = plain - adaptive, so a negative
drop is a rise), and so are its images (max / mean absolute pixel difference).

Tiny SD3 (tests/tiny_models/core.py, random weights, 2 layers, 64x64 images,
CFG 3, 10 steps on the folder's shift-3 schedule): images/s and the max / mean
pixel difference against the plain loop. Random weights make no pictures: this
shows the loop runs on a real family and what it changes, not a quality figure.

Timing: the variants of one card are timed side by side in this process, one
`Engine.generate` of the whole batch each, interleaved round by round (the order
rotating), and the medians compared, so a noisy machine slows every variant
alike. speedup = plain median time / adaptive median time at the same step count.

Settings: t<threshold> skips with cache order 1 (a skipped step extrapolates
the velocity from the row's last two model calls), t<threshold>o0 with order 0
(the last call's velocity as it is), ee<tolerance> an early exit alone.

JSON (flat): per toy step count S and setting X
`toy_steps<S>_<X>_speedup`, `_reward`, `_reward_drop`, `_steps_computed` (mean
model calls per image), `_call_ratio` (steps / model calls: the speedup a machine with no other
work and no per-step overhead would see), `_cache_hit_rate`, `_max_pixel_diff`, `_mean_pixel_diff`,
and `toy_steps<S>_plain_reward`, `_plain_images_per_s`; per SD3 threshold
`sd3_<X>_speedup`, `_steps_computed`, `_call_ratio`, `_max_pixel_diff`, `_mean_pixel_diff`;
then `speedup_at_reward_drop_0_01` (the largest toy speedup at the recipes'
eval steps, 10, among settings whose reward drop is <= 0.01; 1.0 if none; null
when 10 was not measured), `speedup_at_reward_within_0_01` (the same with
|reward change| <= 0.01: a rise counts against it too), both also per step count
with a `_steps<S>` suffix, and the run's settings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_models: the tests' tiny folders

from benchmarks.report import Column, add_report_args, print_table, write_json  # noqa: E402 (the shared --json/--quick flags, table and JSON)

RECIPE_EVAL_STEPS = 10  # SamplingConfig.steps: the recipes' evaluation runs at their rollout steps
REWARD_TOLERANCE = 0.01
SD3_PROMPTS = ("a red cat", "a blue dog", "a green tree", "a white house")


def setting_name(threshold: float, early_exit: float | None, order: int = 1) -> str:
    """t<threshold> (cache order 1), t<threshold>o0 (order 0: plain reuse), ee<tolerance> (early exit alone)."""
    if early_exit is not None:
        return f"ee{early_exit:g}"
    return f"t{threshold:g}" + ("" if order == 1 else f"o{order}")


def time_side_by_side(engine, variants: dict[str, list], rounds: int) -> dict[str, float]:
    """Median seconds of one `engine.generate(requests)` per variant, rounds interleaved, order rotating."""
    names = list(variants)
    for name in names:  # warm-up (and prompt cache fill)
        engine.generate(variants[name])
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            engine.generate(variants[name])
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in times.items()}


def pixel_diff(images, reference) -> tuple[float, float]:
    diff = (images.float() - reference.float()).abs()
    return float(diff.max()), float(diff.mean())


def toy_curve(steps: int, settings: list[tuple[float, float | None, int]], rounds: int) -> dict:
    """Eval reward, images and timing of every setting against the plain loop at `steps` steps."""
    from engine import Engine, load_model
    from flywheel.rollout_collector import EVAL_SEED_OFFSET, eval_samples, item_request
    from flywheel.prompts import load_prompts
    from flywheel.config.sections import EvalConfig, SamplingConfig, eval_request_kwargs
    from rewards import RewardSet

    engine = Engine(load_model("toy-digits"))
    rewards = RewardSet("digit_alignment")
    items = load_prompts("toy-digits-heldout")
    sampling, evaluation = SamplingConfig(), EvalConfig(steps=steps)
    seeds = evaluation.seeds
    base_kwargs = eval_request_kwargs(sampling, evaluation)
    kwargs = {"plain": base_kwargs}
    kwargs.update({setting_name(th, ee, order): {**base_kwargs, "cache_threshold": th, "early_exit": ee,
                                                  "cache_order": order}
                   for th, ee, order in settings})
    evaluated = {name: eval_samples(engine, rewards, items, seeds, kw) for name, kw in kwargs.items()}
    variants = {name: [item_request(item, EVAL_SEED_OFFSET + s, engine.card_id, kw)
                       for item in items for s in range(seeds)] for name, kw in kwargs.items()}
    times = time_side_by_side(engine, variants, rounds)
    plain_metrics, plain_traj = evaluated["plain"]
    out = {"plain_reward": plain_metrics["eval/reward/mean"], "plain_images_per_s": len(plain_traj) / times["plain"],
           "images": len(plain_traj)}
    for name in kwargs:
        if name == "plain":
            continue
        metrics, traj = evaluated[name]
        max_diff, mean_diff = pixel_diff(traj.images, plain_traj.images)
        out[name] = {"speedup": times["plain"] / times[name], "images_per_s": len(traj) / times[name],
                     "reward": metrics["eval/reward/mean"],
                     "reward_drop": plain_metrics["eval/reward/mean"] - metrics["eval/reward/mean"],
                     "steps_computed": float(traj.steps_computed.float().mean()),
                     "call_ratio": traj.num_steps / float(traj.steps_computed.float().mean()),
                     "cache_hit_rate": float(traj.cache_hit_rate.mean()),
                     "max_pixel_diff": max_diff, "mean_pixel_diff": mean_diff}
    return out


def sd3_curve(thresholds: list[float], orders: list[int], rounds: int, batch: int) -> dict:
    """Images/s and pixel differences of the tiny SD3 at each threshold against the plain loop."""
    from engine import Engine, GenerationRequest
    from tiny_models.core import build_tiny_sd3

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_sd3(Path(tmp) / "sd3", num_layers=2, sample_size=32)
        engine = Engine.from_card("sd3", path=str(folder))

    def requests(threshold: float, order: int = 1) -> list:
        return [GenerationRequest(prompt=SD3_PROMPTS[i % len(SD3_PROMPTS)], seed=i, card="sd3", sampler="ode",
                                  guidance_scale=3.0, height=64, width=64, steps=10, cache_threshold=threshold,
                                  cache_order=order)
                for i in range(batch)]

    variants = {"plain": requests(0.0)}
    variants.update({setting_name(th, None, order): requests(th, order) for order in orders for th in thresholds})
    plain = engine.generate(variants["plain"])
    times = time_side_by_side(engine, variants, rounds)
    out = {"plain_images_per_s": batch / times["plain"]}
    for name in variants:
        if name == "plain":
            continue
        traj = engine.generate(variants[name])
        max_diff, mean_diff = pixel_diff(traj.images, plain.images)
        out[name] = {"speedup": times["plain"] / times[name], "images_per_s": batch / times[name],
                     "steps_computed": float(traj.steps_computed.float().mean()),
                     "call_ratio": traj.num_steps / float(traj.steps_computed.float().mean()),
                     "max_pixel_diff": max_diff, "mean_pixel_diff": mean_diff}
    return out


def best_speedup(curve: dict, within: bool) -> float:
    """The largest speedup among a curve's settings whose reward drop (|change| if `within`) is <= 0.01."""
    ok = [row["speedup"] for row in curve.values() if isinstance(row, dict)
          and (abs(row["reward_drop"]) if within else row["reward_drop"]) <= REWARD_TOLERANCE]
    return max(ok, default=1.0)


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_report_args(parser, quick="fewer rounds, settings and step counts")
    parser.add_argument("--toy-steps", default=None, help="toy eval step counts, comma-separated (default 10,20)")
    parser.add_argument("--thresholds", default=None,
                        help="cache thresholds, comma-separated (default 0.05,0.07,0.1,0.15,0.2,0.3)")
    parser.add_argument("--cache-orders", default=None,
                        help="cache orders of the thresholds: 1 extrapolates from the last two calls, 0 reuses the "
                             "last call's velocity (default 1,0; quick 1)")
    parser.add_argument("--early-exits", default=None,
                        help="early-exit tolerances alone (threshold 0), comma-separated (default 0.02,0.05)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds per card (default 9, quick 3)")
    parser.add_argument("--sd3-batch", type=int, default=8, help="tiny SD3 images per batch")
    parser.add_argument("--no-sd3", action="store_true", help="skip the tiny SD3")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    quick = args.quick
    steps_list = [int(x) for x in (args.toy_steps or ("10" if quick else "10,20")).split(",")]
    thresholds = parse_floats(args.thresholds or ("0.1,0.15,0.2" if quick else "0.05,0.07,0.1,0.15,0.2,0.3"))
    early_exits = parse_floats(args.early_exits if args.early_exits is not None else ("" if quick else "0.02,0.05"))
    rounds = args.rounds or (3 if quick else 9)
    orders = [int(x) for x in (args.cache_orders or ("1" if quick else "1,0")).split(",")]

    import torch

    torch.set_num_threads(args.threads)
    settings = [(th, None, order) for order in orders for th in thresholds] + [(0.0, ee, 1) for ee in early_exits]
    result: dict = {"card": "toy-digits", "device": "cpu", "torch_threads": torch.get_num_threads(), "quick": quick,
                    "rounds": rounds, "toy_steps": ",".join(map(str, steps_list))}
    rows = []
    for steps in steps_list:
        curve = toy_curve(steps, settings, rounds)
        prefix = f"toy_steps{steps}"
        result[f"{prefix}_plain_reward"] = curve["plain_reward"]
        result[f"{prefix}_plain_images_per_s"] = curve["plain_images_per_s"]
        result[f"{prefix}_images"] = curve["images"]
        for th, ee, order in settings:
            name = setting_name(th, ee, order)
            for key, value in curve[name].items():
                result[f"{prefix}_{name}_{key}"] = value
            rows.append((f"toy {steps} steps", name, curve[name]))
        result[f"speedup_at_reward_drop_0_01_steps{steps}"] = best_speedup(curve, within=False)
        result[f"speedup_at_reward_within_0_01_steps{steps}"] = best_speedup(curve, within=True)
    recipe_steps = RECIPE_EVAL_STEPS in steps_list
    result["speedup_at_reward_drop_0_01"] = (result[f"speedup_at_reward_drop_0_01_steps{RECIPE_EVAL_STEPS}"]
                                             if recipe_steps else None)
    result["speedup_at_reward_within_0_01"] = (result[f"speedup_at_reward_within_0_01_steps{RECIPE_EVAL_STEPS}"]
                                               if recipe_steps else None)
    if not args.no_sd3:
        sd3 = sd3_curve(thresholds, orders, rounds, args.sd3_batch)
        result["sd3_plain_images_per_s"] = sd3["plain_images_per_s"]
        for name in [n for n in sd3 if n != "plain_images_per_s"]:
            for key, value in sd3[name].items():
                result[f"sd3_{name}_{key}"] = value
            rows.append(("tiny sd3 10 steps", name, sd3[name]))

    print_table([Column("run", 18, align="<"), Column("setting", 9), Column("speedup", 9, ".2f"),
                 Column("img/s", 9, ".1f"), Column("calls", 7, ".2f"), Column("steps/call", 11, ".2f"),
                 Column("reward", 9, ".4f"), Column("drop", 9, ".4f"), Column("max px", 9, ".4f"),
                 Column("mean px", 9, ".5f")],
                [(run, name, row["speedup"], row["images_per_s"], row["steps_computed"], row["call_ratio"],
                  row.get("reward"), row.get("reward_drop"), row["max_pixel_diff"], row["mean_pixel_diff"])
                 for run, name, row in rows])
    for steps in steps_list:
        print(f"toy {steps} steps: plain reward {result[f'toy_steps{steps}_plain_reward']:.4f}, "
              f"{result[f'toy_steps{steps}_plain_images_per_s']:.1f} img/s; best speedup with reward drop <= 0.01: "
              f"{result[f'speedup_at_reward_drop_0_01_steps{steps}']:.2f}x, with |change| <= 0.01: "
              f"{result[f'speedup_at_reward_within_0_01_steps{steps}']:.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
