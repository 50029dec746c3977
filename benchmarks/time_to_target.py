"""Wall time (and rollout samples) until each recipe's eval reward first reaches a target on toy-numbers, on
every seed.

    python benchmarks/time_to_target.py --seeds 0,1,2 --json out.json   # the full run (these are its defaults)
    python benchmarks/time_to_target.py --quick                    # one seed, under 3 minutes (see QUICK below)
    python benchmarks/time_to_target.py --recipes grpo,nft --out-dir runs/ttt    # keep the run dirs
    python benchmarks/time_to_target.py --configs 'configs/toy_{recipe}.yaml' -- steps=40   # toy-digits
    python benchmarks/time_to_target.py --cached         # also nft+cache, awm+cache, dpo+cache (cached rollouts)

What runs: each recipe as its own process (`python trainers/<recipe>.py --config
configs/toy_numbers_<recipe>.yaml ...`; the GRPO options mixgrpo, grpo_fast,
grpo_guard and dppo run trainers/grpo.py with their own config; `<recipe>+cache`, for
the recipes that train no per-step log-probs (nft, awm, dpo: `--cached` adds one for
each of them that runs, or name it in `--recipes`), runs the recipe's own config with
its training rollouts through the adaptive loop, `sampling.cache_threshold=
--cache-threshold`, default 0.15), one after another so each has every
core, with its own documented default config for this task (how each was tuned
is written in that file), the same `seed`, an evaluation every `--eval-every`
steps, no tracker, and sample grids and checkpoints only at the end (harness
settings that cost every recipe the same), once per seed of `--seeds`
(default 0,1,2; `--quick`: 0), every recipe of a seed before the next seed.
Each run ends `--stop-after-target N` evaluations after it reached the target
(default 2; `--quick`: 0: one seed of the 9 recipes with every configured step
took 7 min 45 s on 2 quiet cores, so 3 seeds that stop early fit in 40 minutes), or runs its configured steps with `--no-stop` or when
it never gets there. Overrides after `--` go to every recipe. Before anything runs, the configs are resolved and must agree on what
makes the runs comparable (`COMPARABLE_KEYS`: card, reward, prompts, prompts per step x
group size, seed, evaluation prompts, seeds, steps and guidance); a
disagreement is an error naming the keys. Also refused before anything runs: a `--target`
above the reward's declared range (rewards.registry.total_reward_bounds), `--cached` when no
recipe it applies to runs, and a `--json` or `--plot` path that cannot be written.

What is measured, from each run's metrics.jsonl (read with flywheel.runs.compare):

- time to target: `time/wall_s` of the first evaluation whose
  `eval/reward/mean` (ODE samples of the held-out prompts, at the eval
  guidance, 1 in these configs) is >= `--target`. `time/wall_s` counts from
  just before the base evaluation: rollouts, rewards, updates and the
  evaluations themselves, not process start and model loading (the same for
  every recipe). It is only known at evaluations, so it is resolved to
  `--eval-every` steps. Steps and rollout samples to target (step x
  prompts_per_step x group_size; evaluation samples are not counted) are
  taken at the same row, and so are the judge (`number_svc` where logged,
  else the run's first judge: an independent classifier never used as a
  reward), the typicality judge (`number_typicality`: is the sample like a
  real one of its class) and the diversity (`eval/diversity` where the recipe
  logs it, else the training rollouts' `diversity`), the latter relative to
  the base weights' (the step-0 evaluation's, or the first rollouts').
- final and best eval reward, final judge, the run's wall time.
- over seeds: each recipe's median, min and max of the time and steps to
  target, and each seed's judge, typicality and relative diversity at target.
- eligible: a recipe whose judge at target is >= `--min-judge` on every seed
  (its worst seed counts; a seed that never reached the target fails it), so
  a recipe that games the reward classifier on one seed does not count. Best
  recipe: the eligible one with the lowest median time to target;
  best_speedup_over_grpo = GRPO's median time / the best recipe's median
  time; best_speedup_over_grpo_worst_seed = the smallest over seeds of GRPO's
  time / the best recipe's time on that same seed.

JSON (flat, `--json PATH`), per recipe, the median over seeds of:
`<recipe>_time_to_target_s`, `_train_time_to_target_s` (the same without the
evaluations: the sum of time/step_s up to that step), `_samples_to_target`,
`_steps_to_target` (each the string "inf" when the target was never reached:
JSON has no infinity, and float("inf") reads it back), `_reward_at_target`,
`_judge_at_target`, `_diversity_at_target` (null when never reached),
`_final_reward`, `_final_judge`, `_best_reward`, `_wall_s`, `_process_s` (the
whole process, start and model loading included); `_time_to_target_s_median`,
`_min`, `_max` and the same for `_steps_to_target`; per seed (lists in
`--seeds` order) `_time_to_target_s_seeds`, `_steps_to_target_seeds`,
`_judge_at_target_seeds`, `_typicality_at_target_seeds`,
`_diversity_rel_at_target_seeds`, and their worst seed
`_judge_at_target_min`, `_typicality_at_target_min`,
`_diversity_rel_at_target_min` (null when a seed has none); `_judge_ok`
(eligible) and `_stopped_early` (every seed's run was). Then `best_recipe`
(null when no recipe is eligible), `eligible_recipes`,
`best_speedup_over_grpo` (null without a GRPO run or a best recipe, "inf"
when GRPO's median never reached the target), `best_speedup_over_grpo_worst_seed`,
`best_speedup_over_grpo_at_least` (when GRPO's median is "inf": GRPO's median
whole run time over the best recipe's median time, a lower bound; else null),
`best_judge_at_target` (the best recipe's worst seed), `target`, `min_judge`,
`seeds`, `judge`, `quick`, `samples_per_step`, `eval.every`, `card`,
`eval_guidance_scale`, `stop_after_target`. A PNG (`--plot`) shows eval
reward and judge against wall time: each recipe's median over seeds with its
min-max band, the target and the judge bar drawn, each recipe's median time to
target dotted, with a bar along the target from its fastest to its slowest seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.runs.compare import (FIGURE_DPI, REWARD_KEY, STEP_TIME_KEY, Run, RunDirError,  # noqa: E402
                                   import_pyplot, format_duration, format_value, judge_key, load_runs,
                                   render_table, summarize)
from benchmarks.report import add_report_args, finite_float, writable_file, write_json  # noqa: E402 (the shared --json/--quick flags and JSON)
from flywheel.runs.rundir import atomic_write_bytes  # noqa: E402

DEFAULT_RECIPES = ("grpo", "nft", "awm", "dpo", "mixgrpo", "grpo_fast", "grpo_guard", "dppo", "draft")
# Entries that are options of another recipe's trainer: name -> trainers/<trainer>.py. A name that is not
# here runs trainers/<name>.py. Each still has its own configs/toy_numbers_<name>.yaml.
VARIANT_TRAINERS = {"mixgrpo": "grpo", "grpo_fast": "grpo", "grpo_guard": "grpo", "dppo": "grpo"}
# `<recipe>+cache`: the recipe's config with cached training rollouts (sampling.cache_threshold), offered for the
# recipes whose rollouts are ODE samples they train no per-step log-probs of (GRPO's steps are all stochastic).
CACHED_SUFFIX = "+cache"
DECOUPLED_RECIPES = ("nft", "awm", "dpo")
DEFAULT_CACHE_THRESHOLD = 0.15  # the adaptive loop's toy eval: 1.89x images/s, reward within 0.01 (README)
BASELINE = "grpo"
DEFAULT_CONFIGS = "configs/toy_numbers_{recipe}.yaml"
PREFERRED_JUDGE = "number_svc"  # toy-numbers' SVC judge; other cards: the run's first judge
TYPICALITY_JUDGE = "number_typicality"  # toy-numbers' typicality judge; other cards: the first *typicality
NEVER = "inf"  # what the JSON holds for a time/steps/samples to a target never reached
NEVER_RUN_STEP = 10**9  # sample_every / save_every: only at the end of the run
POLL_S = 1.0  # --stop-after-target: how often a running recipe's metrics are read

# Settings that must be equal across recipes for their times to compare.
COMPARABLE_KEYS = ("model.card", "reward.scorers", "data.prompts", "data.eval_prompts", "data.prompts_per_step",
                   "data.group_size",
                   "seed", "eval.every", "eval.guidance_scale", "eval.seeds",
                   "eval.steps", "sampling.height", "sampling.width")


@dataclasses.dataclass(frozen=True)
class QuickMode:
    """--quick: fewer steps, evaluation every few steps on one seed a prompt, a lower target, early stop."""

    steps: int
    eval_every: int
    eval_seeds: int
    target: float
    stop_after_target: int
    min_judge: float


# Meant for under 3 minutes for the three recipes on 2 cores. The target is one GRPO reaches within the quick
# steps, so the speedup is a number rather than "inf": on the toy-numbers card of this writing (base eval
# reward 0.20) GRPO's default config, with the quick settings and seed 0, was at 0.287 after 18 steps, 0.308
# after 21 and 0.366 after 30. A recipe stops at its first evaluation at the target. No judge bar: at so low
# a target the judge is low too (number_svc 0.22 at reward 0.31); it is still reported.
QUICK = QuickMode(steps=30, eval_every=3, eval_seeds=1, target=0.3, stop_after_target=0, min_judge=0.0)
QUICK_SEED = 0
# The full run: three seeds, each run ended two evaluations (10 steps at eval.every 5) after its target, so the
# values just after the crossing are seen and no run spends its remaining steps once it is decided.
FULL_SEEDS = (0, 1, 2)
FULL_STOP_AFTER_TARGET = 2


class BenchmarkError(ValueError):
    """The benchmark cannot run as asked (missing recipe or config, configs that disagree, a failed run)."""


# ---------------------------------------------------------------------------
# Time to target, from a run's metric rows
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class TargetResult:
    """What one recipe's run (one seed) says about reaching the target (None: not logged)."""

    recipe: str
    judge: str | None
    reached: bool
    steps_to_target: float  # inf when never reached (as the two below)
    samples_to_target: float
    time_to_target_s: float
    train_time_to_target_s: float  # the same without the evaluations: the sum of time/step_s up to the crossing
    reward_at_target: float | None
    judge_at_target: float | None
    diversity_at_target: float | None
    final_reward: float | None
    final_judge: float | None
    best_reward: float | None
    best_reward_step: int | None
    wall_s: float | None
    steps_done: int
    typicality_at_target: float | None = None  # the typicality judge (number_typicality) at the crossing
    diversity_base: float | None = None  # the diversity of the base weights' samples (see `base_value`)
    seed: int | None = None

    @property
    def diversity_rel_at_target(self) -> float | None:
        """Diversity at the crossing relative to the base's (1 = as diverse as before training)."""
        if self.diversity_at_target is None or not self.diversity_base:
            return None
        return self.diversity_at_target / self.diversity_base


def pick_judge(run: Run) -> str | None:
    """`PREFERRED_JUDGE` when the run logged it, else its first judge, else None."""
    judges = run.judges()
    if PREFERRED_JUDGE in judges:
        return PREFERRED_JUDGE
    return judges[0] if judges else None


def pick_typicality(run: Run) -> str | None:
    """`TYPICALITY_JUDGE` when the run logged it, else its first judge named *typicality, else None."""
    judges = run.judges()
    if TYPICALITY_JUDGE in judges:
        return TYPICALITY_JUDGE
    return next((j for j in judges if j.endswith("typicality")), None)


def value_at_step(run: Run, key: str | None, step: int) -> float | None:
    """The finite value of `key` in the row of `step`; None when that row does not hold one."""
    if key is None:
        return None
    return next((value for s, _, value in run.series(key) if s == step), None)


def base_value(run: Run, key: str | None) -> float | None:
    """The base weights' value of `key`: the step-0 evaluation's (eval/diversity), else the first logged value
    (the training rollouts' diversity: step 1's rollouts are made by the base weights, weight version 0)."""
    if key is None:
        return None
    points = run.series(key)
    at_zero = next((v for s, _, v in points if s == 0), None)
    return at_zero if at_zero is not None else (points[0][2] if points else None)


def step_seconds_until(run: Run, step: int) -> float:
    """Sum of `time/step_s` (rollout, reward, update; evaluation not included) of the steps 1..`step`."""
    return sum(value for s, _, value in run.series(STEP_TIME_KEY) if s <= step)


def time_to_target(run: Run, target: float, samples_per_step: int, recipe: str | None = None,
                   seed: int | None = None) -> TargetResult:
    """The first evaluation of `run` whose eval reward is >= `target`, and the run's final and best values.

    Values "at target" are read from that evaluation's own row, not from a
    later one. A run that never reaches the target gets inf for its steps,
    samples and time, and None for the values at target.
    """
    judge = pick_judge(run)
    typicality = pick_typicality(run)
    summary = summarize(run, judge)
    crossing = next(((step, wall, value) for step, wall, value in run.series(REWARD_KEY) if value >= target), None)
    at_target: dict[str, Any] = {"reached": False, "steps_to_target": math.inf, "samples_to_target": math.inf,
                                 "time_to_target_s": math.inf, "train_time_to_target_s": math.inf,
                                 "reward_at_target": None, "judge_at_target": None,
                                 "diversity_at_target": None, "typicality_at_target": None}
    if crossing is not None:
        step, wall, reward = crossing
        at_target = {"reached": True, "steps_to_target": step, "samples_to_target": step * samples_per_step,
                     "time_to_target_s": wall, "train_time_to_target_s": step_seconds_until(run, step),
                     "reward_at_target": reward,
                     "judge_at_target": value_at_step(run, judge_key(judge) if judge else None, step),
                     "diversity_at_target": value_at_step(run, run.diversity_key(), step),
                     "typicality_at_target": value_at_step(run, judge_key(typicality) if typicality else None, step)}
    return TargetResult(recipe=recipe or run.recipe, judge=judge, **at_target,
                        final_reward=summary.reward_final, final_judge=summary.judge_final,
                        best_reward=summary.reward_best, best_reward_step=summary.reward_best_step,
                        wall_s=summary.wall_s, steps_done=summary.steps_done,
                        diversity_base=base_value(run, run.diversity_key()), seed=seed)


def judge_ok(result: TargetResult, min_judge: float) -> bool:
    """Reached the target with the judge agreeing: judge at target >= min_judge (no judge logged: not ok)."""
    return result.reached and result.judge_at_target is not None and result.judge_at_target >= min_judge


# ---------------------------------------------------------------------------
# Over seeds: each recipe's median and spread, and which recipes may be best
# ---------------------------------------------------------------------------


def by_recipe(results_by_seed: dict[int, list[TargetResult]]) -> dict[str, list[TargetResult]]:
    """{recipe: its results, one a seed, in seed order}; every seed must have run the same recipes."""
    seeds = list(results_by_seed)
    recipes = [r.recipe for r in results_by_seed[seeds[0]]] if seeds else []
    out: dict[str, list[TargetResult]] = {recipe: [] for recipe in recipes}
    for seed in seeds:
        names = [r.recipe for r in results_by_seed[seed]]
        if names != recipes:
            raise ValueError(f"seed {seed} ran {names}, seed {seeds[0]} ran {recipes}: every seed runs the same "
                             "recipes")
        for r in results_by_seed[seed]:
            out[r.recipe].append(r)
    return out


def spread(values: list[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of the values that are there (None ones left out); all None without any.

    inf counts (a seed that never reached the target): the median of [10, 20, inf] is 20, its max inf.
    """
    present = [v for v in values if v is not None]
    if not present:
        return None, None, None
    return statistics.median(present), min(present), max(present)


def lowest(values: list[float | None]) -> float | None:
    """The worst seed's value: the minimum, None if any seed has none (a seed that never reached the target
    has no judge there, and must not be hidden by the others)."""
    return None if not values or any(v is None for v in values) else min(values)


def eligible(results: list[TargetResult], min_judge: float) -> bool:
    """A recipe may be best only when every seed reached the target with its judge >= min_judge there."""
    return bool(results) and all(judge_ok(r, min_judge) for r in results)


def pair_speedup(baseline: TargetResult, best: TargetResult) -> float:
    """GRPO's time to target over the other's, on one seed (inf when only GRPO never reached it or the other's
    base evaluation was already at the target; 1.0 when both were)."""
    if best.time_to_target_s == 0:
        return 1.0 if baseline.time_to_target_s == 0 else math.inf
    return baseline.time_to_target_s / best.time_to_target_s


def rank_over_seeds(per_recipe: dict[str, list[TargetResult]], min_judge: float
                    ) -> tuple[str | None, float | None, float | None]:
    """(best recipe, GRPO's median time over its median time, the smallest of the per-seed speedups).

    The best recipe is the eligible one (`eligible`: its worst seed counts) with
    the lowest median time to target; the first listed wins a tie. The speedups
    are None without a GRPO run or an eligible recipe; the worst-seed one pairs
    the runs of one seed (the same prompts and noise) and keeps the smallest.
    """
    counted = [recipe for recipe, results in per_recipe.items() if eligible(results, min_judge)]
    if not counted:
        return None, None, None
    median_time = {recipe: spread([r.time_to_target_s for r in per_recipe[recipe]])[0] for recipe in counted}
    best = min(counted, key=lambda recipe: median_time[recipe])
    if BASELINE not in per_recipe:
        return best, None, None
    grpo_median = spread([r.time_to_target_s for r in per_recipe[BASELINE]])[0]
    if median_time[best] == 0:
        speedup = 1.0 if grpo_median == 0 else math.inf
    else:
        speedup = grpo_median / median_time[best]
    worst = min(pair_speedup(g, b) for g, b in zip(per_recipe[BASELINE], per_recipe[best]))
    return best, speedup, worst


def best_and_speedup(results: list[TargetResult], min_judge: float) -> tuple[str | None, float | None]:
    """One seed's (best recipe, GRPO's time over its time): `rank_over_seeds` of a single seed."""
    best, speedup, _ = rank_over_seeds(by_recipe({0: results}), min_judge)
    return best, speedup


def speedup_lower_bound(per_recipe: dict[str, list[TargetResult]], best_recipe: str | None) -> float | None:
    """GRPO's median whole run time over the best recipe's median time to target, when GRPO's median time is inf.

    GRPO would have needed more than its whole run, so an "inf" speedup is at
    least this much; None when GRPO's median is finite (the speedup is then
    exact) or there is no GRPO run or best recipe.
    """
    if BASELINE not in per_recipe or best_recipe not in per_recipe:
        return None
    grpo = per_recipe[BASELINE]
    if math.isfinite(spread([r.time_to_target_s for r in grpo])[0]):
        return None
    walls = [r.wall_s for r in grpo]
    if any(w is None for w in walls):
        return None
    best_time = spread([r.time_to_target_s for r in per_recipe[best_recipe]])[0]
    return statistics.median(walls) / best_time if best_time > 0 else math.inf


def _json_number(value: float | None) -> float | str | None:
    """inf as the string "inf", NaN as null: strict JSON has neither."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, float) and math.isinf(value):
        return NEVER
    return value


# Per recipe: the median over seeds under the plain name, and for these also _min and _max.
MEDIAN_KEYS = ("time_to_target_s", "train_time_to_target_s", "samples_to_target", "steps_to_target",
               "reward_at_target", "judge_at_target", "diversity_at_target", "final_reward", "final_judge",
               "best_reward", "wall_s")
SPREAD_KEYS = ("time_to_target_s", "steps_to_target")
# Per recipe and seed (a list, in --seeds order), and their worst seed (_min).
PER_SEED_KEYS = ("time_to_target_s", "steps_to_target", "judge_at_target", "typicality_at_target",
                 "diversity_rel_at_target")


def results_json(results: list[TargetResult] | dict[int, list[TargetResult]], target: float, min_judge: float,
                 **extra: Any) -> dict[str, Any]:
    """The flat JSON object (see the module docstring for its keys) of one seed's results or {seed: results}."""
    results_by_seed = results if isinstance(results, dict) else {0: results}
    per_recipe = by_recipe(results_by_seed)
    out: dict[str, Any] = {}
    for recipe, runs in per_recipe.items():
        for name in MEDIAN_KEYS:
            median, low, high = spread([getattr(r, name) for r in runs])
            out[f"{recipe}_{name}"] = _json_number(median)
            if name in SPREAD_KEYS:
                out[f"{recipe}_{name}_median"] = _json_number(median)
                out[f"{recipe}_{name}_min"] = _json_number(low)
                out[f"{recipe}_{name}_max"] = _json_number(high)
        for name in PER_SEED_KEYS:
            out[f"{recipe}_{name}_seeds"] = [_json_number(getattr(r, name)) for r in runs]
        for name in ("judge_at_target", "typicality_at_target", "diversity_rel_at_target"):
            out[f"{recipe}_{name}_min"] = _json_number(lowest([getattr(r, name) for r in runs]))
        out[f"{recipe}_judge_ok"] = eligible(runs, min_judge)
    best, speedup, worst = rank_over_seeds(per_recipe, min_judge)
    out["best_recipe"] = best
    out["eligible_recipes"] = [recipe for recipe, runs in per_recipe.items() if eligible(runs, min_judge)]
    out["best_speedup_over_grpo"] = _json_number(speedup)
    out["best_speedup_over_grpo_worst_seed"] = _json_number(worst)
    out["best_speedup_over_grpo_at_least"] = _json_number(speedup_lower_bound(per_recipe, best))
    out["best_judge_at_target"] = (None if best is None else
                                   _json_number(lowest([r.judge_at_target for r in per_recipe[best]])))
    out["target"] = target
    out["min_judge"] = min_judge
    out["seeds"] = list(results_by_seed)
    out["judge"] = next((r.judge for runs in per_recipe.values() for r in runs if r.judge), None)
    out.update(extra)
    return out


# ---------------------------------------------------------------------------
# Configs: which recipes exist, and that their configs agree
# ---------------------------------------------------------------------------


def base_recipe(recipe: str) -> str:
    """The recipe an entry runs the config of: `nft` for `nft+cache`, else the entry itself."""
    return recipe[:-len(CACHED_SUFFIX)] if recipe.endswith(CACHED_SUFFIX) else recipe


def trainer_of(recipe: str) -> str:
    """The trainer module a benchmark entry runs: its own name, or the recipe it is an option of."""
    return VARIANT_TRAINERS.get(base_recipe(recipe), base_recipe(recipe))


def recipe_overrides(recipe: str, cache_threshold: float) -> list[str]:
    """What an entry adds to its recipe's config (before the user's overrides): the cache of `<recipe>+cache`."""
    return [f"sampling.cache_threshold={cache_threshold}"] if recipe.endswith(CACHED_SUFFIX) else []


def recipe_missing(recipe: str, config_path: Path) -> str | None:
    """Why `recipe` cannot run (no trainers/<trainer>.py with a main(), or no config file); None when it can."""
    trainer = ROOT / "trainers" / f"{trainer_of(recipe)}.py"
    if not trainer.is_file():
        return (f"{trainer.relative_to(ROOT)} does not exist (the recipes: {', '.join(DEFAULT_RECIPES)}; each of "
                f"{', '.join(DECOUPLED_RECIPES)} also as <recipe>{CACHED_SUFFIX})")
    if not re.search(r"^def main\(", trainer.read_text(encoding="utf-8"), re.MULTILINE):
        return f"{trainer.relative_to(ROOT)} has no main() yet"
    if not config_path.is_file():
        return f"{config_path} does not exist"
    return None


def config_path_for(pattern: str, recipe: str) -> Path:
    try:
        path = Path(pattern.format(recipe=base_recipe(recipe)))
    except (KeyError, IndexError, ValueError) as e:  # a field other than {recipe}, or an unclosed brace
        raise BenchmarkError(f"--configs {pattern!r} is not a pattern with {{recipe}} as its one field ({e!r}); "
                             f"for example {DEFAULT_CONFIGS}") from None
    return path if path.is_absolute() else ROOT / path


def resolve_recipe_config(recipe: str, config_path: Path, overrides: list[str]):
    """The recipe's Config as its process will see it (defaults, the YAML file, then the overrides), checked.

    The recipe's own `validate_config` runs here too, so a bad config fails
    before any recipe has spent minutes running.
    """
    from flywheel.config.parsing import ConfigError, parse_config

    module = importlib.import_module(f"trainers.{trainer_of(recipe)}")
    try:
        cfg = parse_config(module.Config, ["--config", str(config_path), *overrides])
        getattr(module, "validate_config", lambda cfg: None)(cfg)
        return cfg
    except ConfigError as e:
        raise BenchmarkError(f"{recipe} ({config_path}): {e}") from e


def comparable_settings(cfg) -> dict[str, Any]:
    """The values of `COMPARABLE_KEYS` in a resolved config (eval steps: `sampling.steps` when unset)."""
    from flywheel.config.validation import config_value

    settings = {key: config_value(cfg, key) for key in COMPARABLE_KEYS}
    if settings["eval.steps"] is None:
        settings["eval.steps"] = cfg.sampling.steps
    return settings


def check_agreement(settings: dict[str, dict[str, Any]]) -> None:
    """BenchmarkError naming every key on which the recipes' settings differ, with each recipe's value."""
    keys = [k for k in COMPARABLE_KEYS if any(k in s for s in settings.values())]
    lines = []
    for key in keys:
        values = {recipe: s.get(key) for recipe, s in settings.items()}
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
            lines.append(f"  {key}: " + ", ".join(f"{recipe}={v!r}" for recipe, v in values.items()))
    if lines:
        raise BenchmarkError("the recipes' configs disagree on settings that must be equal for their times to "
                             "compare:\n" + "\n".join(lines) + "\nmake the configs agree, or pass key=value after "
                             "-- (it goes to every recipe)")


# ---------------------------------------------------------------------------
# Running the recipes
# ---------------------------------------------------------------------------


def evaluations_since_target(run_dir: Path, target: float) -> int | None:
    """How many evaluations a run (maybe still running) logged after its first at or above `target`; None before."""
    try:
        rewards = [value for _, _, value in Run.load(run_dir).series(REWARD_KEY)]
    except RunDirError:  # not started writing yet
        return None
    first = next((i for i, value in enumerate(rewards) if value >= target), None)
    return None if first is None else len(rewards) - 1 - first


def run_recipe(recipe: str, config_path: Path, run_dir: Path, overrides: list[str], log_path: Path,
               stop_after: tuple[float, int] | None = None) -> tuple[float, bool]:
    """Run the recipe's trainer (trainers/<trainer_of(recipe)>.py) in its own process, output to `log_path`; (its wall seconds, stopped early).

    With `stop_after=(target, n)` the process is ended (SIGTERM) once its run
    has logged n evaluations after the first at or above `target`; otherwise
    it runs its configured steps.
    """
    command = [sys.executable, str(ROOT / "trainers" / f"{trainer_of(recipe)}.py"), "--config", str(config_path),
               f"run_dir={run_dir}", *overrides]
    start = time.perf_counter()
    stopped = False
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        # The checkout's own packages first, so the benchmark runs this tree even without (or beside) an install.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                try:
                    process.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    since = evaluations_since_target(run_dir, stop_after[0]) if stop_after else None
                    if since is not None and since >= stop_after[1]:
                        process.terminate()
                        process.wait()
                        stopped = True
                        break
        finally:
            if process.poll() is None:  # the benchmark itself was interrupted: leave no orphan training
                process.kill()
                process.wait()
    seconds = time.perf_counter() - start
    if process.returncode != 0 and not stopped:
        tail = "".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines(True)[-15:])
        raise BenchmarkError(f"{recipe} failed (exit {process.returncode}); the end of {log_path}:\n{tail}")
    return seconds, stopped


# Keys the harness sets for every run and reports, with the flag that sets them: an override after -- would
# change what ran but not what the JSON says ran (seed=5 for every "seed"), or point a run away from the folder
# the benchmark reads (run_dir).
HARNESS_FLAGS = {"seed": "use --seeds", "eval.every": "use --eval-every", "run_dir": "use --out-dir to keep the runs",
                 "resume": "each run starts fresh", "overwrite": "use --overwrite with --out-dir"}


def harness_overrides(seed: int, eval_every: int, quick: bool, overwrite: bool) -> list[str]:
    """The overrides every recipe gets before the user's (so the user's win)."""
    out = [f"seed={seed}", "tracker=none", f"eval.every={eval_every}", f"sample_every={NEVER_RUN_STEP}",
           f"save_every={NEVER_RUN_STEP}"]
    if quick:
        out += [f"steps={QUICK.steps}", f"eval.seeds={QUICK.eval_seeds}"]
    if overwrite:
        out.append("overwrite=true")
    return out


# ---------------------------------------------------------------------------
# Table and plot
# ---------------------------------------------------------------------------


TABLE_HEADER = ["recipe", "time to target", "without evals", "steps", "judge @target", "typicality @target",
                "diversity @target", "final reward", "eligible"]


def _count(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:.0f}"


def _spread_text(values: list[float], fmt) -> str:
    """"median [min-max]" of a recipe's seeds ("median" alone for one seed or no spread)."""
    median, low, high = spread(values)
    if median is None:
        return "-"
    text = fmt(median)
    return text if low == high else f"{text} [{fmt(low)}-{fmt(high)}]"


def _seeds_text(values: list[float | None]) -> str:
    """Each seed's value, "/"-separated ("-" where a seed has none)."""
    return "/".join(format_value(v, 2) if v is not None else "-" for v in values)


def results_table(results: list[TargetResult] | dict[int, list[TargetResult]], min_judge: float = 0.0) -> str:
    """One line a recipe: the median [min-max] over seeds of its time and steps to target, the judge,
    typicality and diversity (relative to the base) at target on each seed, and whether it is eligible."""
    per_recipe = by_recipe(results if isinstance(results, dict) else {0: results})
    lines = []
    for recipe, runs in per_recipe.items():
        duration = lambda v: "never" if math.isinf(v) else format_duration(v)  # noqa: E731
        lines.append([recipe, _spread_text([r.time_to_target_s for r in runs], duration),
                      _spread_text([r.train_time_to_target_s for r in runs], duration),
                      _spread_text([r.steps_to_target for r in runs], _count),
                      _seeds_text([r.judge_at_target for r in runs]),
                      _seeds_text([r.typicality_at_target for r in runs]),
                      _seeds_text([r.diversity_rel_at_target for r in runs]),
                      _spread_text([r.final_reward for r in runs], format_value),
                      "yes" if eligible(runs, min_judge) else "no"])
    return render_table(TABLE_HEADER, lines)


def seed_curves(runs: list[Run], key: str | None) -> list[tuple[int, float, float, float, float]]:
    """(step, median wall time, median, min, max) over the seeds' runs of `key` at each evaluation step any of them
    logged (a seed stopped early leaves the later steps to the others)."""
    if key is None:
        return []
    by_step: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        for step, wall, value in run.series(key):
            by_step.setdefault(step, []).append((wall, value))
    out = []
    for step in sorted(by_step):
        walls, values = [w for w, _ in by_step[step]], [v for _, v in by_step[step]]
        out.append((step, statistics.median(walls), statistics.median(values), min(values), max(values)))
    return out


def plot_time_to_target(runs: list[Run] | dict[str, list[Run]], results, target: float, min_judge: float,
                        out: str | os.PathLike) -> Path:
    """A PNG of eval reward (left) and judge (right) against wall time: each recipe's median over seeds, its
    min-max band shaded, and its time to target (median, with a bar from the fastest to the slowest seed)."""
    if not isinstance(runs, dict):  # one seed: a list of runs and their results, recipe by recipe
        runs = {r.recipe: [run] for run, r in zip(runs, results)}
        results = {0: list(results)}
    per_recipe = by_recipe(results if isinstance(results, dict) else {0: results})
    plt = import_pyplot()
    fig, (reward_ax, judge_ax) = plt.subplots(1, 2, figsize=(11.0, 4.2), dpi=FIGURE_DPI)
    try:
        for i, (recipe, seed_results) in enumerate(per_recipe.items()):
            color = f"C{i % 10}"
            judge = next((r.judge for r in seed_results if r.judge), None)
            for ax, key, label in ((reward_ax, REWARD_KEY, recipe),
                                   (judge_ax, judge_key(judge) if judge else None, f"{recipe} ({judge or 'no judge'})")):
                curve = seed_curves(runs[recipe], key)
                if not curve:
                    continue
                walls = [c[1] for c in curve]
                ax.plot(walls, [c[2] for c in curve], marker="o", markersize=3, color=color, label=label)
                if len(runs[recipe]) > 1:
                    ax.fill_between(walls, [c[3] for c in curve], [c[4] for c in curve], color=color, alpha=0.15,
                                    linewidth=0)
            median, low, high = spread([r.time_to_target_s for r in seed_results])
            if median is not None and math.isfinite(median):
                for ax in (reward_ax, judge_ax):
                    ax.axvline(median, color=color, linestyle=":", linewidth=1)
                if math.isfinite(high) and high > low:
                    reward_ax.plot([low, high], [target, target], color=color, linewidth=3, alpha=0.6,
                                   solid_capstyle="butt")
        reward_ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
        if min_judge > 0:
            judge_ax.axhline(min_judge, color="black", linestyle="--", linewidth=1, label=f"judge bar {min_judge:g}")
        seeds = len(next(iter(runs.values()), []))
        band = f"median of {seeds} seeds, band min-max; " if seeds > 1 else ""
        for ax, title in ((reward_ax, "eval reward"), (judge_ax, "eval judge")):
            ax.set_title(f"{title} ({band}dotted: time to target)", fontsize=9)
            ax.set_xlabel("wall time (s)")
            values = [v for line in ax.get_lines() for v in line.get_ydata()]
            if all(0.0 <= v <= 1.0 for v in values):  # probabilities (the toy rewards, judges): one common scale
                ax.set_ylim(0.0, 1.02)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=FIGURE_DPI)
    finally:
        plt.close(fig)
    return atomic_write_bytes(out, buffer.getvalue())


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", help=f"comma-separated recipes (default: those of {','.join(DEFAULT_RECIPES)} "
                                          "that have a main() and a config)")
    parser.add_argument("--cached", action="store_true",
                        help=f"also run <recipe>{CACHED_SUFFIX} for each of {', '.join(DECOUPLED_RECIPES)} that runs: "
                             "its config with cached training rollouts (sampling.cache_threshold)")
    parser.add_argument("--cache-threshold", type=finite_float, default=None,
                        help=f"sampling.cache_threshold of the {CACHED_SUFFIX} entries (default "
                             f"{DEFAULT_CACHE_THRESHOLD}), in (0, 1]")
    parser.add_argument("--target", type=finite_float, help=f"eval reward to reach (default 0.8; --quick: {QUICK.target})")
    parser.add_argument("--min-judge", type=finite_float,
                        help=f"judge at target a recipe needs to count as best (default 0.8; --quick: "
                             f"{QUICK.min_judge})")
    parser.add_argument("--seeds", help=f"comma-separated seeds; every recipe runs once per seed (default "
                                        f"{','.join(map(str, FULL_SEEDS))}; --quick: {QUICK_SEED})")
    parser.add_argument("--seed", type=int, help="one seed (the same as --seeds N)")
    parser.add_argument("--eval-every", type=int,
                        help=f"evaluate every N steps, every recipe (default 5; --quick: {QUICK.eval_every})")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"config file of each recipe, {{recipe}} replaced (default {DEFAULT_CONFIGS})")
    parser.add_argument("--out-dir", type=Path,
                        help="keep the run dirs and logs here (<out-dir>/<recipe>); default a temporary folder")
    parser.add_argument("--overwrite", action="store_true", help="reuse run dirs under --out-dir that hold a run")
    parser.add_argument("--plot", type=writable_file,
                        help="PNG of reward and judge vs wall time (default time_to_target.png beside --json, or in "
                             "the current directory)")
    add_report_args(parser,
                    quick=f"{QUICK.steps} steps, eval every {QUICK.eval_every} on {QUICK.eval_seeds} seed a "
                          f"prompt, target {QUICK.target}, stop after target {QUICK.stop_after_target}, "
                          f"min judge {QUICK.min_judge} (under 3 minutes)")
    parser.add_argument("--stop-after-target", type=int, metavar="N",
                        help=f"end each run N evaluations after it reached the target (its final values are then "
                             f"those of the shortened run; default {FULL_STOP_AFTER_TARGET}, --quick: "
                             f"{QUICK.stop_after_target})")
    parser.add_argument("--no-stop", action="store_true",
                        help="run every recipe its configured steps, even after the target")
    parser.add_argument("--check-only", action="store_true",
                        help="resolve and check the recipes' configs (and that they agree), run nothing")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every recipe (after --)")
    args = parser.parse_args(argv)
    if args.target is None:
        args.target = QUICK.target if args.quick else 0.8
    if args.min_judge is None:
        args.min_judge = QUICK.min_judge if args.quick else 0.8
    if args.eval_every is None:
        args.eval_every = QUICK.eval_every if args.quick else 5
    if args.no_stop and args.stop_after_target is not None:
        parser.error("--no-stop and --stop-after-target contradict each other: give one")
    if args.stop_after_target is None and not args.no_stop:
        args.stop_after_target = QUICK.stop_after_target if args.quick else FULL_STOP_AFTER_TARGET
    if args.seeds is not None and args.seed is not None:
        parser.error("--seeds and --seed: give one")
    if args.seeds is not None:
        try:
            args.seeds = [int(x) for x in args.seeds.split(",")]
        except ValueError:
            parser.error(f"--seeds must be comma-separated integers (no empty entry), got {args.seeds!r}")
        if not args.seeds or len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
            parser.error("--seeds must name distinct integers >= 0")
    else:
        args.seeds = [args.seed] if args.seed is not None else [QUICK_SEED] if args.quick else list(FULL_SEEDS)
    if args.cache_threshold is not None and not args.cached and "+cache" not in (args.recipes or ""):
        parser.error(f"--cache-threshold {args.cache_threshold:g} sets the {CACHED_SUFFIX} entries' "
                     f"sampling.cache_threshold, and none runs: add --cached (or a <recipe>{CACHED_SUFFIX} to "
                     "--recipes), or leave it out")
    if args.cache_threshold is None:
        args.cache_threshold = DEFAULT_CACHE_THRESHOLD
    if args.overwrite and args.out_dir is None:
        parser.error("--overwrite reuses run dirs under --out-dir; without --out-dir every run has a fresh "
                     "temporary one: give --out-dir, or leave --overwrite out")
    owned = [o for o in args.overrides if o.split("=", 1)[0].strip() in HARNESS_FLAGS]
    if owned:
        flags = {HARNESS_FLAGS[o.split("=", 1)[0].strip()] for o in owned}
        parser.error(f"{', '.join(owned)} after --: the benchmark sets it for every run and reports it "
                     f"({'; '.join(sorted(flags))})")
    if not 0 < args.cache_threshold <= 1:
        parser.error(f"--cache-threshold must be in (0, 1] (0 would be the plain loop), got {args.cache_threshold}")
    if args.eval_every < 1:
        parser.error(f"--eval-every must be >= 1, got {args.eval_every}")
    if args.stop_after_target is not None and args.stop_after_target < 0:
        parser.error(f"--stop-after-target must be >= 0 (evaluations after the target), got {args.stop_after_target}")
    if args.plot is None:
        try:
            args.plot = writable_file(str((args.json.parent if args.json else Path.cwd()) / "time_to_target.png"))
        except argparse.ArgumentTypeError as e:
            parser.error(f"--plot (its default, beside --json or here): {e}; give --plot PATH")
    return args


def choose_recipes(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(recipe, config path) to run: those asked for (each must exist), or the defaults that exist."""
    asked = [r.strip() for r in args.recipes.split(",") if r.strip()] if args.recipes else None
    chosen = []
    for recipe in asked or DEFAULT_RECIPES:
        if not re.fullmatch(r"[a-z0-9_]+(\+cache)?", recipe):
            raise BenchmarkError(f"--recipes: {recipe!r} is not a recipe name (trainers/<name>.py, or "
                                 f"<name>{CACHED_SUFFIX})")
        if recipe.endswith(CACHED_SUFFIX) and base_recipe(recipe) not in DECOUPLED_RECIPES:
            raise BenchmarkError(f"--recipes {recipe}: cached rollouts are for the recipes that train no per-step "
                                 f"log-probs ({', '.join(DECOUPLED_RECIPES)}); a GRPO rollout skips model calls "
                                 "only after its SDE window (set sampling.sde_window and sampling.cache_threshold "
                                 "in its config instead)")
        path = config_path_for(args.configs, recipe)
        missing = recipe_missing(recipe, path)
        if missing and asked:
            raise BenchmarkError(f"--recipes {recipe}: {missing}")
        if missing:
            print(f"skipping {recipe}: {missing}")
            continue
        chosen.append((recipe, path))
    if args.cached:
        added = [(recipe + CACHED_SUFFIX, path) for recipe, path in list(chosen) if recipe in DECOUPLED_RECIPES
                 and (recipe + CACHED_SUFFIX, path) not in chosen]
        if not added:
            raise BenchmarkError(f"--cached adds <recipe>{CACHED_SUFFIX} for each of {', '.join(DECOUPLED_RECIPES)} "
                                 f"that runs, and none of them is in --recipes {args.recipes or '(the defaults)'} (or each already has "
                                 f"its {CACHED_SUFFIX} entry); add one, or leave --cached out")
        chosen += added
    if not chosen:
        raise BenchmarkError(f"no recipe to run: none of {', '.join(DEFAULT_RECIPES)} has a trainer with a main() "
                             f"and a config matching {args.configs}")
    if len({r for r, _ in chosen}) != len(chosen):
        raise BenchmarkError(f"--recipes {args.recipes}: a recipe is named twice")
    return chosen


def check_target_reachable(target: float, spec: str) -> None:
    """A --target above what the eval reward can take (its scorers' declared output_range, weighted) is refused:
    no recipe could reach it, so every run would go its whole length to report "never". (One at or under the
    floor is left alone: the base evaluation reaches it, which a smoke test may want.)"""
    from rewards.registry import total_reward_bounds

    bounds = total_reward_bounds(spec)
    if bounds is not None and target > bounds[1]:
        raise BenchmarkError(f"--target {target:g}: the eval reward ({spec}) lies in [{bounds[0]:g}, {bounds[1]:g}], "
                             f"so no recipe can reach it; choose a target of at most {bounds[1]:g}")


def seed_dir(out_dir: Path, seed: int) -> Path:
    """Where one seed's runs and logs go: <out-dir>/seed_<seed>/<recipe> and <recipe>.log."""
    return out_dir / f"seed_{seed}"


def run_benchmark(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    recipes = choose_recipes(args)
    # Per seed and entry: the harness's, the entry's own (its cache), then the user's, so the user's win.
    overrides = {seed: {recipe: harness_overrides(seed, args.eval_every, args.quick, args.overwrite)
                        + recipe_overrides(recipe, args.cache_threshold) + list(args.overrides)
                        for recipe, _ in recipes} for seed in args.seeds}
    for seed in args.seeds:
        for recipe, _ in recipes:
            run_dir = seed_dir(out_dir, seed) / recipe
            if run_dir.exists() and any(run_dir.iterdir()) and not args.overwrite:
                raise BenchmarkError(f"{run_dir} holds an earlier run: give another --out-dir, or --overwrite")
    # Checked with the run dir the harness will use: the config file's own run_dir (runs/<recipe>-toy-numbers)
    # may hold the user's earlier run, which this benchmark never touches.
    first_seed = args.seeds[0]
    configs = {recipe: resolve_recipe_config(recipe, path, [*overrides[first_seed][recipe],
                                                            f"run_dir={seed_dir(out_dir, first_seed) / recipe}"])
               for recipe, path in recipes}
    settings = {recipe: comparable_settings(cfg) for recipe, cfg in configs.items()}
    check_agreement(settings)
    check_target_reachable(args.target, next(iter(settings.values()))["reward.scorers"])
    first = next(iter(settings.values()))
    samples_per_step = first["data.prompts_per_step"] * first["data.group_size"]
    if args.check_only:
        print("the configs agree: " + ", ".join(f"{k}={v}" for k, v in first.items()))
        for recipe, _ in recipes:
            cache = configs[recipe].sampling.cache_threshold
            print(f"  {recipe}: {configs[recipe].steps} steps" + (f", sampling.cache_threshold={cache:g}" if cache else ""))
        print(f"  seeds: {','.join(map(str, args.seeds))}")
        return {}

    process_s: dict[str, list[float]] = {recipe: [] for recipe, _ in recipes}
    stopped: dict[str, list[bool]] = {recipe: [] for recipe, _ in recipes}
    stop_after = (args.target, args.stop_after_target) if args.stop_after_target is not None else None
    for seed in args.seeds:
        folder = seed_dir(out_dir, seed)
        folder.mkdir(parents=True, exist_ok=True)
        for recipe, path in recipes:
            print(f"running {recipe} seed {seed} ({path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}, "
                  f"{configs[recipe].steps} steps) ...", flush=True)
            seconds, early = run_recipe(recipe, path, folder / recipe, overrides[seed][recipe], folder / f"{recipe}.log",
                                        stop_after)
            process_s[recipe].append(seconds)
            stopped[recipe].append(early)
    runs = {recipe: load_runs([seed_dir(out_dir, seed) / recipe for seed in args.seeds]) for recipe, _ in recipes}
    results = {seed: [time_to_target(runs[recipe][i], args.target, samples_per_step, recipe=recipe, seed=seed)
                      for recipe, _ in recipes] for i, seed in enumerate(args.seeds)}

    print(results_table(results, args.min_judge))
    out = results_json(results, args.target, args.min_judge, quick=args.quick, samples_per_step=samples_per_step,
                       eval_every=args.eval_every, card=first["model.card"],
                       eval_guidance_scale=first["eval.guidance_scale"],
                       stop_after_target=args.stop_after_target,
                       **{f"{recipe}_process_s": statistics.median(s) for recipe, s in process_s.items()},
                       **{f"{recipe}_stopped_early": all(s) for recipe, s in stopped.items()})
    speedup, worst, at_least = (out["best_speedup_over_grpo"], out["best_speedup_over_grpo_worst_seed"],
                                out["best_speedup_over_grpo_at_least"])
    number = lambda v: format_value(v, 2) if isinstance(v, float) else v or "-"  # noqa: E731
    print(f"target {args.target:g}, seeds {','.join(map(str, args.seeds))}: best {out['best_recipe'] or '-'} "
          f"(judge at target >= {args.min_judge:g} on every seed; eligible: "
          f"{', '.join(out['eligible_recipes']) or 'none'}), speedup over grpo {number(speedup)} (median), "
          f"{number(worst)} (worst seed)"
          + (f" (grpo's median never reached it: at least {format_value(at_least, 2)})" if isinstance(at_least, float)
             else ""))
    print(f"wrote {plot_time_to_target(runs, results, args.target, args.min_judge, args.plot)}")
    if args.json:
        print(f"wrote {write_json(args.json, out)}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            run_benchmark(args, args.out_dir.resolve())
        else:
            with tempfile.TemporaryDirectory(prefix="time-to-target-") as tmp:
                run_benchmark(args, Path(tmp))
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunDirError as e:  # a run's folder or metrics.jsonl that cannot be read: one line, not a traceback
        print(f"error: reading a run: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
