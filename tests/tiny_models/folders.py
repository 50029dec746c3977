"""A tiny stand-in folder of any card, for a smoke test: `python tests/tiny_models --card sd3 --out /tmp/tiny-sd3`.

The folder is written by the card's builder in this package and moved into
place when complete; `smoke_command` is the one-step GRPO run that trains a
LoRA on it.
"""

from __future__ import annotations

from pathlib import Path

# card id -> (module, builder): each builder writes a complete diffusers folder with save_pretrained.
TINY_BUILDERS = {
    "sd3": ("tiny_models.core", "build_tiny_sd3"),
    "flux": ("tiny_models.core", "build_tiny_flux"),
    "qwen-image": ("tiny_models.qwen_image", "build_tiny_qwen_image"),
    "wan2.1-t2v": ("tiny_models.core", "build_tiny_wan"),
    "wan2.1-i2v": ("tiny_models.wan_i2v", "build_tiny_wan_i2v"),
    "ltx2": ("tiny_models.ltx2", "build_tiny_ltx2"),
    "flux2-klein": ("tiny_models.families_2026", "build_tiny_flux2_klein"),
    "z-image": ("tiny_models.families_2026", "build_tiny_z_image"),
    "wan2.2-t2v": ("tiny_models.families_2026", "build_tiny_wan22"),
    "flux-kontext": ("tiny_models.edit", "build_tiny_flux_kontext"),
    "qwen-image-edit-plus": ("tiny_models.edit", "build_tiny_qwen_image_edit_plus"),
}
# A size each tiny folder generates at, within its card's size rule (the sampling.* keys of a smoke run).
TINY_SIZES = {
    "sd3": dict(height=32, width=32),
    "flux": dict(height=32, width=32),
    "qwen-image": dict(height=24, width=40),
    "wan2.1-t2v": dict(height=16, width=16, frames=5),
    "wan2.1-i2v": dict(height=16, width=32, frames=5),
    "ltx2": dict(height=32, width=64, frames=5),
    "flux2-klein": dict(height=24, width=40),
    "z-image": dict(height=24, width=40),
    "wan2.2-t2v": dict(height=16, width=32, frames=5),
    "flux-kontext": dict(height=24, width=40),
    "qwen-image-edit-plus": dict(height=32, width=64),
}
# Cards whose prompts come with an image (a .jsonl of {"prompt": ..., "image": ...} rows).
IMAGE_CARDS = ("wan2.1-i2v", "flux-kontext", "qwen-image-edit-plus")
# Cards whose weights ship with the project: they need no folder.
SHIPPED_CARDS = ("toy-digits", "toy-numbers")


class TinyFolderError(ValueError):
    """A tiny folder cannot be written as asked (an unknown card, an output path in use)."""


def check_tiny_request(card: str, out: str | Path) -> Path:
    """The output folder of `write_tiny_folder(card, out)`, or TinyFolderError before anything is written."""
    if card not in TINY_BUILDERS:
        shipped = (f"; {card} ships its weights and needs no folder (leave model.path unset)"
                   if card in SHIPPED_CARDS else "")
        raise TinyFolderError(f"--card {card}: no tiny folder for this card{shipped}; valid cards: "
                              f"{', '.join(TINY_BUILDERS)}")
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise TinyFolderError(f"--out {out}: is a file; give a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise TinyFolderError(f"--out {out}: the folder is not empty; give a new or empty folder (nothing was "
                              "overwritten)")
    return out


def write_tiny_folder(card: str, out: str | Path, seed: int = 0) -> Path:
    """Write a tiny random diffusers folder of `card` at `out` (a new or empty folder) and return it.

    The folder is what a user's would be (model_index.json, the transformer,
    VAE, text encoders, tokenizers and scheduler, written with save_pretrained),
    so the card's loader and the stock pipeline's `from_pretrained` read it;
    nothing is downloaded (the tokenizers are built in memory). It is written
    beside `out` first and moved into place when complete, so an interrupted
    write leaves no half folder. Generate at `TINY_SIZES[card]`.
    """
    import importlib
    import shutil
    import tempfile

    out = check_tiny_request(card, out)
    module, builder = TINY_BUILDERS[card]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        getattr(importlib.import_module(module), builder)(staging / card, seed=seed)
        if out.is_dir():
            out.rmdir()  # empty (checked above); os.replace cannot move a folder onto it otherwise
        (staging / card).replace(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def smoke_command(card: str, folder: str | Path) -> str:
    """A one-step GRPO command line that trains a LoRA on the tiny folder of `card` (CPU, seconds)."""
    size = " ".join(f"sampling.{k}={v}" for k, v in TINY_SIZES[card].items())
    reward = "reward.scorers=audio_loudness:1.0 sampling.audio=true" if card == "ltx2" else "reward.scorers=jpeg_compressibility:1.0"
    data = ("data.prompts=PROMPTS.jsonl data.eval_prompts=PROMPTS.jsonl" if card in IMAGE_CARDS
            else "data.prompts=PROMPTS.txt data.eval_prompts=PROMPTS.txt")
    return (f"python trainers/grpo.py model.card={card} model.path={folder} run_dir=runs/smoke-{card} "
            f"steps=1 tracker=none {data} data.prompts_per_step=2 data.group_size=2 sampling.steps=2 "
            f"eval.steps=1 eval.seeds=1 {size} {reward} model.finetune=lora model.lora_rank=4")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python tests/tiny_models",
        description="Write a tiny random diffusers folder of a model card, for a smoke test (no download).")
    parser.add_argument("--card", required=True, help=f"one of: {', '.join(TINY_BUILDERS)}")
    parser.add_argument("--out", required=True, help="a new or empty folder to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    try:
        check_tiny_request(args.card, args.out)
        folder = write_tiny_folder(args.card, args.out, seed=args.seed)
    except ModuleNotFoundError as e:  # before OSError's branch: not a path problem
        print(f"error: the tiny {args.card} folder is built with diffusers and transformers ({e.name} is not "
              "installed): pip install -e \".[diffusers]\"", file=sys.stderr)
        return 2
    except (TinyFolderError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a tiny random {args.card} folder to {folder} (random weights: outputs are noise)")
    prompts = ("PROMPTS.jsonl: lines of {\"prompt\": ..., \"image\": \"frame.png\"} (a first frame or source "
               "image each)" if args.card in IMAGE_CARDS else "PROMPTS.txt: a few prompts, one a line")
    print(f"smoke test ({prompts}):\n  {smoke_command(args.card, folder)}")
    return 0

