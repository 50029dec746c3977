"""Asynchronous vs synchronous flywheel on the toy task: steps/s and the rewards both reach.

    python benchmarks/async_flywheel.py --json out.json      # 40 steps each
    python benchmarks/async_flywheel.py --quick              # 10 steps each

Runs the GRPO recipe twice, side by side in one process run, with the same
config: once synchronous (colocated engine: roll out, then train) and once
with `rollout.asynchronous=true` (the engine in its own process generates step s+1
while the trainer trains on step s, `rollout.max_staleness` 1). Reports
`async_speedup` (steps/s of async over sync; goal >= 1.3 on 2 cores) and the
final train and eval rewards of both.

It also bounds what any overlap could reach on this machine. A third short
synchronous run with one torch thread gives each phase's single-core time; the
async step can be no shorter than the trainer's 2-thread train time, than the
2-thread rollout, or than the two phases' CPU time spread over the cores:
`async_speedup_ceiling` = sync step / that bound.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import Column, add_report_args, print_table, write_json  # noqa: E402 (the shared --json/--quick flags, table and JSON)


def run(mode_overrides: list[str], steps: int, overrides: list[str]) -> dict:
    from flywheel.runs.rundir import read_metrics
    from trainers.grpo import main as grpo_main

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        result = grpo_main([f"run_dir={tmp}/run", f"steps={steps}", "tracker=none", f"eval.every={steps}",
                            f"sample_every={10**9}", f"save_every={10**9}", *mode_overrides, *overrides])
        wall = time.perf_counter() - start
        rows = [r for r in read_metrics(Path(tmp) / "run" / "metrics.jsonl") if r["step"] >= 1]
    # Steps/s over the loop only: from the first step's end to the last's, so start-up
    # (model load, engine process spawn, base eval) does not count.
    timed = rows[1:]
    loop_s = sum(r.get("time/step_s", 0.0) for r in timed)

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in timed) / max(len(timed), 1)

    return {"steps_per_s": len(timed) / loop_s if loop_s else float("nan"), "wall_s": wall,
            "rollout_s": mean("time/rollout_s"), "train_s": mean("time/train_s"), "step_s": mean("time/step_s"),
            "final_train_reward": sum(r["reward/mean"] for r in rows[-3:]) / len(rows[-3:]),
            "final_eval_reward": result["final"].get("eval/reward/mean", float("nan"))}


def overlap_ceiling(sync: dict, single: dict, cores: int) -> float:
    """Sync step time over the shortest step any rollout/train overlap could reach on `cores` cores."""
    rollout_core_s = min(single["rollout_s"], cores * sync["rollout_s"])
    train_core_s = min(single["train_s"], cores * sync["train_s"])
    bound = max(sync["train_s"], sync["rollout_s"], (rollout_core_s + train_core_s) / cores)
    return sync["step_s"] / bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    add_report_args(parser, quick="10 steps each (under a minute)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to both runs")
    args = parser.parse_args()
    steps = 10 if args.quick else args.steps

    sync = run([], steps, args.overrides)
    asynchronous = run(["rollout.asynchronous=true"], steps, args.overrides)
    cores = os.cpu_count() or 1
    with mock.patch("os.cpu_count", return_value=1):  # the recipe then runs torch on one thread
        single = run([], max(4, steps // 4), args.overrides)
    result = {f"sync_{k}": v for k, v in sync.items()}
    result.update({f"async_{k}": v for k, v in asynchronous.items()})
    result.update({f"one_thread_{k}": v for k, v in single.items() if k in ("rollout_s", "train_s", "step_s")})
    result["async_speedup"] = asynchronous["steps_per_s"] / sync["steps_per_s"]
    result["async_speedup_ceiling"] = overlap_ceiling(sync, single, cores)
    result["cores"] = cores
    result["steps"] = steps

    print_table([Column("mode", 16, align="<"), Column("steps/s", 9, ".3f"), Column("rollout s", 11, ".3f"),
                 Column("train s", 9, ".3f"), Column("wall s", 8, ".1f"), Column("train reward", 14, ".3f"),
                 Column("eval reward", 13, ".3f")],
                [(mode, r["steps_per_s"], r["rollout_s"], r["train_s"], r["wall_s"], r["final_train_reward"],
                  r["final_eval_reward"]) for mode, r in (("sync", sync), ("async", asynchronous),
                                                          ("sync, 1 thread", single))])
    print(f"async_speedup {result['async_speedup']:.2f}x (goal >= 1.3); the most any overlap could give on "
          f"{cores} cores: {result['async_speedup_ceiling']:.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
