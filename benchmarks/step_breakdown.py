"""Seconds per GRPO step by phase (rollout, reward, train, sync), samples/s and peak memory.

    python benchmarks/step_breakdown.py --json out.json          # default config, 20 steps
    python benchmarks/step_breakdown.py --quick                  # 6 steps, under a minute
    python benchmarks/step_breakdown.py -- model.finetune=lora    # any recipe override after --

Runs the recipe itself (trainers/grpo.py) with tracking, evaluation and
checkpoints off, and averages the per-step timings it writes to
metrics.jsonl, skipping the first step (warm-up).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import add_report_args, int_at_least, print_metrics, write_json  # noqa: E402 (the shared --json/--quick flags, table and JSON)

PHASES = ("rollout", "reward", "train", "sync")
# What the benchmark sets for every run (the run dir is its own temporary one).
HARNESS_KEYS = ("run_dir", "steps", "resume", "overwrite")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # At least 2: the first step is left out as warm-up, and the means need a step after it.
    parser.add_argument("--steps", type=int_at_least(2), default=None,
                        help="training steps to run, the first left out as warm-up (default 20, --quick 6)")
    add_report_args(parser, quick="6 steps (under a minute)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")
    args = parser.parse_args()
    steps = args.steps if args.steps is not None else 6 if args.quick else 20
    owned = [o for o in args.overrides if o.split("=", 1)[0].strip() in HARNESS_KEYS]
    if owned:
        parser.error(f"{', '.join(owned)}: the benchmark sets {', '.join(HARNESS_KEYS)} itself (give --steps for "
                     "the step count)")

    from flywheel.config.parsing import ConfigError
    from flywheel.runs.rundir import read_metrics
    from trainers.grpo import main as grpo_main

    harness = [f"steps={steps}", "tracker=none", f"eval.every={10**9}", f"sample_every={10**9}",
               f"save_every={10**9}"]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        try:  # the recipe refuses a bad override before any work: its one line, not a traceback
            grpo_main([f"run_dir={tmp}/run", *harness, *args.overrides])
        except ConfigError as e:
            parser.error(f"the overrides: {e}")
        wall = time.perf_counter() - start
        rows = [r for r in read_metrics(Path(tmp) / "run" / "metrics.jsonl") if r["step"] >= 2]
        config = (Path(tmp) / "run" / "config.yaml").read_text()

    import yaml

    cfg = yaml.safe_load(config)
    samples = cfg["data"]["prompts_per_step"] * cfg["data"]["group_size"]
    result = {f"{p}_s": statistics.mean(r.get(f"time/{p}_s" if p != "sync" else "sync/total_s", 0.0) for r in rows)
              for p in PHASES}
    result["step_s"] = sum(result[f"{p}_s"] for p in PHASES)
    result["samples_per_s"] = samples / result["step_s"]
    result["samples_per_step"] = samples
    result["steps_timed"] = len(rows)
    result["wall_s"] = wall
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["peak_rss_goal_mb"] = 2048

    print_metrics(result, key_width=20)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
