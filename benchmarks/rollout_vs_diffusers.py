"""Rollout throughput and peak memory: the engine (Flow-SDE with log-probs) vs diffusers' StableDiffusion3Pipeline.

    python benchmarks/rollout_vs_diffusers.py [--quick] [--json out.json]
    python benchmarks/rollout_vs_diffusers.py --device cuda --dtype bfloat16 --large --json gpu.json

Both run the same random SD3 (default: 4 layers, width 128, 32x32 latents;
--large: 12 layers, width 1536, 64x64 latents), batch 8, 10 steps, CFG 4.5,
decode included, prompt embeddings precomputed for both (the engine's from its
cache, the pipeline's passed as prompt_embeds). The engine additionally records
the whole trajectory and per-step log-probs, which the pipeline does not.
Three sides: the engine eager, the engine with `compile=True` (not in
--quick), and the pipeline; `speedup_vs_diffusers` is the eager engine's,
`compiled_speedup_vs_diffusers` the compiled one's.

Each side runs in its own subprocess (same seed, same weights), so peak memory
is its own: on CPU the peak RSS during the timed calls (sampled every 0.5 ms
by a thread) over the RSS before them; on CUDA torch.cuda.max_memory_allocated
over the memory allocated before them. A warm-up call comes first on both
sides (it compiles the compiled engine) and counts for neither time nor
memory. Sides alternate and the best run of each counts, so load from other
processes hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(num_layers=4, heads=4, head_dim=32, sample_size=32)
LARGE = dict(num_layers=12, heads=24, head_dim=64, sample_size=64)
PROMPT = "a photo of a red fox in the snow"
SIDES = ("engine", "engine_compiled", "pipeline")


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The highest RSS of this process while the block runs, sampled on a thread."""

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self):
        self.peak = current_rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())


def child(args) -> dict:
    """One side's measurement, printed as JSON (runs in its own process)."""
    import torch

    from engine import Engine, GenerationRequest
    from engine.families.common import prepare_pipeline
    from engine.families.sd3 import SD3Model
    from engine.families.tiny import tiny_sd3_pipeline

    torch.set_num_threads(args.threads) if args.device == "cpu" else None
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sizes = LARGE if args.large else SMALL
    pipe = prepare_pipeline(tiny_sd3_pipeline(seed=0, **sizes), device, dtype)
    model = SD3Model(pipe, dtype, dict(pipe.scheduler.config))
    engine = Engine(model, device=device, compile=args.child == "engine_compiled")
    pixels = sizes["sample_size"] * pipe.vae_scale_factor
    batch, steps, guidance = args.batch, args.steps, 4.5
    cond = engine.encode_prompts([PROMPT] * batch)
    uncond = engine.encode_prompts([""] * batch)
    latent_shape = model.latent_shape(pixels, pixels, None)

    def run_engine(seed):
        requests = [GenerationRequest(prompt=PROMPT, seed=seed * 1000 + i, card="sd3", steps=steps, sampler="sde",
                                      noise_level=0.7, guidance_scale=guidance, height=pixels, width=pixels)
                    for i in range(batch)]
        return engine.generate(requests).images

    def run_pipeline(seed):
        g = torch.Generator(device).manual_seed(seed)
        latents = torch.randn((batch, *latent_shape), generator=g, device=device, dtype=dtype)
        with torch.no_grad():
            return pipe(prompt_embeds=cond.embeds.to(dtype), pooled_prompt_embeds=cond.pooled.to(dtype),
                        negative_prompt_embeds=uncond.embeds.to(dtype),
                        negative_pooled_prompt_embeds=uncond.pooled.to(dtype), latents=latents,
                        num_inference_steps=steps, guidance_scale=guidance, height=pixels, width=pixels,
                        output_type="pt").images

    run = run_pipeline if args.child == "pipeline" else run_engine
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run(0)  # warm-up (allocator, kernels, compiling): counts for neither time nor memory
    sync()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
    else:
        base_mem = current_rss_bytes()
    times = []
    with PeakRSS() as rss:
        for r in range(args.repeats):
            t0 = time.perf_counter()
            out = run(r + 1)
            sync()
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else rss.peak) - base_mem
    assert tuple(out.shape) == (batch, 3, pixels, pixels)
    params = sum(p.numel() for p in pipe.transformer.parameters())
    return {"images_per_s": batch / min(times), "peak_mem_bytes": int(peak), "transformer_params": params}


def measure(side: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--device", args.device, "--dtype", args.dtype,
           "--repeats", str(args.repeats), "--batch", str(args.batch), "--steps", str(args.steps),
           "--threads", str(args.threads)] + (["--large"] if args.large else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{side} measurement failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the flat result object here")
    parser.add_argument("--quick", action="store_true",
                        help="one round, one timed run per side, no compiled engine (under a minute)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--large", action="store_true", help="12 layers, width 1536, 64x64 latents (for a GPU)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per side on CPU")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled engine")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.child:
        print(json.dumps(child(args)))
        return

    sides = [s for s in SIDES if s != "engine_compiled" or not (args.quick or args.no_compile)]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(1 if args.quick else 2):  # alternate sides so background load hits them alike
        for side in sides:
            runs[side].append(measure(side, args))
    best = {side: max(r["images_per_s"] for r in rs) for side, rs in runs.items()}
    memory = {side: min(r["peak_mem_bytes"] for r in rs) for side, rs in runs.items()}
    result = {
        "device": args.device, "dtype": args.dtype, "model": "large" if args.large else "small",
        "transformer_params": runs["engine"][0]["transformer_params"], "batch": args.batch, "steps": args.steps,
        "cfg": 4.5, "diffusers_images_per_s": best["pipeline"], "diffusers_peak_mem_mb": memory["pipeline"] / 2**20,
        "memory_measure": "cuda max_memory_allocated growth" if args.device.startswith("cuda")
        else "peak RSS during the timed calls over RSS before them (sampled), separate processes",
    }
    for side, prefix in (("engine", ""), ("engine_compiled", "compiled_")):
        if side in best:
            result[f"{prefix}engine_images_per_s"] = best[side]
            result[f"{prefix}engine_peak_mem_mb"] = memory[side] / 2**20
            result[f"{prefix}speedup_vs_diffusers"] = best[side] / best["pipeline"]
            result[f"{prefix}memory_over_diffusers"] = memory[side] / max(memory["pipeline"], 1)

    print(f"{'':20}{'images/s':>10}{'speedup':>9}{'peak MiB':>10}{'memory ratio':>14}")
    for side, label in (("engine", "engine (SDE+logp)"), ("engine_compiled", "engine, compiled"),
                        ("pipeline", "diffusers pipeline")):
        if side in best:
            print(f"{label:<20}{best[side]:>10.2f}{best[side] / best['pipeline']:>9.2f}"
                  f"{memory[side] / 2**20:>10.1f}{memory[side] / max(memory['pipeline'], 1):>14.2f}")
    print(f"({result['model']} SD3, {result['transformer_params'] / 1e6:.1f}M params, {args.device} {args.dtype}, "
          f"batch {args.batch}, {args.steps} steps, CFG 4.5; memory: {result['memory_measure']})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
