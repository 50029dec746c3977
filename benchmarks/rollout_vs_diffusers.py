"""Rollout throughput and peak memory: the engine (Flow-SDE with log-probs) vs a family's stock diffusers pipeline.

    python benchmarks/rollout_vs_diffusers.py [--family {sd3,qwen-image,ltx2,wan2.2-t2v,flux-kontext}] [--quick] [--json out.json]
    python benchmarks/rollout_vs_diffusers.py --device cuda --dtype bfloat16 --large --json gpu.json

Both run the same random model of the family (`FAMILIES`: SD3 by default, 4
layers, width 128, 32x32 latents; --large: 12 layers, width 1536, 64x64
latents; Qwen-Image the same depths and widths; LTX-2 the same depths, 64x64
pixels and 9 frames with sound, --large 256x256; Wan2.2 two experts of the same depths, width 96 (--large
1536), 32x32 pixels and 9 frames, --large 128x128; FLUX.1-Kontext 2 double and 2
single blocks of width 128 on 64x64 pixels, --large 6 + 12 of width 1536 on
128x128, editing one source image), batch 8, 10 steps, the
family's CFG (SD3 4.5; Qwen-Image's true CFG 4.0 with its norm rescale; LTX-2
3.0 on both modalities, STG, modality isolation and rescale off as in the engine; Wan2.2 4.0 on both experts;
Kontext's embedded guidance 3.5, no unconditional branch),
decode included, prompt embeddings precomputed for both (the engine's from its
cache, the pipeline's passed as prompt_embeds; Qwen-Image's cut to the longest
prompt with their mask, as its encode_prompt pads, while the engine pads every
prompt to 256 tokens). The
engine additionally records the whole trajectory and per-step log-probs, which
the pipeline does not.

A family is one row of `FAMILIES`: how its random pipeline is built, the
engine's model over that pipeline, and how the stock pipeline is called on
precomputed embeddings.

Three sides (and the forwards below): the engine with `compile=True` (engine/compiling.py; `model.compile=true`
in a recipe), the engine eager (the default), and the stock pipeline.
`speedup_vs_diffusers` is the compiled engine's, `eager_speedup_vs_diffusers`
the eager one's.

The model's forwards alone (`forwards_eager_s`, `forwards_compiled_s`): the transformer calls of one eager
engine rollout, recorded with their inputs, replayed through the eager module or the compiled engine's
compiled wrapper, then the rollout's image decode; nothing else. `engine_overhead_eager` and
`engine_overhead_compiled` are the median over rounds of engine time / forwards time - 1 in the same round
(goal <= 0.03 eager). A family's other model calls (LTX-2's audio decode, an editing family's source-image
encode) are not replayed: they count as engine time.

Speed: the sides share one process and one set of weights, and are called in
turn, round after round (the order rotates), after a warm-up call each (it
compiles). A side's ratio is the median over rounds of pipeline time / side
time within the same round, so load from other processes, which drifts over
seconds, hits both terms of each ratio alike.

Memory: the peak of tensor memory allocated during one call over what was
allocated before it: on CUDA torch.cuda.max_memory_allocated; on CPU the
allocator's own allocation and free events, recorded by the profiler, summed in
time order (RSS would also count pages the allocator keeps after a free).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tqdm import tqdm

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_models: the tests' tiny folders

from benchmarks.report import Column, add_report_args, print_table, write_json  # noqa: E402 (the shared --json/--quick flags, table and JSON)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights only: never ask the hub
PROMPT = "a photo of a red fox in the snow"
SIDES = ("engine", "engine_eager", "pipeline")
LABELS = {"engine": "engine, compiled", "engine_eager": "engine, eager", "pipeline": "diffusers pipeline"}
# The model's forwards alone, replayed with the inputs one engine rollout gave them: each engine side's
# time over its forwards' time is that side's overhead (scheduler steps, CFG bookkeeping, buffers, host work).
FORWARDS = {"engine": "forwards_compiled", "engine_eager": "forwards_eager"}
# Each engine side next to its forwards in the rotation, so that a pair sees the same load.
TIMED = ("engine", "forwards_compiled", "engine_eager", "forwards_eager", "pipeline")


def engine_overhead(engine_times: list[float], forward_times: list[float]) -> dict[str, float]:
    """The engine's overhead over the model's forwards alone, from paired rounds: each round's engine time over
    its forwards time, minus 1; the median over rounds, and the rounds' min and max."""
    if not engine_times or len(engine_times) != len(forward_times):
        raise ValueError(f"engine_overhead needs one forwards time per engine time, got {len(engine_times)} and "
                         f"{len(forward_times)}")
    if min(forward_times) <= 0:
        raise ValueError(f"forwards times must be positive, got {forward_times}")
    overheads = [e / f - 1.0 for e, f in zip(engine_times, forward_times)]
    return {"median": statistics.median(overheads), "min": min(overheads), "max": max(overheads)}


def device_timer(device, clock: str = "wall") -> Callable[[Callable[[], object]], float]:
    """Seconds of one call of `run()`. On CUDA the queue is drained before the clock starts and before it stops
    (torch.cuda.synchronize), so the time is the kernels' and not their launches'. On CPU every op has
    finished when it returns: nothing to wait for. clock "process" (CPU only) reads this process's CPU seconds
    (time.process_time) instead of the wall clock: other processes' load on a shared machine then stays out."""
    import torch

    if clock == "process" and device.type == "cuda":
        raise ValueError("--clock process measures CPU seconds: on CUDA the kernels' time is on the wall clock")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    now = time.process_time if clock == "process" else time.perf_counter

    def timed(run) -> float:
        sync()
        start = now()
        run()
        sync()
        return now() - start

    return timed


class ForwardRecorder:
    """The inputs of every transformer call and of the decode during one rollout, for replaying them alone."""

    def __init__(self, model):
        self.model = model
        self.calls: list[tuple[tuple, dict]] = []
        self.decoded: torch.Tensor | None = None

    @staticmethod
    def _copy(value):
        import torch

        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    def record(self, rollout: Callable[[], object]) -> "ForwardRecorder":
        model, original_decode = self.model, self.model.decode

        def hook(module, args, kwargs):
            self.calls.append((tuple(self._copy(a) for a in args), {k: self._copy(v) for k, v in kwargs.items()}))

        def decode(latents):
            self.decoded = latents.detach().clone()
            return original_decode(latents)

        handle = model.transformer.register_forward_pre_hook(hook, with_kwargs=True)
        model.decode = decode
        try:
            rollout()
        finally:
            handle.remove()
            del model.decode  # the class's method again
        if not self.calls or self.decoded is None:
            raise RuntimeError(f"the rollout made {len(self.calls)} transformer calls and "
                               f"{'a' if self.decoded is not None else 'no'} decode: nothing to replay")
        return self

    def replay(self, transformer) -> Callable[[], object]:
        """A call running the recorded forwards through `transformer` (the eager module or its compiled
        wrapper), then the decode: nothing else."""
        import torch

        def run():
            with torch.no_grad():
                for args, kwargs in self.calls:
                    transformer(*args, **kwargs)
                return self.model.decode(self.decoded)

        return run


def peak_allocated_bytes(run, device) -> int:
    """Peak tensor memory allocated while `run()` runs, over what was allocated when it started."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    allocated = peak = 0
    for _, nbytes in events:  # allocations count positive, frees negative
        allocated += nbytes
        peak = max(peak, allocated)
    return peak


# ---- the families: one row each ------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """How one model family is benchmarked."""

    card: str
    label: str
    guidance: float
    noise_level: float
    small: dict
    """builder sizes of the default model"""
    large: dict
    """builder sizes of --large"""
    setup: Callable
    """(sizes, device, dtype) -> (pipeline on device, the engine's FlowModel over it, image side in pixels)"""
    call: Callable
    """(pipe, cond, uncond, noise [B, *latent], steps, guidance, pixels) -> images [B, 3, H, W] (videos
    [B, 3, F, H, W]) in [0, 1]"""
    request: dict = field(default_factory=dict)
    """GenerationRequest fields of the family's rollouts beyond the common ones (video frames, audio)"""


def sd3_setup(sizes, device, dtype):
    from engine.families.common import prepare_pipeline
    from engine.families.sd3 import SD3Model
    from tiny_models.core import tiny_sd3_pipeline

    pipe = prepare_pipeline(tiny_sd3_pipeline(seed=0, **sizes), device, dtype)
    return pipe, SD3Model(pipe, dtype, dict(pipe.scheduler.config)), sizes["sample_size"] * pipe.vae_scale_factor


def sd3_call(pipe, cond, uncond, noise, steps, guidance, pixels):
    dtype = pipe.transformer.dtype
    return pipe(prompt_embeds=cond.embeds.to(dtype), pooled_prompt_embeds=cond.pooled.to(dtype),
                negative_prompt_embeds=uncond.embeds.to(dtype), negative_pooled_prompt_embeds=uncond.pooled.to(dtype),
                latents=noise, num_inference_steps=steps, guidance_scale=guidance, height=pixels,
                width=pixels, output_type="pt").images


def qwen_image_setup(sizes, device, dtype):
    from engine.families.common import prepare_pipeline
    from engine.families.qwen_image import QwenImageModel
    from tiny_models.qwen_image import tiny_qwen_image_pipeline

    builder = {k: v for k, v in sizes.items() if k != "latent_size"}
    pipe = prepare_pipeline(tiny_qwen_image_pipeline(seed=0, **builder), device, dtype)
    model = QwenImageModel(pipe, dtype, dict(pipe.scheduler.config))
    return pipe, model, sizes["latent_size"] * pipe.vae_scale_factor


def qwen_image_call(pipe, cond, uncond, noise, steps, guidance, pixels):
    """True CFG (true_cfg_scale = the engine's guidance) on the engine's embeddings, cut back to the longest
    prompt of each branch as the pipeline's own encode_prompt pads them: the engine's fixed 256-token
    padding is its own cost, measured here. The pipeline reads its latents packed into 2x2 patches."""
    from engine.families.flux import pack_latents

    def trimmed(embeds):
        n = int(embeds.mask.sum(1).max())
        return embeds.embeds[:, :n].to(pipe.transformer.dtype), embeds.mask[:, :n]

    (cond_embeds, cond_mask), (uncond_embeds, uncond_mask) = trimmed(cond), trimmed(uncond)
    return pipe(prompt_embeds=cond_embeds, prompt_embeds_mask=cond_mask, negative_prompt_embeds=uncond_embeds,
                negative_prompt_embeds_mask=uncond_mask, true_cfg_scale=guidance, latents=pack_latents(noise),
                num_inference_steps=steps, height=pixels, width=pixels, output_type="pt").images


LTX2_FRAMES = 9  # the tiny VAE compresses time 2x: 5 latent frames; audio: round(9/24 s x 25/s) = 9 tokens
_LTX2_TEXT: dict = {}  # batch size -> the pipeline's Gemma inputs, computed once outside the timings


def ltx2_setup(sizes, device, dtype):
    from engine.families.common import prepare_pipeline
    from engine.families.ltx2 import LTX2Model
    from tiny_models.ltx2 import tiny_ltx2_pipeline

    builder = {k: v for k, v in sizes.items() if k != "pixels"}
    pipe = prepare_pipeline(tiny_ltx2_pipeline(seed=0, **builder), device, dtype)
    return pipe, LTX2Model(pipe, dtype, dict(pipe.scheduler.config)), sizes["pixels"]


def ltx2_call(pipe, cond, uncond, noise, steps, guidance, pixels):
    """Plain CFG on both modalities (STG, modality isolation and rescale off: the engine's guidance), from
    the engine's flat [video | audio] noise. The pipeline runs its text connectors itself, so it gets
    Gemma's hidden states, computed once per batch size outside the timings (the engine's embeddings come
    from its cache). Both decode the video and the audio (the engine's requests ask for audio); returns
    the videos [B, 3, F, H, W]."""
    from engine.families.common import sequence_length

    batch, device = noise.shape[0], noise.device
    if batch not in _LTX2_TEXT:
        _LTX2_TEXT[batch] = pipe.encode_prompt([PROMPT] * batch, negative_prompt="", device=device,
                                               max_sequence_length=sequence_length(pipe.tokenizer, 1024))
    embeds, mask, negative, negative_mask = _LTX2_TEXT[batch]
    frames = (LTX2_FRAMES - 1) // pipe.vae_temporal_compression_ratio + 1
    side = pixels // pipe.vae_spatial_compression_ratio
    video_elements = frames * side * side * pipe.transformer.config.in_channels
    video = noise[:, :video_elements].reshape(batch, -1, pipe.transformer.config.in_channels)
    audio = noise[:, video_elements:].reshape(batch, -1, pipe.transformer.config.audio_in_channels)
    audio = audio * pipe.audio_vae.latents_std.to(audio) + pipe.audio_vae.latents_mean.to(audio)
    videos, _ = pipe(prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt_embeds=negative,
                     negative_prompt_attention_mask=negative_mask, latents=video, audio_latents=audio,
                     num_inference_steps=steps, guidance_scale=guidance, stg_scale=0.0, audio_stg_scale=0.0,
                     modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
                     height=pixels, width=pixels, num_frames=LTX2_FRAMES, output_type="pt", return_dict=False)
    return videos.permute(0, 2, 1, 3, 4)  # "pt" videos are [B, F, C, H, W]


WAN22_FRAMES = 9  # 3 latent frames (the causal VAE's 4x temporal compression)


def wan22_setup(sizes, device, dtype):
    """Wan2.2's two experts (the same depth and width each), an Euler scheduler at T2V-A14B's shift 12 on
    both sides (UniPC would also call the model once per step; Euler keeps the sides' step maths alike)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from engine.families.common import prepare_pipeline
    from tiny_models.families_2026 import tiny_wan22_pipeline
    from engine.families.wan22 import Wan22Model

    builder = {k: v for k, v in sizes.items() if k != "pixels"}
    pipe = tiny_wan22_pipeline(seed=0, scheduler=FlowMatchEulerDiscreteScheduler(shift=12.0), **builder)
    pipe = prepare_pipeline(pipe, device, dtype)
    return pipe, Wan22Model(pipe, dtype, dict(pipe.scheduler.config)), sizes["pixels"]


def wan22_call(pipe, cond, uncond, noise, steps, guidance, pixels):
    """CFG on the engine's UMT5 embeddings; each step on the expert its timestep picks (the pipeline's own
    switch); returns the videos [B, 3, F, H, W]."""
    dtype = pipe.transformer.dtype
    videos = pipe(prompt_embeds=cond.embeds.to(dtype), negative_prompt_embeds=uncond.embeds.to(dtype), latents=noise,
                  num_inference_steps=steps, guidance_scale=guidance, height=pixels, width=pixels,
                  num_frames=WAN22_FRAMES, output_type="pt").frames
    return videos.permute(0, 2, 1, 3, 4)  # "pt" videos are [B, F, C, H, W]


# The source image every flux-kontext rollout edits (written by kontext_setup; the engine reads requests' paths).
KONTEXT_SOURCE = Path(tempfile.gettempdir()) / "flywheel-rollout-bench-kontext-source.png"


def kontext_setup(sizes, device, dtype):
    import numpy as np
    from PIL import Image

    from engine.families.common import prepare_pipeline
    from engine.families.flux_kontext import FluxKontextModel
    from tiny_models.edit import tiny_flux_kontext_pipeline

    builder = {k: v for k, v in sizes.items() if k != "latent_size"}
    pipe = prepare_pipeline(tiny_flux_kontext_pipeline(seed=0, **builder), device, dtype)
    pixels = sizes["latent_size"] * pipe.vae_scale_factor
    rgb = (np.random.default_rng(0).random((pixels, pixels, 3)) * 255).astype(np.uint8)
    Image.fromarray(rgb).save(KONTEXT_SOURCE)
    return pipe, FluxKontextModel(pipe, dtype, dict(pipe.scheduler.config)), pixels


def kontext_call(pipe, cond, uncond, noise, steps, guidance, pixels):
    """Embedded guidance (no unconditional branch, as the engine), the source at the output's size
    (`_auto_resize=False`, `max_area` the output's: the engine's convention), latents packed into 2x2 patches.
    The pipeline encodes its one source image once per call; the engine once per distinct path in a batch."""
    from PIL import Image

    from engine.families.flux import pack_latents

    dtype = pipe.transformer.dtype
    source = Image.open(KONTEXT_SOURCE).convert("RGB")
    return pipe(image=source, prompt_embeds=cond.embeds.to(dtype), pooled_prompt_embeds=cond.pooled.to(dtype),
                latents=pack_latents(noise), num_inference_steps=steps, guidance_scale=guidance, height=pixels,
                width=pixels, max_area=pixels * pixels, _auto_resize=False, output_type="pt").images


FAMILIES = {
    "sd3": Family("sd3", "SD3", 4.5, 0.7, small=dict(num_layers=4, heads=4, head_dim=32, sample_size=32),
                  large=dict(num_layers=12, heads=24, head_dim=64, sample_size=64), setup=sd3_setup, call=sd3_call),
    "qwen-image": Family("qwen-image", "Qwen-Image", 4.0, 1.2,
                         small=dict(num_layers=4, heads=4, head_dim=32, latent_size=32),
                         large=dict(num_layers=12, heads=24, head_dim=64, latent_size=64),
                         setup=qwen_image_setup, call=qwen_image_call),
    "ltx2": Family("ltx2", "LTX-2 (video + audio)", 3.0, 0.7,
                   small=dict(num_layers=4, heads=4, head_dim=32, audio_heads=4, audio_head_dim=16, pixels=64),
                   large=dict(num_layers=12, heads=24, head_dim=64, audio_heads=16, audio_head_dim=64, pixels=256),
                   setup=ltx2_setup, call=ltx2_call, request=dict(frames=LTX2_FRAMES, audio=True)),
    "wan2.2-t2v": Family("wan2.2-t2v", "Wan2.2 T2V (two experts)", 4.0, 0.7,
                         small=dict(num_layers=4, heads=4, head_dim=24, pixels=32),
                         large=dict(num_layers=12, heads=24, head_dim=64, pixels=128),
                         setup=wan22_setup, call=wan22_call, request=dict(frames=WAN22_FRAMES)),
    "flux-kontext": Family("flux-kontext", "FLUX.1-Kontext (editing)", 3.5, 0.7,
                           small=dict(num_layers=2, num_single_layers=2, heads=4, head_dim=32, latent_size=32),
                           large=dict(num_layers=6, num_single_layers=12, heads=24, head_dim=64, latent_size=64),
                           setup=kontext_setup, call=kontext_call, request=dict(image=str(KONTEXT_SOURCE))),
}


def build_sides(args) -> tuple[dict, int]:
    """Callables running one batch on each side, sharing one set of random weights."""
    import torch

    from engine import Engine, GenerationRequest

    torch.set_num_threads(args.threads) if args.device == "cpu" else None
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    family = FAMILIES[args.family]
    sizes = dict(family.large if args.large else family.small)
    if args.layers is not None:
        sizes["num_layers"] = args.layers
    pipe, model, pixels = family.setup(sizes, device, dtype)
    engines = {"engine": Engine(model, device=device, compile=True), "engine_eager": Engine(model, device=device)}
    batch, steps, guidance = args.batch, args.steps, family.guidance
    encoder = engines["engine_eager"]
    cond, uncond = encoder.encode_prompts([PROMPT] * batch), encoder.encode_prompts([""] * batch)
    latent_shape = model.latent_shape(pixels, pixels, family.request.get("frames"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run_engine(engine, seed):
        requests = [GenerationRequest(prompt=PROMPT, seed=seed * 1000 + i, card=family.card, steps=steps,
                                      sampler="sde", noise_level=family.noise_level, guidance_scale=guidance,
                                      height=pixels, width=pixels, **family.request)
                    for i in range(batch)]
        images = engine.generate(requests).images
        sync()
        return images

    def run_pipeline(seed):
        g = torch.Generator(device).manual_seed(seed)
        noise = torch.randn((batch, *latent_shape), generator=g, device=device, dtype=dtype)
        with torch.no_grad():
            images = family.call(pipe, cond, uncond, noise, steps, guidance, pixels)
        sync()
        return images

    runs = {side: (run_pipeline if side == "pipeline" else (lambda seed, e=engines[side]: run_engine(e, seed)))
            for side in SIDES}
    recorder = ForwardRecorder(model).record(lambda: run_engine(engines["engine_eager"], 0))
    for side, forwards in FORWARDS.items():
        replay = recorder.replay(engines[side].serving_transformer())
        runs[forwards] = lambda seed, replay=replay: replay()  # the same inputs every round: times do not hang on them
    return runs, sum(p.numel() for p in pipe.transformer.parameters())


def measure(args) -> dict:
    """Every side's times over `rounds` rounds (after a warm-up call each), then each side's peak memory."""
    import torch

    runs, params = build_sides(args)
    for side, run in runs.items():
        images = run(0)
        assert tuple(images.shape[:2]) == (args.batch, 3), (side, images.shape)  # images, or videos [B, 3, F, H, W]
    timed = device_timer(torch.device(args.device), args.clock)
    times = {side: [] for side in runs}
    for r in tqdm(range(args.rounds), desc="rounds", disable=args.rounds < 2):
        order = TIMED[r % len(TIMED):] + TIMED[:r % len(TIMED)]
        for side in order:
            times[side].append(timed(lambda: runs[side](r + 1)))
    memory = {side: peak_allocated_bytes(lambda: runs[side](args.rounds + 1), torch.device(args.device))
              for side in SIDES}
    return {"times": times, "memory": memory, "transformer_params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="sd3", choices=sorted(FAMILIES), help="the model family (default sd3)")
    add_report_args(parser, quick="one timing round (under a minute)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--large", action="store_true", help="12 layers, width 1536, 64x64 latents (for a GPU)")
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer blocks instead of the size's (e.g. --large --layers 24: SD3.5-Medium's "
                             "depth and width)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 6, --quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--clock", default="wall", choices=["wall", "process"],
                        help="wall seconds, or (CPU only) this process's CPU seconds: steadier on a shared machine")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 1 if args.quick else 6

    measured = measure(args)
    times, memory = measured["times"], measured["memory"]
    ratios = {side: [p / t for p, t in zip(times["pipeline"], times[side])] for side in SIDES}
    speedup = {side: statistics.median(ratios[side]) for side in SIDES}
    images_per_s = {side: args.batch / statistics.median(times[side]) for side in SIDES}
    mib = {side: memory[side] / 2**20 for side in SIDES}
    memory_ratio = {side: memory[side] / max(memory["pipeline"], 1) for side in SIDES}
    family = FAMILIES[args.family]
    result = {
        "family": args.family, "device": args.device, "dtype": args.dtype, "model": "large" if args.large else "small",
        "transformer_params": measured["transformer_params"], "batch": args.batch, "steps": args.steps,
        "cfg": family.guidance, "rounds": args.rounds, "threads": args.threads, "layers_override": args.layers,
        "diffusers_images_per_s": images_per_s["pipeline"], "diffusers_peak_mem_mb": mib["pipeline"],
        "memory_measure": "peak tensor memory allocated during one call over the memory allocated before it",
    }
    for side, prefix in (("engine", ""), ("engine_eager", "eager_")):
        result[f"{prefix}engine_images_per_s"] = images_per_s[side]
        result[f"{prefix}engine_peak_mem_mb"] = mib[side]
        result[f"{prefix}speedup_vs_diffusers"] = speedup[side]
        result[f"{prefix}speedup_round_min"] = min(ratios[side])
        result[f"{prefix}speedup_round_max"] = max(ratios[side])
        result[f"{prefix}memory_over_diffusers"] = memory_ratio[side]
    overhead = {side: engine_overhead(times[side], times[forwards]) for side, forwards in FORWARDS.items()}
    for side, suffix in (("engine_eager", "eager"), ("engine", "compiled")):
        result[f"forwards_{suffix}_s"] = statistics.median(times[FORWARDS[side]])
        result[f"engine_{suffix}_s"] = statistics.median(times[side])
        result[f"engine_overhead_{suffix}"] = overhead[side]["median"]
        result[f"engine_overhead_{suffix}_round_min"] = overhead[side]["min"]
        result[f"engine_overhead_{suffix}_round_max"] = overhead[side]["max"]
    result["forwards_measure"] = ("the transformer calls and the decode of one engine rollout, replayed with the "
                                  "same inputs and nothing else; overhead = engine time / forwards time - 1, "
                                  "median of paired rounds")
    result["clock"] = args.clock
    result["timing_sync"] = ("torch.cuda.synchronize before and after each timed call" if args.device == "cuda"
                             else "none needed: CPU ops finish before they return")

    print_table([Column("", 20, align="<"), Column("images/s", 10, ".2f"), Column("speedup", 9, ".2f"),
                 Column("peak MiB", 10, ".1f"), Column("memory ratio", 14, ".2f")],
                [(LABELS[side], images_per_s[side], speedup[side], mib[side], memory_ratio[side]) for side in SIDES])
    print_table([Column("", 20, align="<"), Column("engine s", 10, ".3f"), Column("forwards s", 12, ".3f"),
                 Column("overhead", 10, ".3f")],
                [(LABELS[side], result[f"engine_{suffix}_s"], result[f"forwards_{suffix}_s"],
                  result[f"engine_overhead_{suffix}"]) for side, suffix in (("engine_eager", "eager"),
                                                                            ("engine", "compiled"))])
    print(f"({result['model']} {family.label}, {result['transformer_params'] / 1e6:.1f}M params, {args.device} "
          f"{args.dtype}, batch {args.batch}, {args.steps} steps, CFG {family.guidance}; speedup: median of "
          f"{args.rounds} paired rounds; memory: {result['memory_measure']})")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
