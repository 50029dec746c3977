"""Rollout throughput and peak memory: the engine (Flow-SDE with log-probs) vs diffusers' StableDiffusion3Pipeline.

    python benchmarks/rollout_vs_diffusers.py [--quick] [--json out.json]
    python benchmarks/rollout_vs_diffusers.py --device cuda --dtype bfloat16 --large --json gpu.json

Both run the same random SD3 (default: 4 layers, width 128, 32x32 latents;
--large: 12 layers, width 1536, 64x64 latents), batch 8, 10 steps, CFG 4.5,
decode included, prompt embeddings precomputed for both (the engine's from its
cache, the pipeline's passed as prompt_embeds). The engine additionally records
the whole trajectory and per-step log-probs, which the pipeline does not.

Each side runs in its own subprocess (same seed, same weights), so peak memory
is its own: on CPU the growth of peak RSS (ru_maxrss) over the RSS before the
first generate call; on CUDA torch.cuda.max_memory_allocated over the memory
allocated before it. Sides alternate (engine, pipeline, engine, ...) and the
best run of each counts, so load from other processes hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(num_layers=4, heads=4, head_dim=32, sample_size=32)
LARGE = dict(num_layers=12, heads=24, head_dim=64, sample_size=64)
PROMPT = "a photo of a red fox in the snow"


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
    engine = Engine(model, device=device)
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

    run = run_engine if args.child == "engine" else run_pipeline
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
    else:
        base_mem = current_rss_bytes()
    if args.warmup:
        run(0)  # warm-up (allocator, kernels); it counts for memory, not for time
        sync()
    times = []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        out = run(r + 1)
        sync()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base_mem
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_mem
    assert tuple(out.shape) == (batch, 3, pixels, pixels)
    params = sum(p.numel() for p in pipe.transformer.parameters())
    return {"images_per_s": batch / min(times), "peak_mem_bytes": int(peak), "transformer_params": params}


def measure(side: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--device", args.device, "--dtype", args.dtype,
           "--repeats", str(args.repeats), "--batch", str(args.batch), "--steps", str(args.steps),
           "--threads", str(args.threads), "--warmup", str(int(not args.quick or args.device != "cpu"))] + \
        (["--large"] if args.large else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{side} measurement failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the flat result object here")
    parser.add_argument("--quick", action="store_true", help="one timed run per side, no CPU warm-up (under a minute)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--large", action="store_true", help="12 layers, width 1536, 64x64 latents (for a GPU)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per side on CPU")
    parser.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=["engine", "pipeline"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.child:
        print(json.dumps(child(args)))
        return

    rounds = 1 if args.quick else 2
    engine, pipeline = [], []
    for _ in range(rounds):  # alternate sides so background load hits both alike
        engine.append(measure("engine", args))
        pipeline.append(measure("pipeline", args))
    e = max(engine, key=lambda r: r["images_per_s"])
    p = max(pipeline, key=lambda r: r["images_per_s"])
    e_mem, p_mem = min(r["peak_mem_bytes"] for r in engine), min(r["peak_mem_bytes"] for r in pipeline)
    result = {
        "device": args.device, "dtype": args.dtype, "model": "large" if args.large else "small",
        "transformer_params": e["transformer_params"], "batch": args.batch, "steps": args.steps, "cfg": 4.5,
        "engine_images_per_s": e["images_per_s"], "diffusers_images_per_s": p["images_per_s"],
        "speedup_vs_diffusers": e["images_per_s"] / p["images_per_s"],
        "engine_peak_mem_mb": e_mem / 2**20, "diffusers_peak_mem_mb": p_mem / 2**20,
        "memory_over_diffusers": e_mem / max(p_mem, 1),
        "memory_measure": "cuda max_memory_allocated growth" if args.device.startswith("cuda")
        else "peak RSS growth (ru_maxrss - RSS before the first call), separate processes",
    }
    print(f"{'':24}{'engine (SDE+logp)':>20}{'diffusers':>14}{'ratio':>10}")
    print(f"{'images/s':24}{result['engine_images_per_s']:>20.2f}{result['diffusers_images_per_s']:>14.2f}"
          f"{result['speedup_vs_diffusers']:>10.2f}")
    print(f"{'peak memory (MiB)':24}{result['engine_peak_mem_mb']:>20.1f}{result['diffusers_peak_mem_mb']:>14.1f}"
          f"{result['memory_over_diffusers']:>10.2f}")
    print(f"({result['model']} SD3, {result['transformer_params'] / 1e6:.1f}M params, {args.device} {args.dtype}, "
          f"batch {args.batch}, {args.steps} steps, CFG 4.5; memory: {result['memory_measure']})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
