"""Engine throughput on the toy card: sampler cost, dynamic batching, latency, side by side in one run.

    python benchmarks/engine_throughput.py --json out.json
    python benchmarks/engine_throughput.py --quick          # under a minute

sde_over_ode_time        Flow-SDE rollout time / ODE rollout time, same batch (goal <= 1.05)
cps_over_ode_time        the same for CPS
dynamic_batching_speedup wall time of C concurrent requests on a run-to-completion pool of C slots
                         (each request runs alone, max_batch=1) / on the AsyncEngine with dynamic
                         batching (max_batch=C, same pool size) (goal >= 3)
latency_p50/p99_ms       per-request latency (submit -> result) under that load, both modes

Timings interleave the variants round by round and take medians, so a noisy
machine slows both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import add_report_args, int_at_least, print_metrics, write_json  # noqa: E402 (the shared --json/--quick flags, table and JSON)


def _requests(n: int, steps: int, sampler: str, offset: int = 0):
    from engine import GenerationRequest

    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    return [GenerationRequest(prompt=f"a handwritten {words[i % 10]}", seed=offset + i, steps=steps,
                              sampler=sampler, noise_level={"sde": 0.7, "cps": 0.5}.get(sampler),
                              keep_trajectory=True) for i in range(n)]


def time_samplers(engine, batch: int, steps: int, rounds: int) -> dict[str, float]:
    """Median seconds of one batched rollout per sampler, rounds interleaved."""
    times = {s: [] for s in ("ode", "sde", "cps")}
    for s in times:  # warm-up (and prompt cache fill)
        engine.generate(_requests(batch, steps, s))
    for _ in range(rounds):
        for s in times:
            start = time.perf_counter()
            engine.generate(_requests(batch, steps, s))
            times[s].append(time.perf_counter() - start)
    return {s: statistics.median(v) for s, v in times.items()}


async def _burst(async_engine, concurrency: int, steps: int, offset: int) -> tuple[float, list[float]]:
    """Submit `concurrency` requests at once; (wall seconds, per-request latencies)."""
    latencies = []

    async def one(request):
        start = time.perf_counter()
        await async_engine.submit(request)
        latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in _requests(concurrency, steps, "sde", offset)))
    return time.perf_counter() - start, latencies


def time_pools(model, concurrency: int, steps: int, rounds: int) -> dict[str, dict]:
    """Dynamic batching vs run-to-completion, the same pool size, bursts interleaved."""
    from engine import AsyncEngine, Engine

    async def run() -> dict[str, dict]:
        pools = {
            "dynamic": AsyncEngine(Engine(model), max_batch=concurrency, max_wait_ms=5.0,
                                   max_concurrency=concurrency),
            "run_to_completion": AsyncEngine(Engine(model), max_batch=1, max_wait_ms=0.0,
                                             max_concurrency=concurrency),
        }
        walls = {k: [] for k in pools}
        latencies = {k: [] for k in pools}
        for name, pool in pools.items():  # warm-up
            await _burst(pool, concurrency, steps, 0)
        for r in range(rounds):
            for name, pool in pools.items():
                wall, lat = await _burst(pool, concurrency, steps, 1000 * (r + 1))
                walls[name].append(wall)
                latencies[name].extend(lat)
        stats = {name: pool.stats() for name, pool in pools.items()}
        for pool in pools.values():
            await pool.aclose()
        return {name: {"wall": statistics.median(walls[name]), "latencies": sorted(latencies[name]),
                       "mean_batch": stats[name]["pool/mean_batch"]} for name in pools}

    return asyncio.run(run())


def _percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_report_args(parser, quick="fewer rounds (under a minute)")
    parser.add_argument("--concurrency", type=int_at_least(1), default=32, help="concurrent requests and pool size")
    parser.add_argument("--batch", type=int_at_least(1), default=32, help="batch of the sampler timing")
    parser.add_argument("--steps", type=int_at_least(2), default=10, help="denoising steps")
    parser.add_argument("--threads", type=int_at_least(1), default=1,
                        help="torch intra-op threads (1: pool workers run single-threaded anyway, and OpenMP "
                             "teams on a shared, loaded CPU slow the main thread by up to 10x)")
    args = parser.parse_args()
    sampler_rounds, pool_rounds = (5, 3) if args.quick else (20, 10)

    import torch

    from engine import Engine, load_model

    torch.set_num_threads(args.threads)
    model = load_model("toy-digits")
    samplers = time_samplers(Engine(model), args.batch, args.steps, sampler_rounds)
    pools = time_pools(model, args.concurrency, args.steps, pool_rounds)
    dyn, rtc = pools["dynamic"], pools["run_to_completion"]
    result = {
        "card": "toy-digits",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "steps": args.steps,
        "batch": args.batch,
        "concurrency": args.concurrency,
        "ode_rollout_s": samplers["ode"],
        "sde_rollout_s": samplers["sde"],
        "cps_rollout_s": samplers["cps"],
        "sde_over_ode_time": samplers["sde"] / samplers["ode"],
        "cps_over_ode_time": samplers["cps"] / samplers["ode"],
        "dynamic_wall_s": dyn["wall"],
        "run_to_completion_wall_s": rtc["wall"],
        "dynamic_batching_speedup": rtc["wall"] / dyn["wall"],
        "dynamic_mean_batch": dyn["mean_batch"],
        "latency_p50_ms": 1000 * _percentile(dyn["latencies"], 0.5),
        "latency_p99_ms": 1000 * _percentile(dyn["latencies"], 0.99),
        "run_to_completion_latency_p50_ms": 1000 * _percentile(rtc["latencies"], 0.5),
        "run_to_completion_latency_p99_ms": 1000 * _percentile(rtc["latencies"], 0.99),
    }
    print_metrics(result, key_width=36)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
