"""Peak memory of each recipe (grpo, nft, awm, dpo), LoRA and full fine-tune, on a random SD3 transformer.

    python benchmarks/memory.py --json out.json
    python benchmarks/memory.py --quick
    python benchmarks/memory.py --root /tmp/older-tree     # measure another tree's recipes (e.g. git archive)

A random SD3Transformer2DModel (6 joint blocks, 8 heads of 64: 54.5M parameters; --quick: 1.1M) with the
tiny SD3 folder's text encoders and VAE is written to a temporary folder, and each recipe runs in a fresh
process of its own (peaks never mix): 2 training steps of 2 prompts x 2 samples at 32x32, 2 denoising steps,
guidance 1, the jpeg_compressibility reward, an evaluation of the 2 prompts at the start and the end, 2 flow
times trained per sample (RECIPE_ARGS), each recipe's other keys at their defaults (GRPO, AWM and DPO hold a
reference policy, and so does NFT with its default train.kl_beta 0.03: see docs/memory.md). On a GPU the peak is `torch.cuda.max_memory_allocated`; on a CPU it is the process's peak
resident set (VmHWM) above its RSS once torch, diffusers and the recipe are imported (the libraries' own
memory is left out). Both are read when the run saves its first checkpoint, after its last evaluation:
`*_peak_run_*` adds the checkpoint and the LoRA export after it (safetensors serialises a checkpoint in
memory).

Keys (flat JSON): {recipe}_peak_{lora,full}_mb, {recipe}_peak_{lora,full}_over_weights (over the
transformer's weights in bytes), {recipe}_over_grpo_peak_{lora,full}, the same for the whole run
({recipe}_peak_run_{lora,full}_mb, ...), weights_mb, transformer_params_m, cuda. Goal:
nft_over_grpo_peak_lora <= 1.1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the tests' tiny folders
from benchmarks.report import add_report_args, write_json  # noqa: E402 (the shared --json/--quick flags and JSON)

RECIPES = ("grpo", "nft", "awm", "dpo")
FINETUNES = ("lora", "full")
# The transformer: (joint blocks, heads, head dim). The full size is over 50M parameters.
SIZES = {"full": (6, 8, 64), "quick": (2, 4, 32)}
# Every recipe trains 2 flow times per sample (one forward and backward each), NFT's and DPO's default: GRPO both
# of the 2 denoising steps (its default int(0.99·2) = 1 would do half the training forwards), AWM 2 uniform times
# (its default 6 times of the rollout's grid need more denoising steps).
RECIPE_ARGS = {"grpo": ["train.timestep_fraction=1.0"],
               "awm": ["train.time_sampling=uniform", "train.timesteps_per_sample=2"]}
PROMPTS = "a red cat\na blue dog\n"
MB = 2**20


def run_args(recipe: str, finetune: str, folder: Path, prompts: Path, run_dir: Path, steps: int) -> list[str]:
    """One recipe's command line: the same batch, resolution, sampler steps, reward and evaluation for all."""
    return [f"run_dir={run_dir}", "model.card=sd3", f"model.path={folder}", f"model.finetune={finetune}",
            "tracker=none", "threads=1", f"steps={steps}", f"data.prompts={prompts}", f"data.eval_prompts={prompts}",
            "data.prompts_per_step=2", "data.group_size=2", "sampling.steps=2", "eval.steps=1",
            "eval.seeds=1", "sampling.height=32", "sampling.width=32", "sampling.guidance_scale=1",
            "reward.scorers=jpeg_compressibility:1.0", "eval.every=1000", "sample_every=1000", "save_every=1000",
            *RECIPE_ARGS.get(recipe, [])]


# ---- the child: one recipe in a fresh process ---------------------------------------------------------


def _proc_status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """The resident set now (Linux), or 0 where /proc is missing (the peak is then measured from zero)."""
    kb = _proc_status_kb("VmRSS")
    return 0 if kb is None else kb * 1024


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (VmHWM; getrusage's ru_maxrss elsewhere)."""
    kb = _proc_status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux


def child(spec: dict) -> dict:
    """Run one recipe's main() here; returns its peaks (bytes) at the first checkpoint and at the end."""
    sys.path.insert(0, spec["root"])  # the measured tree's flywheel, engine and trainers
    recipe = importlib.import_module(f"trainers.{spec['recipe']}")  # first: it sets OpenMP's env before torch
    import diffusers  # noqa: F401  the libraries' memory goes into the baseline, the same for every recipe
    import torch
    import transformers  # noqa: F401
    from flywheel.recipe.session import RecipeRun

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline = rss_bytes()
    measured: dict[str, int] = {}

    def peak() -> int:
        return torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes() - baseline

    original_save = RecipeRun.save

    def save(self, *args, **kwargs):
        measured.setdefault("peak", peak())  # before the first checkpoint: rollouts, updates and evaluations
        return original_save(self, *args, **kwargs)

    RecipeRun.save = save
    recipe.main(spec["argv"])
    if "peak" not in measured:
        raise RuntimeError(f"{spec['recipe']}: the run saved no checkpoint, so no peak was read")
    return {"peak": measured["peak"], "peak_run": peak(), "baseline_rss": baseline, "cuda": cuda}


# ---- the parent: the folder, one child per recipe and fine-tune, the table ----------------------------


def build_folder(folder: Path, size: tuple[int, int, int]) -> tuple[int, int]:
    """A random SD3 folder of this size; returns (transformer parameters, their bytes as saved: float32)."""
    from tiny_models.core import tiny_sd3_pipeline

    layers, heads, head_dim = size
    pipe = tiny_sd3_pipeline(num_layers=layers, heads=heads, head_dim=head_dim)
    pipe.save_pretrained(str(folder))
    weights = list(pipe.transformer.parameters())
    return sum(p.numel() for p in weights), sum(p.numel() * p.element_size() for p in weights)


def measure(recipe: str, finetune: str, folder: Path, prompts: Path, work: Path, root: Path, steps: int,
            timeout_s: int) -> dict:
    """One recipe in a fresh interpreter (cwd and imports from `root`); its peaks in bytes."""
    out = work / f"{recipe}-{finetune}.json"
    spec = {"root": str(root), "recipe": recipe, "out": str(out),
            "argv": run_args(recipe, finetune, folder, prompts, work / f"run-{recipe}-{finetune}", steps)}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root),
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{recipe} ({finetune}) failed with exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def summarize(peaks: dict[tuple[str, str], dict], weights_bytes: int) -> dict[str, float]:
    """The flat keys from {(recipe, finetune): {"peak": bytes, "peak_run": bytes}} and the weights' bytes."""
    result: dict[str, float] = {"weights_mb": weights_bytes / MB}
    for (recipe, finetune), got in peaks.items():
        for kind in ("peak", "peak_run"):
            result[f"{recipe}_{kind}_{finetune}_mb"] = got[kind] / MB
            result[f"{recipe}_{kind}_{finetune}_over_weights"] = got[kind] / weights_bytes
            grpo = peaks.get(("grpo", finetune))
            if grpo is not None:
                result[f"{recipe}_over_grpo_{kind}_{finetune}"] = got[kind] / grpo[kind]
    return result


def table(result: dict[str, float], recipes, finetunes, kind: str = "peak") -> str:
    head = f"{'recipe':<8}" + "".join(f"{f + ' MB':>11}{'/weights':>10}{'/grpo':>8}" for f in finetunes)
    rows = [head]
    for recipe in recipes:
        line = f"{recipe:<8}"
        for f in finetunes:
            mb = result.get(f"{recipe}_{kind}_{f}_mb")
            if mb is None:  # not measured
                line += f"{'-':>11}{'-':>10}{'-':>8}"
                continue
            grpo = result.get(f"{recipe}_over_grpo_{kind}_{f}")
            line += (f"{mb:>11.0f}{result[f'{recipe}_{kind}_{f}_over_weights']:>10.2f}"
                     + (f"{grpo:>8.2f}" if grpo is not None else f"{'-':>8}"))
        rows.append(line)
    return "\n".join(rows)


def parse_list(value: str, valid: tuple[str, ...], flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in valid]
    if bad or not items:
        raise SystemExit(f"{flag}={value!r}: valid values are {', '.join(valid)} (comma-separated)")
    return items


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_report_args(parser, quick="a 1.1M-parameter transformer (a smoke run)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, from " + ", ".join(RECIPES))
    parser.add_argument("--finetune", default=",".join(FINETUNES), help="comma-separated: lora, full")
    parser.add_argument("--root", type=Path, default=ROOT, help="the project tree whose recipes run (default: this)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per run")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        write_json(spec["out"], child(spec))
        return {}
    recipes = parse_list(args.recipes, RECIPES, "--recipes")
    finetunes = parse_list(args.finetune, FINETUNES, "--finetune")
    root = args.root.resolve()
    if not (root / "trainers").is_dir():
        raise SystemExit(f"--root {root}: holds no trainers/ folder (give a project tree)")
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps}: must be >= 1")
    size = SIZES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory(prefix="flywheel-memory-") as tmp:
        work = Path(tmp)
        params, weights_bytes = build_folder(work / "sd3", size)
        prompts = work / "prompts.txt"
        prompts.write_text(PROMPTS)
        peaks = {}
        for finetune in finetunes:
            for recipe in recipes:
                peaks[(recipe, finetune)] = got = measure(recipe, finetune, work / "sd3", prompts, work, root,
                                                          args.steps, args.timeout)
                print(f"{recipe} {finetune}: peak {got['peak'] / MB:.0f} MB (whole run {got['peak_run'] / MB:.0f} MB)",
                      flush=True)
    cuda = any(p["cuda"] for p in peaks.values())
    result = {**summarize(peaks, weights_bytes), "transformer_params_m": params / 1e6, "cuda": float(cuda)}
    where = "torch.cuda.max_memory_allocated" if cuda else "peak RSS above the post-import baseline"
    print(f"\nSD3 transformer {params / 1e6:.1f}M parameters, {weights_bytes / MB:.0f} MB in float32; {where}; "
          f"{args.steps} steps of 2 prompts x 2 samples at 32x32; recipes from {root}")
    print("until the first checkpoint (rollouts, updates, evaluations):")
    print(table(result, recipes, finetunes))
    print("whole run (with the checkpoint and the LoRA export):")
    print(table(result, recipes, finetunes, kind="peak_run"))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
