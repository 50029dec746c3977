"""Asynchronous vs synchronous flywheel on the toy task: steps/s and the rewards both reach.

    python benchmarks/async_flywheel.py --json out.json      # 3 rounds of 40 steps each (about 7 minutes)
    python benchmarks/async_flywheel.py --quick              # 10 steps each
    python benchmarks/async_flywheel.py --phases             # CPU seconds of a step's phases, one thread (30 s)

Runs the GRPO recipe twice, side by side in one process run, with the same
config: once synchronous (colocated engine: roll out, then train) and once
with `rollout.asynchronous=true` (the engine in its own process generates step s+1
while the trainer trains on step s, `rollout.max_staleness` 1). Reports
`async_speedup` (steps/s of async over sync), its ratio to the layout's ceiling
(`async_of_ceiling`; goal >= 0.9 on an idle 2-core machine) and the final train
and eval rewards of both.

Every run sets `threads=` itself (so an exported OMP_NUM_THREADS does not change what is measured): sync
and async run on every core; the async recipe gives its engine process one thread and trains on the others
while a rollout runs, on all of them once it is done (`cpu_core_sharing` in flywheel/recipe/rollouts.py).
OpenMP's wait policy is the recipes' (passive, unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set: export one
to measure another). `--rounds` (default 3) repeats sync, async and the one-thread run, each round in the
reverse order of the last, and reports medians with each ratio's min and max over the rounds.

It also bounds what the overlap could reach on this machine, from a short synchronous run on one thread
(the engine process's count) and one on cores - 1 (the trainer's while a rollout runs; the same run on 2
cores). With r1 the one-thread rollout, t_c-1 and t_c the train times on cores - 1 and on every core:
- `async_speedup_ceiling`, the layout's: the engine rolls out for r1 while the trainer gets through
  r1 / t_c-1 of its update, which it ends on every core; its step is r1 + (1 - r1 / t_c-1)·t_c (r1 if the
  trainer ends first), and the ceiling is the synchronous step over it. Weight sync, transfers, reward
  scoring and threads waiting for each other count as zero, so no real run reaches it.
- `async_speedup_any_overlap`, any schedule's: a step no shorter than the all-core train or rollout, nor
  than the two phases' one-thread CPU time spread over the cores. It stays above the layout's ceiling
  wherever training gains less than cores x from cores x the threads.
`--phases` measures instead what a default toy step's phases cost in CPU seconds of the thread that runs
them, at one torch thread, in this process: the rollout (a local engine), the async update (a batch one
version old), and the start-of-update pass of the proximal log-probs over every trained step that the async
update ran before 2026-12-02 (it now runs only for minibatches after an update's first optimizer step).
CPU time of one thread hardly moves with other work on the machine, unlike the steps/s above.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Before torch loads, as in the recipes: OpenMP's wait policy is read once, then, and before 2026-12-02 this
# script measured GNU OpenMP's spinning default, which no recipe run gets (flywheel/openmp_env.py).
import flywheel.openmp_env  # noqa: E402,F401
from benchmarks.report import Column, add_report_args, print_metrics, print_table, write_json  # noqa: E402 (the shared --json/--quick flags, table and JSON)


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


def overlap_bound(sync: dict, single: dict, cores: int) -> float:
    """Sync step time over the shortest step any rollout/train overlap could reach on `cores` cores."""
    rollout_core_s = min(single["rollout_s"], cores * sync["rollout_s"])
    train_core_s = min(single["train_s"], cores * sync["train_s"])
    bound = max(sync["train_s"], sync["rollout_s"], (rollout_core_s + train_core_s) / cores)
    return sync["step_s"] / bound


def layout_step_s(rollout_1: float, train_shared: float, train_all: float) -> float:
    """The shortest async step of the engine-process layout: the engine rolls out on one thread for
    `rollout_1` s while the trainer runs on the other cores (a whole update there takes `train_shared`),
    then the trainer ends its update on every core (a whole update there takes `train_all`)."""
    if rollout_1 >= train_shared:
        return rollout_1  # the trainer ends first and waits for the rollout
    return rollout_1 + (1.0 - rollout_1 / train_shared) * train_all


def layout_ceiling(sync: dict, one_thread: dict, shared: dict) -> float:
    """Sync step time over `layout_step_s` (one_thread: a run on one thread; shared: on cores - 1)."""
    return sync["step_s"] / layout_step_s(one_thread["rollout_s"], shared["train_s"], sync["train_s"])


def round_summary(per_round: list[dict]) -> dict:
    """The flat JSON of several rounds: each mode's figures and the ratios as medians over the rounds (a ratio is
    taken within its round, from runs made minutes apart at most), the ratios' min and max beside them."""
    out: dict = {}
    for mode, prefix in (("sync", "sync_"), ("async", "async_"), ("single", "one_thread_"), ("shared", "shared_")):
        if mode == "shared" and all(r["runs"]["shared"] is r["runs"]["single"] for r in per_round):
            continue
        keys = per_round[0]["runs"][mode].keys() if mode in ("sync", "async") else ("rollout_s", "train_s", "step_s")
        out.update({prefix + k: statistics.median(r["runs"][mode][k] for r in per_round) for k in keys})
    for key in ("async_speedup", "async_speedup_ceiling", "async_of_ceiling", "async_speedup_any_overlap"):
        values = [r[key] for r in per_round]
        out[key] = statistics.median(values)
        out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    return out


def phase_cpu_seconds(repeats: int = 3) -> dict:
    """CPU seconds of this thread (one torch thread) for the rollout, the async update and the proximal pass of a
    default toy GRPO step; the fastest of `repeats` for the update and the pass (each from the same weights)."""
    import copy

    import torch
    from accelerate import Accelerator

    from engine import Engine, GenerationRequest
    from flywheel.prompts import load_prompts
    from flywheel.recipe.policy import build_policy, make_optimizer
    from flywheel.recipe.sections import rollout_request_kwargs
    from flywheel.rollout_collector import RolloutBatch
    from trainers.grpo import GRPO, Config, chosen_steps, start_of_update_steps, trained_fraction, trained_mask

    torch.set_num_threads(1)
    cfg = Config()
    cfg.rollout.asynchronous = True
    policy = build_policy(cfg, torch.device("cpu"), reference=cfg.train.kl_beta > 0 or cfg.train.log_kl)
    optimizer = make_optimizer(policy, cfg.train)
    prompts = load_prompts(cfg.data.prompts)
    rows = cfg.data.prompts_per_step * cfg.data.group_size
    requests = [GenerationRequest(prompt=prompts[(i // cfg.data.group_size) % len(prompts)].prompt, seed=i,
                                  **rollout_request_kwargs(cfg.sampling)) for i in range(rows)]
    start = time.thread_time()
    traj = Engine(policy.model).generate(requests)
    rollout_s = time.thread_time() - start
    advantages = torch.randn(rows, generator=torch.Generator().manual_seed(0))
    usable = torch.ones(rows, dtype=torch.bool)
    weights, moments = copy.deepcopy(policy.model.transformer.state_dict()), copy.deepcopy(optimizer.state_dict())
    grpo = GRPO(policy, optimizer, policy.model.transformer, cfg, Accelerator(cpu=True))
    fraction, selection = trained_fraction(cfg.train)
    trained = trained_mask(traj, chosen_steps(traj, fraction, torch.Generator().manual_seed(0), selection))
    update_s, pass_s = [], []
    for _ in range(repeats):
        policy.model.transformer.load_state_dict(weights)
        optimizer.load_state_dict(moments)
        batch = RolloutBatch(traj, None, advantages, usable, torch.arange(rows) // cfg.data.group_size,
                             {"staleness": 1})
        start = time.thread_time()
        grpo.update(batch, step=0)
        update_s.append(time.thread_time() - start)
        start = time.thread_time()
        start_of_update_steps(policy.model, policy.model.transformer, traj, [list(range(rows))], trained,
                              cfg.train.cfg_in_train)
        pass_s.append(time.thread_time() - start)
    return {"cpu_rollout_s": rollout_s, "cpu_async_update_s": min(update_s), "cpu_proximal_pass_s": min(pass_s),
            "proximal_pass_of_old_update": min(pass_s) / (min(update_s) + min(pass_s)), "rows": rows,
            "trained_steps": int(trained.any(0).sum()), "load_average_1m": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of sync, async and one-thread runs, each round in the reverse order of the last; "
                             "the figures are medians over rounds (--quick: 1)")
    add_report_args(parser, quick="10 steps each (under a minute)")
    parser.add_argument("--phases", action="store_true",
                        help="CPU seconds of a default step's phases at one thread instead (load-insensitive)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to both runs")
    args = parser.parse_args()
    if args.phases:
        result = phase_cpu_seconds()
        print_metrics(result)
        write_json(args.json, result)
        return
    steps = 10 if args.quick else args.steps
    rounds = 1 if args.quick else args.rounds
    if rounds < 1 or steps < 2:  # steps/s is timed from the first step's end: it needs two steps
        parser.error(f"--rounds must be >= 1 and --steps >= 2, got --rounds {rounds} --steps {steps}")
    cores = os.cpu_count() or 1
    modes = {"sync": [f"threads={cores}"], "async": [f"threads={cores}", "rollout.asynchronous=true"],
             "single": ["threads=1"]}
    if cores > 2:
        modes["shared"] = [f"threads={cores - 1}"]
    per_round = []
    for i in range(rounds):
        # Every round runs each mode once, in the reverse order of the round before: the machine's speed
        # drifts by 10-30% over minutes here, and a fixed order would charge that drift to one mode.
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        runs = {name: run(modes[name], steps if name in ("sync", "async") else max(4, steps // 4), args.overrides)
                for name in order}
        runs.setdefault("shared", runs["single"])
        speedup = runs["async"]["steps_per_s"] / runs["sync"]["steps_per_s"]
        ceiling = layout_ceiling(runs["sync"], runs["single"], runs["shared"])
        per_round.append({"runs": runs, "async_speedup": speedup, "async_speedup_ceiling": ceiling,
                          "async_of_ceiling": speedup / ceiling,
                          "async_speedup_any_overlap": overlap_bound(runs["sync"], runs["single"], cores)})
    result = round_summary(per_round)
    result["cores"] = cores
    result["steps"] = steps
    result["rounds"] = rounds
    result["load_average_1m"] = os.getloadavg()[0]  # other work on the machine: the figures need it near 0
    sync, asynchronous, single = (per_round[0]["runs"][k] for k in ("sync", "async", "single"))  # the table: round 0

    print_table([Column("mode", 16, align="<"), Column("steps/s", 9, ".3f"), Column("rollout s", 11, ".3f"),
                 Column("train s", 9, ".3f"), Column("wall s", 8, ".1f"), Column("train reward", 14, ".3f"),
                 Column("eval reward", 13, ".3f")],
                [(mode, r["steps_per_s"], r["rollout_s"], r["train_s"], r["wall_s"], r["final_train_reward"],
                  r["final_eval_reward"]) for mode, r in (("sync", sync), ("async", asynchronous),
                                                          ("sync, 1 thread", single))])
    if rounds > 1:
        print_table([Column("round", 6), Column("async speedup", 14, ".3f"), Column("ceiling", 8, ".3f"),
                     Column("of ceiling", 11, ".3f")],
                    [(i, r["async_speedup"], r["async_speedup_ceiling"], r["async_of_ceiling"])
                     for i, r in enumerate(per_round)])
    print(f"async_speedup {result['async_speedup']:.2f}x = {result['async_of_ceiling']:.2f} of the layout's ceiling "
          f"{result['async_speedup_ceiling']:.2f}x (goal >= 0.9; medians of {rounds} round(s), of ceiling "
          f"{result['async_of_ceiling_min']:.2f}-{result['async_of_ceiling_max']:.2f}); any overlap on {cores} "
          f"cores: at most {result['async_speedup_any_overlap']:.2f}x; load average {result['load_average_1m']:.2f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
