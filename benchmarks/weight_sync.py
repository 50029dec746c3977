"""Weight-sync transports side by side: shared memory to another process vs memcpy vs disk.

    python benchmarks/weight_sync.py --json out.json
    python benchmarks/weight_sync.py --quick

For each model (the toy transformer, and a random stack of Linear layers of
--large-mb megabytes), in one run, into a receiver process that holds the
tensors as an engine process does:
- memcpy: one copy of a contiguous buffer of the same bytes in this process;
- shm (mapped, the default transport for an engine in host memory): the
  receiver's tensors live in a shared-memory block and the sender writes
  straight into them: laid out like the block (as the recipe lays out the
  trainer's Parameters) in one copy, or tensor by tensor ("per-tensor"); the
  commit message (the version bump) is timed apart;
- shm buckets (for an engine on an accelerator): staged in two shared blocks,
  the receiver copies each out while the sender packs the next;
- disk: safetensors written atomically, then loaded.
Ratios: transport_over_memcpy (mapped shm bytes/s over memcpy bytes/s, goal
>= 0.5), speedup_vs_disk (disk seconds over shm seconds, goal >= 5), and the
same with the commit round trip and for buckets. Then, on the toy engine in
another process: a full controller sync (freeze, drain, transfer, commit,
resume) and pause_over_rollout_step: the pause/drain/resume overhead of a sync
over one denoising step of a rollout batch (goal <= 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import Column, add_report_args, print_table, write_json  # noqa: E402 (the shared --json/--quick flags, table and JSON)
from flywheel.sync.transport import SharedMemorySender, SharedWeightsWriter, save_weights_atomic  # noqa: E402

# The receiver holds the tensors the way the engine process does: mapped into a
# shared block for the sender to write into; buckets are copied into them.
RECEIVER = r"""
import json, sys, torch
from flywheel.sync.transport import SharedWeights, receive_shared_memory_bucket
torch.set_num_threads(1)
params = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, d, s in json.loads(sys.stdin.readline())}
block = SharedWeights(params)
print(json.dumps({"shm": block.name, "manifest": block.manifest()}), flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    if msg["op"] == "bucket":
        receive_shared_memory_bucket(msg["shm"], msg["slots"], into=params)
    else:
        block.commit()
    print("ack", flush=True)
block.close()
"""


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults of a fresh mapping do not count
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def toy_tensors() -> dict[str, torch.Tensor]:
    from engine import load_model

    return {k: v.clone() for k, v in load_model("toy-digits").transformer.state_dict().items()}


def large_tensors(megabytes: int) -> dict[str, torch.Tensor]:
    width = 2048
    layers = max(1, round(megabytes * 2**20 / (width * width * 4)))
    g = torch.Generator().manual_seed(0)
    return {f"blocks.{i}.weight": torch.randn(width, width, generator=g) for i in range(layers)}


def measure_transports(tensors: dict[str, torch.Tensor], repeats: int, bucket_bytes: int) -> dict[str, float]:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if nbytes < 16 * 2**20:
        repeats *= 10  # sub-millisecond copies: more samples for a stable minimum
    # The baseline: one memcpy of a contiguous buffer of the same size (no per-tensor work at all).
    flat_source = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
    flat = torch.empty(nbytes, dtype=torch.uint8)

    def memcpy():
        flat.copy_(flat_source)

    separate = {k: v.clone() for k, v in tensors.items()}  # tensors in their own allocations

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    proc.stdin.write(json.dumps([[n, str(t.dtype).removeprefix("torch."), list(t.shape)]
                                 for n, t in tensors.items()]) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("receiver process failed to start")
    mapped = json.loads(line)
    writer = SharedWeightsWriter(mapped["shm"], mapped["manifest"])
    sender = SharedMemorySender(bucket_bytes)

    def request(msg: dict):
        proc.stdin.write(json.dumps(msg) + "\n")
        proc.stdin.flush()

        def wait_ack():
            if proc.stdout.readline().strip() != "ack":
                raise RuntimeError("receiver process failed")
        return wait_ack

    def deliver(shm_name, slots):
        return request({"op": "bucket", "shm": shm_name, "slots": slots})  # pipelined: returns the wait

    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import load_file

        path = Path(tmp) / "w.safetensors"

        def disk():
            save_weights_atomic(tensors, path, version=1)
            load_file(str(path))

        try:
            memcpy_s = best_of(memcpy, repeats)
            per_tensor_s = best_of(lambda: writer.write(separate), repeats)
            if not writer.share_layout(tensors):  # as the recipe does with the trainer's Parameters
                raise RuntimeError("could not lay the sender's tensors out like the receiver's block")
            shm_s = best_of(lambda: writer.write(tensors), repeats)
            commit_s = best_of(lambda: request({"op": "commit"})(), repeats)
            buckets_s = best_of(lambda: sender.send(tensors, deliver), repeats)
            disk_s = best_of(disk, repeats)
        finally:
            writer.close()
            sender.close()
            proc.stdin.close()
            proc.wait(timeout=30)
    return {"mb": nbytes / 2**20, "memcpy_s": memcpy_s, "shm_s": shm_s, "commit_s": commit_s,
            "buckets_s": buckets_s, "disk_s": disk_s,
            "memcpy_gb_s": nbytes / memcpy_s / 1e9, "shm_gb_s": nbytes / shm_s / 1e9,
            "transport_over_memcpy": memcpy_s / shm_s, "speedup_vs_disk": disk_s / shm_s,
            "per_tensor_s": per_tensor_s, "per_tensor_over_memcpy": memcpy_s / per_tensor_s,
            "with_commit_over_memcpy": memcpy_s / (shm_s + commit_s),
            "with_commit_speedup_vs_disk": disk_s / (shm_s + commit_s),
            "buckets_over_memcpy": memcpy_s / buckets_s, "buckets_speedup_vs_disk": disk_s / buckets_s}


def measure_engine_sync(repeats: int, batch: int) -> dict[str, float]:
    """A whole sync into the toy engine in another process, and its pause overhead vs a rollout step."""
    from engine import GenerationRequest
    from flywheel.sync.engine_process import EngineProcess
    from flywheel.sync.controller import SharedMemoryTransport, WeightSyncController

    tensors = toy_tensors()
    with EngineProcess.start("toy-digits", threads=1) as handle:
        requests = [GenerationRequest(prompt="a handwritten 7", seed=i, steps=10) for i in range(batch)]
        handle.generate(requests)  # warm-up
        rollout_s = statistics.median(best_of(lambda: handle.generate(requests), 1) for _ in range(repeats))
        step_s = rollout_s / 10

        def pause_cycle():
            handle.pause()
            handle.drain(timeout_s=60)
            handle.resume()

        pause_s = best_of(pause_cycle, repeats)
        transport = SharedMemoryTransport()
        controller = WeightSyncController(handle, transport=transport, verify=False)
        try:
            controller.sync(tensors)  # maps the engine's weights
            transport.share_layout(handle, tensors)  # as the recipe does with the trainer's Parameters
            sync = min((controller.sync(tensors) for _ in range(repeats)), key=lambda m: m["sync/total_s"])
        finally:
            controller.close()
    return {"rollout_step_s": step_s, "pause_s": pause_s, "pause_over_rollout_step": pause_s / step_s,
            "sync_total_s": sync["sync/total_s"], "sync_transfer_s": sync["sync/transfer_s"],
            "sync_commit_s": sync["sync/commit_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large-mb", type=int, default=128, help="size of the large random transformer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32, help="rollout batch of the pause comparison")
    add_report_args(parser, quick="fewer repeats (under a minute)")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    torch.set_num_threads(1)

    result: dict[str, float] = {}
    for name, tensors in (("toy", toy_tensors()), ("large", large_tensors(args.large_mb))):
        for k, v in measure_transports(tensors, repeats, args.bucket_mb * 2**20).items():
            result[f"{name}_{k}"] = v
    result.update({f"toy_{k}": v for k, v in measure_engine_sync(repeats, args.batch).items()})

    columns = [Column("model", 7, align="<"), Column("MB", 7, ".1f"), Column("memcpy GB/s", 12, ".2f"),
               Column("shm GB/s", 9, ".2f"), Column("shm/memcpy", 11, ".2f"), Column("+commit", 8, ".2f"),
               Column("per-tensor", 11, ".2f"), Column("buckets", 8, ".2f"), Column("disk s", 8, ".4f"),
               Column("vs disk", 8, ".1f"), Column("+commit", 8, ".1f"), Column("buckets", 8, ".1f")]
    keys = ("mb", "memcpy_gb_s", "shm_gb_s", "transport_over_memcpy", "with_commit_over_memcpy",
            "per_tensor_over_memcpy", "buckets_over_memcpy", "disk_s", "speedup_vs_disk",
            "with_commit_speedup_vs_disk", "buckets_speedup_vs_disk")
    print_table(columns, [(name, *(result[f"{name}_{k}"] for k in keys)) for name in ("toy", "large")])
    print("(memcpy: one copy of a contiguous buffer of the same bytes; shm: the sender laid out like the engine's "
          "mapped block, one copy; +commit: with the version-bump round trip; per-tensor: a sender whose tensors "
          "live apart; buckets: the staged path for accelerator engines)")
    print(f"toy engine: sync {result['toy_sync_total_s'] * 1e3:.1f} ms (transfer "
          f"{result['toy_sync_transfer_s'] * 1e3:.2f} ms, commit {result['toy_sync_commit_s'] * 1e3:.2f} ms), pause cycle {result['toy_pause_s'] * 1e3:.2f} ms, "
          f"rollout step {result['toy_rollout_step_s'] * 1e3:.2f} ms -> pause_over_rollout_step "
          f"{result['toy_pause_over_rollout_step']:.3f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
