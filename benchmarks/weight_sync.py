"""Weight-sync transports side by side: shared memory to another process vs memcpy vs disk.

    python benchmarks/weight_sync.py --json out.json
    python benchmarks/weight_sync.py --quick

For each model (the toy transformer, and a random stack of Linear layers of
--large-mb megabytes), in one run:
- memcpy: copying the same bytes into a preallocated buffer in this process;
- shm: SharedMemorySender to a receiver process that copies every bucket out;
- disk: safetensors written atomically, then loaded (what a disk sync costs).
Ratios: transport_over_memcpy (shm bytes/s over memcpy bytes/s, goal >= 0.5),
speedup_vs_disk (disk seconds over shm seconds, goal >= 5). Then, on the toy
engine in another process: a full controller sync (freeze, drain, transfer,
resume) and pause_over_rollout_step: the pause/drain/resume overhead of a
sync over one denoising step of a rollout batch (goal <= 1).
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

from flywheel.transport import SharedMemorySender, save_weights_atomic  # noqa: E402

# The receiver copies every bucket into tensors it already holds, as an engine
# copies into its parameters, and answers once per bucket.
RECEIVER = r"""
import json, sys, torch
from flywheel.transport import receive_shared_memory_bucket
torch.set_num_threads(1)
params = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in json.loads(sys.stdin.readline())}
print("ready", flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    receive_shared_memory_bucket(msg["shm"], msg["slots"], into=params)
    print("ack", flush=True)
"""


def best_of(fn, repeats: int) -> float:
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
    flat = torch.empty(nbytes, dtype=torch.uint8)

    def memcpy():
        offset = 0
        for t in tensors.values():
            n = t.numel() * t.element_size()
            flat[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8))
            offset += n

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    proc.stdin.write(json.dumps([[n, str(t.dtype).removeprefix("torch."), list(t.shape)]
                                 for n, t in tensors.items()]) + "\n")
    proc.stdin.flush()
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("receiver process failed to start")
    sender = SharedMemorySender(bucket_bytes)

    def wait_ack():
        if proc.stdout.readline().strip() != "ack":
            raise RuntimeError("receiver process failed")

    def deliver(shm_name, slots):
        proc.stdin.write(json.dumps({"shm": shm_name, "slots": slots}) + "\n")
        proc.stdin.flush()
        return wait_ack  # pipelined: the next bucket is packed while this one is copied out

    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import load_file

        path = Path(tmp) / "w.safetensors"

        def disk():
            save_weights_atomic(tensors, path, version=1)
            load_file(str(path))

        try:
            memcpy_s = best_of(memcpy, repeats)
            shm_s = best_of(lambda: sender.send(tensors, deliver), repeats)
            disk_s = best_of(disk, repeats)
        finally:
            sender.close()
            proc.stdin.close()
            proc.wait(timeout=30)
    return {"mb": nbytes / 2**20, "memcpy_s": memcpy_s, "shm_s": shm_s, "disk_s": disk_s,
            "memcpy_gb_s": nbytes / memcpy_s / 1e9, "shm_gb_s": nbytes / shm_s / 1e9,
            "transport_over_memcpy": memcpy_s / shm_s, "speedup_vs_disk": disk_s / shm_s}


def measure_engine_sync(repeats: int, batch: int) -> dict[str, float]:
    """A whole sync into the toy engine in another process, and its pause overhead vs a rollout step."""
    from engine import GenerationRequest
    from flywheel.engine_process import EngineProcess
    from flywheel.sync import SharedMemoryTransport, WeightSyncController

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
        controller = WeightSyncController(handle, transport=SharedMemoryTransport(), verify=False)
        try:
            sync = min((controller.sync({k: v + 0.0 for k, v in tensors.items()}) for _ in range(repeats)),
                       key=lambda m: m["sync/total_s"])
        finally:
            controller.close()
    return {"rollout_step_s": step_s, "pause_s": pause_s, "pause_over_rollout_step": pause_s / step_s,
            "sync_total_s": sync["sync/total_s"], "sync_transfer_s": sync["sync/transfer_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large-mb", type=int, default=128, help="size of the large random transformer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32, help="rollout batch of the pause comparison")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (under a minute)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    torch.set_num_threads(1)

    result: dict[str, float] = {}
    for name, tensors in (("toy", toy_tensors()), ("large", large_tensors(args.large_mb))):
        for k, v in measure_transports(tensors, repeats, args.bucket_mb * 2**20).items():
            result[f"{name}_{k}"] = v
    result.update({f"toy_{k}": v for k, v in measure_engine_sync(repeats, args.batch).items()})

    print(f"{'model':<8}{'MB':>8}{'memcpy GB/s':>13}{'shm GB/s':>10}{'disk s':>9}{'shm/memcpy':>12}{'vs disk':>9}")
    for name in ("toy", "large"):
        r = {k.removeprefix(name + "_"): v for k, v in result.items() if k.startswith(name + "_")}
        print(f"{name:<8}{r['mb']:>8.1f}{r['memcpy_gb_s']:>13.2f}{r['shm_gb_s']:>10.2f}{r['disk_s']:>9.3f}"
              f"{r['transport_over_memcpy']:>12.2f}{r['speedup_vs_disk']:>9.1f}")
    print(f"toy engine: sync {result['toy_sync_total_s'] * 1e3:.1f} ms, pause cycle {result['toy_pause_s'] * 1e3:.2f} ms, "
          f"rollout step {result['toy_rollout_step_s'] * 1e3:.2f} ms -> pause_over_rollout_step "
          f"{result['toy_pause_over_rollout_step']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
