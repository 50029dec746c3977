"""The Ray rollout pool against the local engine: throughput, per-request overhead, and weight sync.

    python benchmarks/ray_pool.py --json out.json
    python benchmarks/ray_pool.py --quick

On a local Ray (`--num-cpus` CPUs), with the toy-digits card:
- images/s of one rollout batch (--batch requests, --steps SDE steps) on the
  local engine in this process, and on a pool of 1 and of 2 replicas (one CPU
  thread each);
- pool_overhead_ms: (pool of 1 replica seconds - local seconds) / requests:
  what the pool adds per request (dispatch, the trajectories through the
  object store) to the same computation (goal <= 5 ms);
  call_overhead_ms: the same for one call of a single 1-step request;
- sync seconds (the controller's whole freeze, drain, put, copy on every
  replica, commit, resume) to 1 and 2 replicas, for the toy transformer and
  for the toy transformer carrying --large-mb megabytes of extra random
  weights (a model of that size as far as the sync is concerned).
On a 2-core machine the 2-replica throughput is bounded by the cores (the
trainer process, Ray's own processes and the replicas share them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ray
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import Column, add_report_args, print_table, write_json  # noqa: E402 (the shared --json/--quick flags, table and JSON)
from benchmarks.weight_sync import best_of  # noqa: E402 (min of repeats after a warm-up)
from engine import Engine, GenerationRequest, load_model  # noqa: E402
from flywheel.scale.ray_pool import RayEnginePool  # noqa: E402
from flywheel.scale.ray_sync import RayObjectStoreTransport  # noqa: E402
from flywheel.sync.controller import WeightSyncController  # noqa: E402


def toy_with_ballast(megabytes: int = 0):
    """The toy-digits model; with megabytes > 0 its transformer also holds that many MB of unused weights."""
    model = load_model("toy-digits")
    if megabytes:
        width = 4096
        rows = megabytes * 2**20 // (4 * width)
        model.transformer.ballast = nn.Parameter(torch.zeros(rows, width), requires_grad=False)
    return model


def rollout_requests(n: int, steps: int) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=f"the digit {i % 10}", seed=i, steps=steps, sampler="sde", noise_level=0.7)
            for i in range(n)]


def measure_rollouts(batch: int, steps: int, repeats: int) -> dict[str, float]:
    requests, single = rollout_requests(batch, steps), rollout_requests(1, 1)
    local = Engine(load_model("toy-digits"))
    out = {"local_s": best_of(lambda: local.generate(requests), repeats),
           "local_single_s": best_of(lambda: local.generate(single), repeats * 5)}
    for replicas in (1, 2):
        with RayEnginePool("toy-digits", replicas=replicas, cpus_per_replica=0.5) as pool:
            out[f"pool{replicas}_s"] = best_of(lambda: pool.generate(requests), repeats)
            if replicas == 1:
                out["pool1_single_s"] = best_of(lambda: pool.generate(single), repeats * 5)
    result = {f"{k.removesuffix('_s')}_images_s": batch / out[k] for k in ("local_s", "pool1_s", "pool2_s")}
    result["pool_overhead_ms"] = (out["pool1_s"] - out["local_s"]) / batch * 1e3
    result["call_overhead_ms"] = (out["pool1_single_s"] - out["local_single_s"]) * 1e3
    result["speedup_2_replicas"] = out["pool1_s"] / out["pool2_s"]
    return result


def measure_sync(megabytes: int, repeats: int) -> dict[str, float]:
    reference = toy_with_ballast(megabytes).transformer.state_dict()
    weights = {n: torch.randn(t.shape) for n, t in reference.items() if t.is_floating_point()}
    nbytes = sum(t.numel() * 4 for t in weights.values())
    out = {"mb": nbytes / 2**20}
    for replicas in (1, 2):
        with RayEnginePool("toy-digits", replicas=replicas, cpus_per_replica=0.5,
                           model_factory=lambda: toy_with_ballast(megabytes)) as pool:
            controller = WeightSyncController(pool, transport=RayObjectStoreTransport())
            out[f"sync_{replicas}_replicas_s"] = best_of(lambda: controller.sync(weights), repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="requests of the rollout batch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--large-mb", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-cpus", type=int, default=2)
    add_report_args(parser, quick="fewer repeats, a smaller batch (about a minute)")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    batch = 32 if args.quick else args.batch
    torch.set_num_threads(1)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        result = measure_rollouts(batch, args.steps, repeats)
        for name, megabytes in (("toy", 0), ("large", args.large_mb)):
            result.update({f"{name}_{k}": v for k, v in measure_sync(megabytes, repeats).items()})
    finally:
        ray.shutdown()

    print(f"rollout batch of {batch} x {args.steps} steps (images/s): local {result['local_images_s']:.1f}, "
          f"pool of 1 {result['pool1_images_s']:.1f}, pool of 2 {result['pool2_images_s']:.1f} "
          f"(x{result['speedup_2_replicas']:.2f})")
    print(f"pool_overhead_ms {result['pool_overhead_ms']:.2f} per request (goal <= 5); one single-request call "
          f"{result['call_overhead_ms']:.2f} ms over the local engine")
    print_table([Column("model", 7, align="<"), Column("MB", 8, ".1f"), Column("sync 1 replica s", 18, ".4f"),
                 Column("sync 2 replicas s", 19, ".4f")],
                [(name, result[f"{name}_mb"], result[f"{name}_sync_1_replicas_s"], result[f"{name}_sync_2_replicas_s"])
                 for name in ("toy", "large")])
    write_json(args.json, result)


if __name__ == "__main__":
    main()
