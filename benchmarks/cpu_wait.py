"""How OpenMP's wait policy and the thread count change a toy rollout on cores other jobs share.

    python benchmarks/cpu_wait.py                 # 2 rounds, each variant in a fresh process
    python benchmarks/cpu_wait.py --hog           # with a 2-thread matmul job beside it (bounded, ends with it)
    python benchmarks/cpu_wait.py --quick --json out.json   # one round

The JSON is flat: `hog`, `rounds`, and for each variant (its name as a key: "2 threads, passive" ->
`2_threads_passive`) `<variant>_wall_s` and `<variant>_cpu_s` (medians over the rounds) and
`<variant>_wall_s_rounds` / `<variant>_cpu_s_rounds` (every round's).

Each variant is a fresh interpreter (OpenMP reads its wait variables once, as torch loads) that rolls out
6 x 16 toy-digits images of 10 steps and prints its wall and CPU seconds. Variants interleave round by
round, so a machine whose load drifts slows them alike. GOMP_SPINCOUNT=300000 is GNU OpenMP's own default
(what a process gets when nothing is set and flywheel.openmp_env is not imported).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import Column, add_report_args, print_table, write_json  # noqa: E402 (shared flags, table, JSON)

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
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every variant (default 2; --quick: 1)")
    parser.add_argument("--hog", action="store_true", help="run a 2-thread matmul job beside each variant")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one variant may take")
    add_report_args(parser, quick="one round of every variant")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, (threads, wait) in VARIANTS.items():
            hog = subprocess.Popen([sys.executable, "-c", HOG, str(args.timeout)]) if args.hog else None
            try:
                results[name].append(run_variant(threads, wait, args.timeout))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    flat = flat_results(results, args.hog)
    print_table([Column("variant", 33, align="<"), Column("wall s (median)", 16, ".2f"),
                 Column("cpu s (median)", 16, ".2f")],
                [(name, flat[f"{variant_key(name)}_wall_s"], flat[f"{variant_key(name)}_cpu_s"]) for name in results])
    write_json(args.json, flat)


def variant_key(name: str) -> str:
    """A variant's name as a JSON key prefix: "2 threads, spin (GNU default)" -> "2_threads_spin_gnu_default"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def flat_results(results: dict[str, list[dict]], hog: bool) -> dict:
    """The flat JSON object: per variant the medians over the rounds and every round's seconds."""
    out: dict = {"hog": hog, "rounds": min(len(rows) for rows in results.values())}
    for name, rows in results.items():
        key = variant_key(name)
        for measure in ("wall_s", "cpu_s"):
            values = [r[measure] for r in rows]
            out[f"{key}_{measure}"] = statistics.median(values)
            out[f"{key}_{measure}_rounds"] = values
    return out


if __name__ == "__main__":
    main()
