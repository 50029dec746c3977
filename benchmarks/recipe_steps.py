"""Seconds per step (rollout, train) and peak memory of each recipe with LoRA on a random SD3 transformer.

    python benchmarks/recipe_steps.py --json out.json                       # SD3.5-Medium's size (a GPU's job)
    python benchmarks/recipe_steps.py --quick --json out.json               # a tiny transformer (a smoke run)
    python benchmarks/recipe_steps.py --recipes grpo --steps 3 --dtype bfloat16

Each recipe (grpo, nft, awm, dpo, draft) runs its own trainer's main() for --steps steps in a fresh process
(benchmarks/memory.py's child: peaks never mix; --in-process: one after another here, peaks reset between
them) on one random SD3 folder: --size medium is SD3.5-Medium's depth
and width (24 joint blocks of 24 heads x 64, about 2B parameters without its dual-attention layers) at 512x512,
--size tiny (--quick) 2 blocks of 4 x 32 at 32x32. Every recipe gets the same batch (2 prompts x 4 samples),
sampler steps, guidance, LoRA and the differentiable digit_alignment reward (DRaFT needs one; the score is
meaningless on a random model, its cost is what is measured), every other key at the recipe's default.

Per recipe (flat JSON): {recipe}_rollout_s and {recipe}_train_s, the medians over the steps after the first of
the metrics' time/rollout_s and time/train_s (the first step pays for warm-up: a single step is used alone),
{recipe}_peak_mb (torch.cuda.max_memory_allocated on a GPU, else the peak RSS above the post-import baseline,
read at the run's first checkpoint), {recipe}_ok, and {recipe}_error when it failed (the next recipe still runs).
`grpo_ratio_max_dev` is GRPO's largest |ratio - 1| over its steps' first minibatch (one minibatch per step
here): the rollout's policy recomputed by training in --dtype, which is exactly 0 when the two agree bit for
bit (`grpo_on_policy_exact`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tiny model builders (tests/tiny_models)
from benchmarks.report import Column, add_report_args, int_at_least, print_table, write_json  # noqa: E402

RECIPES = ("grpo", "nft", "awm", "dpo", "draft")
# (joint blocks, heads, head dim, latent side): SD3.5-Medium's transformer at 512x512, and a tiny one.
SIZES = {"medium": (24, 24, 64, 64), "tiny": (2, 4, 32, 4)}
PROMPTS = "the digit 3\nthe digit 7\n"
MB = 2**20


def run_args(folder: Path, prompts: Path, run_dir: Path, steps: int, pixels: int, sampler_steps: int,
             dtype: str) -> list[str]:
    """One recipe's command line: the same batch, resolution, sampler steps, reward and LoRA for every recipe."""
    return [f"run_dir={run_dir}", "model.card=sd3", f"model.path={folder}", "model.finetune=lora",
            f"model.dtype={dtype}", "tracker=none", f"steps={steps}", f"data.prompts={prompts}",
            f"data.eval_prompts={prompts}", "data.prompts_per_step=2", "data.group_size=4",
            f"sampling.steps={sampler_steps}", "eval.steps=1", "eval.seeds=1",
            f"sampling.height={pixels}", f"sampling.width={pixels}", "reward.scorers=digit_alignment:1.0",
            "eval.every=1000", "sample_every=1000", "save_every=1000"]


def recipe_args(recipe: str, sampler_steps: int) -> list[str]:
    """What a recipe needs beyond the shared keys: AWM trains 6 times of the rollout's grid by default, which
    a rollout of under 8 steps does not have (the smoke run's 2): it then draws 2 uniform times."""
    if recipe == "awm" and sampler_steps < 8:
        return ["train.time_sampling=uniform", "train.timesteps_per_sample=2"]
    return []


def build_folder(folder: Path, size: tuple[int, int, int, int], dtype: str) -> int:
    """A random SD3 folder of this size, saved in `dtype` (the runs load it in that dtype: half the bytes to
    read in bf16); returns the transformer's parameter count."""
    import torch

    from tiny_models.core import tiny_sd3_pipeline

    layers, heads, head_dim, latent = size
    pipe = tiny_sd3_pipeline(num_layers=layers, heads=heads, head_dim=head_dim, sample_size=latent)
    pipe.to(getattr(torch, dtype)).save_pretrained(str(folder))
    return sum(p.numel() for p in pipe.transformer.parameters())


def step_seconds(rows: list[dict], key: str) -> float:
    """The median of `key` over the training rows after the first (the first pays for warm-up), or the first
    alone when there is one."""
    values = [r[key] for r in rows if r.get("step", 0) >= 1 and key in r]
    if not values:
        raise ValueError(f"the run's metrics have no {key!r} in any training step")
    return statistics.median(values[1:] if len(values) > 1 else values)


def summarize(recipe: str, rows: list[dict], peak_bytes: int) -> dict:
    """One recipe's flat keys from its metrics rows and its peak."""
    out = {f"{recipe}_rollout_s": step_seconds(rows, "time/rollout_s"),
           f"{recipe}_train_s": step_seconds(rows, "time/train_s"), f"{recipe}_peak_mb": peak_bytes / MB}
    if recipe == "grpo":
        deviation = max(r["ratio/max_dev"] for r in rows if "ratio/max_dev" in r)
        out["grpo_ratio_max_dev"] = deviation
        out["grpo_on_policy_exact"] = deviation == 0.0
    return out


def reset_peak_rss() -> None:
    """Start the process's peak resident set (VmHWM) again from its current RSS (Linux: clear_refs 5), so that
    recipes run one after another in one process each get their own CPU peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(recipe: str, argv: list[str], work: Path, timeout_s: int, in_process: bool) -> dict:
    """One recipe through benchmarks/memory.py's child, in a fresh interpreter (peaks never mix; a crash or
    hang ends only this recipe) or, `in_process`, here (imports paid once: the smoke run's choice); its keys."""
    out = work / f"{recipe}.json"
    spec = {"root": str(ROOT), "recipe": recipe, "out": str(out), "argv": argv}
    if in_process:
        import torch

        from benchmarks.memory import child

        reset_peak_rss() if not torch.cuda.is_available() else torch.cuda.reset_peak_memory_stats()
        try:
            peak = child(spec)["peak"]
        except SystemExit as error:  # a recipe's refusal of its config: one line, as its CLI prints it
            raise RuntimeError(f"exit {error.code}") from error
    else:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
               "WANDB_MODE": "offline"}
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--child", json.dumps(spec)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
            raise RuntimeError(f"exit {proc.returncode}: {last}")
        peak = json.loads(out.read_text())["peak"]
    run_dir = Path(next(a for a in argv if a.startswith("run_dir=")).split("=", 1)[1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return summarize(recipe, rows, peak)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_report_args(parser, quick="--size tiny, 2 steps, 2 sampler steps (a smoke run)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, from " + ", ".join(RECIPES))
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="medium (default) or tiny")
    parser.add_argument("--steps", type=int_at_least(1), default=None,
                        help="training steps per recipe (default 3, --quick 2)")
    parser.add_argument("--sampler-steps", type=int_at_least(2), default=None,
                        help="denoising steps (default 10, --quick 2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--timeout", type=int_at_least(1), default=None,
                        help="seconds per recipe (a process of its own; default 600)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the recipes one after another in this process (imports once; no --timeout)")
    args = parser.parse_args(argv)
    if args.in_process and args.timeout is not None:
        parser.error("--timeout bounds each recipe's own process; --in-process runs them in this one, unbounded: "
                     "give one of them")
    args.timeout = 600 if args.timeout is None else args.timeout
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        raise SystemExit(f"--recipes={args.recipes!r}: valid values are {', '.join(RECIPES)} (comma-separated)")
    size = SIZES[args.size or ("tiny" if args.quick else "medium")]
    steps = args.steps if args.steps is not None else (2 if args.quick else 3)
    sampler_steps = args.sampler_steps if args.sampler_steps is not None else (2 if args.quick else 10)
    pixels = size[3] * 8  # the tiny VAE's 8x
    result: dict = {"size": args.size or ("tiny" if args.quick else "medium"), "dtype": args.dtype,
                    "pixels": pixels, "steps": steps, "sampler_steps": sampler_steps, "batch": 8}
    with tempfile.TemporaryDirectory(prefix="flywheel-recipe-steps-") as tmp:
        work = Path(tmp)
        result["transformer_params_m"] = build_folder(work / "sd3", size, args.dtype) / 1e6
        prompts = work / "prompts.txt"
        prompts.write_text(PROMPTS)
        for recipe in recipes:
            run = run_args(work / "sd3", prompts, work / f"run-{recipe}", steps, pixels, sampler_steps, args.dtype)
            run += recipe_args(recipe, sampler_steps)
            try:
                result.update(measure(recipe, run, work, args.timeout, args.in_process))
                result[f"{recipe}_ok"] = True
            except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as error:  # the next one still runs
                result[f"{recipe}_ok"] = False
                result[f"{recipe}_error"] = f"{type(error).__name__}: {error}"[:500]
            print(f"{recipe}: " + ("ok" if result[f"{recipe}_ok"] else result[f"{recipe}_error"]), flush=True)
            write_json(args.json, result)  # after every recipe: an outer timeout keeps the ones that finished
    print_table([Column("recipe", 8, align="<"), Column("rollout s", 11, ".3f"), Column("train s", 10, ".3f"),
                 Column("peak MiB", 11, ".0f")],
                [(r, result.get(f"{r}_rollout_s"), result.get(f"{r}_train_s"), result.get(f"{r}_peak_mb"))
                 for r in recipes])
    print(f"(random SD3, {result['transformer_params_m']:.1f}M parameters, LoRA, {args.dtype}, {pixels}x{pixels}, "
          f"batch 8, {sampler_steps} sampler steps; medians of steps 2..{steps})")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    failed = [key[:-len("_ok")] for key, ok in main().items() if key.endswith("_ok") and not ok]
    if failed:  # the JSON and the table hold every recipe's figures or error; the exit says some failed
        raise SystemExit(f"recipe_steps: {', '.join(failed)} failed (see *_error in the output above)")
