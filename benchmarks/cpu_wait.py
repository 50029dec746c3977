"""How OpenMP's wait policy and the thread count change a toy rollout on cores other jobs share.

    python benchmarks/cpu_wait.py                 # 2 rounds, each variant in a fresh process
    python benchmarks/cpu_wait.py --hog           # with a 2-thread matmul job beside it (bounded, ends with it)

Each variant is a fresh interpreter (OpenMP reads its wait variables once, as torch loads) that rolls out
6 x 16 toy-digits images of 10 steps and prints its wall and CPU seconds. Variants interleave round by
round, so a machine whose load drifts slows them alike. GOMP_SPINCOUNT=300000 is GNU OpenMP's own default
(what a process gets when nothing is set and flywheel.openmp_env is not imported).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> (torch threads, wait variables)
    "2 threads, spin (GNU default)": (2, {"GOMP_SPINCOUNT": "300000"}),
    "2 threads, spin 1000": (2, {"GOMP_SPINCOUNT": "1000"}),
    "2 threads, passive": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "1 thread": (1, {}),
}
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "KMP_LIBRARY")
WORKLOAD = r"""
import json, sys, time
import torch
from engine import Engine, GenerationRequest, load_model
torch.set_num_threads(int(sys.argv[1]))
engine = Engine(load_model("toy-digits"))
requests = [GenerationRequest(prompt=f"the digit {i % 10}", seed=i, steps=10) for i in range(16)]
engine.generate(requests)
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(6):
    engine.generate(requests)
print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}))
"""
HOG = r"""
import sys, time, torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    a @ a
"""


def run_variant(threads: int, wait: dict, timeout_s: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_KEYS and k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", WORKLOAD, str(threads)], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout_s, env={**env, "PYTHONPATH": str(ROOT), **wait})
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hog", action="store_true", help="run a 2-thread matmul job beside each variant")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one variant may take")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (threads, wait) in VARIANTS.items():
            hog = subprocess.Popen([sys.executable, "-c", HOG, str(args.timeout)]) if args.hog else None
            try:
                results[name].append(run_variant(threads, wait, args.timeout))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    print(f"{'variant':32s} {'wall s (median)':>16s} {'cpu s (median)':>15s}")
    for name, rows in results.items():
        print(f"{name:32s} {statistics.median(r['wall_s'] for r in rows):16.2f} "
              f"{statistics.median(r['cpu_s'] for r in rows):15.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"hog": args.hog, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
