"""Reward throughput: images/s of in-process, remote (HTTP, safetensors and PNG) and served scoring, side by side.

    python benchmarks/reward_throughput.py [--reward jpeg_compressibility] [--batch 64] [--json out.json] [--quick]

All paths score the same batch in the same run; the remote server runs on a
thread of this process (127.0.0.1), so the ratio measures the wire and the
server, not the network. `served` is reported when rewards.served exists.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rewards  # noqa: E402
from benchmarks.report import Column, add_report_args, print_table, write_json  # noqa: E402 (the shared flags, table, JSON)
from rewards.remote import RemoteScorer  # noqa: E402
from rewards.serve import ServerThread  # noqa: E402


def measure(paths: dict, images, prompts, metadata, repeats: int) -> tuple[dict, dict]:
    """Best-of-`repeats` images/s of each path and its scores; paths take turns, so load drift hits all alike."""
    scores = {name: fn(images, prompts, metadata) for name, fn in paths.items()}  # warm-up
    best = {name: float("inf") for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            t = time.perf_counter()
            scores[name] = fn(images, prompts, metadata)
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: images.shape[0] / b for name, b in best.items()}, scores


def served_scorer(name: str, scorer):
    """(ServedRewardScorer over an AsyncEngine hosting `scorer`, the engine) if rewards.served exists, else None."""
    try:
        from engine.async_engine import AsyncEngine
        from rewards.served import ServedRewardScorer
    except ImportError:
        return None
    engine = AsyncEngine({name: scorer}).start_background()
    return ServedRewardScorer(engine, name), engine


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", default="jpeg_compressibility", help="registered scorer to measure")
    parser.add_argument("--kwargs", default="{}", help='scorer kwargs as JSON, e.g. \'{"path": "/models/clip"}\'')
    parser.add_argument("--batch", type=int, default=64, help="images per batch")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (RGB)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per path (best is reported)")
    add_report_args(parser, quick="small batch, few repeats (well under a minute)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.repeats = min(args.batch, 16), 3

    torch.manual_seed(0)
    images = torch.rand(args.batch, 3, args.size, args.size)
    prompts = [f'a sign that says "{i}" with digit {i % 10}' for i in range(args.batch)]
    metadata = [{"digit": i % 10} for i in range(args.batch)]
    scorer = rewards.get(args.reward, **json.loads(args.kwargs))

    out: dict = {"reward": args.reward, "batch": args.batch, "size": args.size}
    with ServerThread(scorer, args.reward) as server:
        paths = {"in_process": scorer,
                 "remote_safetensors": RemoteScorer(server.url, encoding="safetensors"),
                 "remote_png": RemoteScorer(server.url, encoding="png")}
        served = served_scorer(args.reward, scorer)
        if served is not None:
            paths["served"] = served[0]
        try:
            rates, scores = measure(paths, images, prompts, metadata, args.repeats)
        finally:
            if served is not None:
                served[1].close_background()
    local = scores["in_process"]
    for name in paths:
        out[f"{name}_images_per_s"] = rates[name]
        if name != "in_process":
            diff = (torch.as_tensor(scores[name]).float() - local).abs().nan_to_num(0)
            out[f"{name}_max_abs_diff"] = float(diff.max())
    base = out["in_process_images_per_s"]
    for key in [k for k in out if k.endswith("_images_per_s") and k != "in_process_images_per_s"]:
        out[key.replace("_images_per_s", "_vs_in_process")] = out[key] / base

    print(f"reward {args.reward}: batch {args.batch} x 3x{args.size}x{args.size}")
    print_table([Column("path", 22, align="<"), Column("images/s", 12, ".1f"), Column("vs in-process", 16, ".2f")],
                [(key[: -len("_images_per_s")], out[key], out[key] / base)
                 for key in [k for k in out if k.endswith("_images_per_s")]])
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
