"""Seconds per image of every in-process scorer of docs/rewards.md's table that runs on this machine.

    OMP_NUM_THREADS=1 python benchmarks/reward_costs.py --batch 8 --repeats 2 --json out.json
    python benchmarks/reward_costs.py --quick          # tiny inputs and models: checks that every row runs

Each scorer is called once to warm up, then --repeats times; a row's figure is the median call's seconds over
the images (or clips) in the batch. Models whose weights are not here are randomly initialised at the real
architecture (compute does not depend on the weights; nothing is downloaded): CLIP ViT-B/32 (clip_score) and
ViT-L/14 (PickScore, the aesthetic head), both at 224 px. `hpsv3` runs a *tiny* random Qwen2-VL (2 layers,
width 32) with the real image processing (the real image token count at the scorer's default pixels): its row
says so and gives the real 7B backbone's parameters over the tiny one's (`hpsv3_real_over_tiny_params`), the
factor its matmuls scale by. The video rows score clips of 9 frames through K = 4 of them (`frames=4`, the
default). `ocr` (RapidOCR, `.[ocr]`) reads rendered text; it is skipped, and says so, when rapidocr is missing.
--quick: batch 2, one call, 64x64 images and tiny CLIPs; its figures mean nothing.

Flat JSON: `{row}_s_per_image` per row, `{row}_input` (what it was given), `{row}_skipped` for a row that could
not run here, and threads / batch / repeats.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_models: the tiny HPSv3 folder

from benchmarks.report import Column, add_report_args, print_table, write_json  # noqa: E402

QWEN2_VL_7B_PARAMS = 8.29e9  # Qwen2-VL-7B-Instruct, HPSv3's backbone (its model card's parameter count)
VIDEO_FRAMES, AUDIO_RATE = 9, 16000


@dataclass(frozen=True)
class Sizes:
    batch: int
    repeats: int
    pixels: int
    """side of the images the image scorers see"""
    tiny_clip: bool
    """--quick: tiny CLIP configs instead of ViT-B/32 and ViT-L/14"""
    audio_seconds: float


def seconds_per_image(call: Callable[[], object], batch: int, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call, over the batch."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / batch


def clip_folder(root: Path, kind: str) -> Path:
    """A random CLIP saved as a local folder: "l14" (ViT-L/14 text + vision), "b32" (ViT-B/32) or "tiny"; with
    an aesthetic head over its projection."""
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder = root / f"clip-{kind}"
    vocab = {t: i for i, t in enumerate(["<|startoftext|>", "<|endoftext|>"] + [chr(c) for c in range(97, 123)]
                                           + [chr(c) + "</w>" for c in range(97, 123)])}
    vision = {"l14": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                          patch_size=14),
              "b32": dict(patch_size=32),
              "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           patch_size=32)}[kind]
    text = {"l14": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
            "b32": {}, "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2)}[kind]
    projection = {"l14": 768, "b32": 512, "tiny": 16}[kind]
    config = CLIPConfig(text_config=dict(vocab_size=len(vocab), bos_token_id=0, eos_token_id=1, pad_token_id=1, **text),
                        vision_config=dict(image_size=224, **vision), projection_dim=projection)
    CLIPModel(config).eval().save_pretrained(folder)
    CLIPTokenizer(vocab=vocab, merges=[]).save_pretrained(folder)
    CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(folder)
    save_file({"layers.0.weight": torch.randn(1024, projection) * 0.01, "layers.0.bias": torch.zeros(1024),
               "layers.1.weight": torch.randn(1, 1024) * 0.01, "layers.1.bias": torch.zeros(1)},
              str(folder / "aesthetic_head.safetensors"))
    return folder


def hpsv3_folder(root: Path) -> tuple[Path, int]:
    """The tests' tiny random HPSv3 folder (tests/tiny_models/hpsv3.py), with positions for a 512x512 image;
    returns it and the backbone's parameter count."""
    from tiny_models.hpsv3 import write_tiny_hpsv3

    folder = root / "tiny-hpsv3"
    return folder, write_tiny_hpsv3(folder, max_positions=32768)


def rendered_text(batch: int, pixels: int, text: str = "HELLO"):
    """`batch` white images with `text` in black (what an OCR reward is meant to read), [B, 3, H, W]."""
    import numpy as np
    import torch
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (pixels, pixels), "white")
    ImageDraw.Draw(image).text((pixels // 10, pixels // 3), text, fill="black",
                               font=ImageFont.load_default(size=max(8, pixels // 6)))
    one = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255
    return one.expand(batch, -1, -1, -1).contiguous()


# ---- the rows: name -> (what it is given, seconds per image) ----------------------------------------------


ROW_NAMES = ("digit_alignment", "number_alignment", "jpeg_compressibility", "ocr", "clip_score", "clip_score_video",
             "pickscore", "pickscore_video", "aesthetic", "aesthetic_video", "audio_loudness", "av_onset_sync", "hpsv3")


def measure_rows(sizes: Sizes, root: Path, only: set[str] | None = None) -> tuple[list[tuple[str, str, float | None]], dict]:
    """Every row's (name, input, seconds per image, None when skipped) and the extra keys (skips, HPSv3's);
    with `only`, just those rows are timed (their models are still built)."""
    import torch

    import rewards

    torch.manual_seed(0)
    b, r, px = sizes.batch, sizes.repeats, sizes.pixels
    rows: list[tuple[str, str, float | None]] = []
    extra: dict = {}

    def row(name: str, given: str, scorer, images, prompts, **kwargs) -> None:
        if only is not None and name not in only:
            return
        call = lambda: scorer(images, prompts, [{}] * len(prompts), **kwargs)  # noqa: E731
        rows.append((name, given, seconds_per_image(call, len(prompts), r)))
        print(f"{name} ({given}): {rows[-1][2]:.4g} s/image", flush=True)

    digits = ["the digit 3"] * b
    row("digit_alignment", "8x8 grey", rewards.get("digit_alignment"), torch.rand(b, 1, 8, 8), digits)
    row("number_alignment", "8x16 grey", rewards.get("number_alignment"), torch.rand(b, 1, 8, 16),
        ["the number 42"] * b)
    images = torch.rand(b, 3, px, px)
    cats = ["a photo of a cat"] * b
    row("jpeg_compressibility", f"{px}x{px}", rewards.get("jpeg_compressibility"), images, cats)
    if importlib.util.find_spec("rapidocr") is None:
        extra["ocr_skipped"] = "rapidocr is not installed (pip install '.[ocr]')"
    else:
        row("ocr", f"{px}x{px} rendered text", rewards.get("ocr"), rendered_text(b, px), ['a sign that says "HELLO"'] * b)
    small, large = ("tiny", "tiny") if sizes.tiny_clip else ("b32", "l14")
    label = {"tiny": "tiny CLIP", "b32": "ViT-B/32", "l14": "ViT-L/14"}
    folders = {kind: clip_folder(root, kind) for kind in {small, large}}
    videos = torch.rand(b, 3, VIDEO_FRAMES, px, px)
    for name, kind in (("clip_score", small), ("pickscore", large), ("aesthetic", large)):
        row(name, f"{px}x{px}, {label[kind]}", rewards.get(name, path=str(folders[kind])), images, cats)
        row(f"{name}_video", f"{VIDEO_FRAMES} frames {px}x{px}, K=4, {label[kind]}",
            rewards.get(f"{name}_video", path=str(folders[kind]), frames=4), videos[:, :, 0], cats, videos=videos)
    samples = int(sizes.audio_seconds * AUDIO_RATE)
    audio = 0.1 * torch.randn(b, 1, samples)
    row("audio_loudness", f"{sizes.audio_seconds:g} s mono {AUDIO_RATE} Hz", rewards.get("audio_loudness"), None,
        [""] * b, audio=audio, sample_rate=AUDIO_RATE)
    row("av_onset_sync", f"{sizes.audio_seconds:g} s audio + {VIDEO_FRAMES} frames {px}x{px}",
        rewards.get("av_onset_sync"), videos[:, :, 0], [""] * b, audio=audio, sample_rate=AUDIO_RATE, videos=videos)
    folder, params = hpsv3_folder(root)
    hps = rewards.get("hpsv3", path=str(folder), **({"pixels": 4 * 28 * 28} if sizes.tiny_clip else {}))
    row("hpsv3", f"{px}x{px} at {hps.pixels} px, TINY random Qwen2-VL ({params / 1e6:.2f}M params)", hps, images, cats)
    extra.update({"hpsv3_tiny_params": params, "hpsv3_real_over_tiny_params": QWEN2_VL_7B_PARAMS / params})
    return rows, extra


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_report_args(parser, quick="batch 2, one call, 64x64 images, tiny CLIPs (checks every row runs)")
    parser.add_argument("--batch", type=int, default=None, help="images per call (default 8, --quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default 2, --quick 1)")
    parser.add_argument("--pixels", type=int, default=None, help="image side (default 512, --quick 64)")
    parser.add_argument("--only", default=None, metavar="NAMES",
                        help=f"comma-separated rows to time (default all): {', '.join(ROW_NAMES)}")
    args = parser.parse_args(argv)
    only = None if args.only is None else {n.strip() for n in args.only.split(",") if n.strip()}
    if only is not None and (not only or only - set(ROW_NAMES)):
        parser.error(f"--only {args.only!r}: unknown rows {sorted(only - set(ROW_NAMES)) or '(none given)'}; "
                     f"valid: {', '.join(ROW_NAMES)}")
    import torch

    sizes = Sizes(batch=args.batch or (2 if args.quick else 8), repeats=args.repeats or (1 if args.quick else 2),
                  pixels=args.pixels or (64 if args.quick else 512), tiny_clip=args.quick,
                  audio_seconds=0.25 if args.quick else 4.0)
    if sizes.batch < 1 or sizes.repeats < 1 or sizes.pixels < 32:
        raise SystemExit(f"--batch {sizes.batch} and --repeats {sizes.repeats} must be >= 1, --pixels "
                         f"{sizes.pixels} >= 32")
    with tempfile.TemporaryDirectory(prefix="flywheel-reward-costs-") as tmp:
        rows, extra = measure_rows(sizes, Path(tmp), only)
    result: dict = {"threads": torch.get_num_threads(), "batch": sizes.batch, "repeats": sizes.repeats,
                    "pixels": sizes.pixels, "quick": bool(args.quick)}
    for name, given, seconds in rows:
        result[f"{name}_s_per_image"] = seconds
        result[f"{name}_input"] = given
    result.update(extra)
    print_table([Column("scorer", 22, align="<"), Column("s/image", 11, ".4g"), Column("  input", 0, align="<")],
                [(name, seconds, "  " + given) for name, given, seconds in rows])
    for key, value in extra.items():
        if key.endswith("_skipped"):
            print(f"{key.removesuffix('_skipped')}: skipped, {value}")
    print(f"(hpsv3 is a tiny random config: the real Qwen2-VL-7B has {extra['hpsv3_real_over_tiny_params']:.3g}x "
          f"its parameters; {result['threads']} threads, batch {sizes.batch}, median of {sizes.repeats} calls)")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
