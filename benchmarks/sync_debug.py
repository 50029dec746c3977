"""Proof that the rollout's denoise loop never synchronises with the host: it runs under
`torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronising CUDA call.

    python benchmarks/sync_debug.py --device cuda --dtype bfloat16 --large --json out.json
    python benchmarks/sync_debug.py --json out.json        # on a CPU: the same code path, no CUDA mode

An engine over a random SD3 (rollout_vs_diffusers' sizes; --large --layers 24: SD3.5-Medium's depth and width)
generates one batch (Flow-SDE with log-probs, CFG) after a warm-up batch, eager and compiled. Only the
engine's call of `engine.denoise.denoise` runs inside the mode (prompt encoding, noise drawing and decoding
are outside it: they happen before and after the loop). On CUDA a synchronisation inside raises, and the
part records its message (`{side}_sync_free` false). Without CUDA the mode is never set
(`sync_debug_mode_set` false, said in `sync_debug_note`); the loop still runs under `engine.guards`'
forbid_host_transfers, which catches the Python-level reads (.item(), .cpu(), tensor truthiness) on any device.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import add_report_args, print_metrics, write_json  # noqa: E402


@contextlib.contextmanager
def sync_debug_error(cuda: bool):
    """torch.cuda.set_sync_debug_mode("error") inside, the previous mode after; nothing without CUDA."""
    import torch

    if not cuda:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def guarded_denoise(cuda: bool, calls: list):
    """`engine.denoise.denoise`, run inside the sync-debug mode and the host-transfer guard; counts its calls."""
    from engine.denoise import denoise
    from engine.guards import forbid_host_transfers

    def run(*args, **kwargs):
        calls.append(1)
        with sync_debug_error(cuda), forbid_host_transfers():
            return denoise(*args, **kwargs)

    return run


def check_side(engine, requests, cuda: bool) -> dict:
    """One guarded batch on `engine` after an unguarded warm-up batch (compiling happens there)."""
    import engine.engine as engine_module

    engine.generate(requests)
    calls: list = []
    run = guarded_denoise(cuda, calls)
    original = engine_module.denoise
    engine_module.denoise = run
    try:
        engine.generate(requests)
        error = None
    except RuntimeError as exc:  # a synchronising CUDA call, or a host transfer the guard caught
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    finally:
        engine_module.denoise = original
    if not calls:
        raise RuntimeError("the engine never called engine.denoise.denoise: nothing was checked")
    return {"sync_free": error is None, "error": error or ""}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_report_args(parser, quick="batch 2, 2 steps")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--large", action="store_true")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="default 8, --quick 2")
    parser.add_argument("--steps", type=int, default=None, help="default 10, --quick 2")
    parser.add_argument("--sides", default="eager,compiled", help="comma-separated: eager, compiled")
    args = parser.parse_args(argv)
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    if not sides or any(side not in ("eager", "compiled") for side in sides):
        raise SystemExit(f"--sides={args.sides!r}: valid values are eager, compiled (comma-separated)")
    import torch

    from benchmarks.rollout_vs_diffusers import FAMILIES, PROMPT
    from engine import Engine, GenerationRequest

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    family = FAMILIES["sd3"]
    sizes = dict(family.large if args.large else family.small)
    if args.layers is not None:
        sizes["num_layers"] = args.layers
    _, model, pixels = family.setup(sizes, device, dtype)
    batch, steps = args.batch or (2 if args.quick else 8), args.steps or (2 if args.quick else 10)
    requests = [GenerationRequest(prompt=PROMPT, seed=i, card="sd3", steps=steps, sampler="sde",
                                  noise_level=family.noise_level, guidance_scale=family.guidance, height=pixels,
                                  width=pixels) for i in range(batch)]
    result: dict = {"device": args.device, "dtype": args.dtype, "batch": batch, "steps": steps,
                    "sync_debug_mode_set": cuda,
                    "sync_debug_note": ("the denoise loop ran under torch.cuda.set_sync_debug_mode('error')" if cuda
                                        else "CUDA unavailable: the mode was not set; the loop ran under "
                                             "forbid_host_transfers only")}
    for side in sides:
        got = check_side(Engine(model, device=device, compile=side == "compiled"), requests, cuda)
        result[f"{side}_sync_free"], result[f"{side}_error"] = got["sync_free"], got["error"]
    result["sync_free"] = all(result[f"{side}_sync_free"] for side in sides)
    print_metrics(result, value_width=20)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
