"""Seconds per image of in-process scorers on this machine: `python scripts/reward_costs.py [--batch 16]`.

The CLIP-family scorers are timed with randomly initialised models of the real
architectures (CLIP ViT-L/14 at 224 px, as PickScore and the LAION aesthetic
predictor use, and ViT-B/32): compute does not depend on the weights, and none
are downloaded. Each scorer is called once to warm up, then `--repeats` times;
the figure is the median call's seconds divided by the batch size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import rewards


def clip_folder(root: Path, large: bool) -> Path:
    """A random CLIP of the real size (ViT-L/14 text+vision when `large`, else ViT-B/32), saved as a local folder."""
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder = root / ("clip-l14" if large else "clip-b32")
    vocab = {t: i for i, t in enumerate(["<|startoftext|>", "<|endoftext|>"] + [chr(c) for c in range(97, 123)]
                                           + [chr(c) + "</w>" for c in range(97, 123)])}
    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  patch_size=14) if large else dict(patch_size=32)
    text = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12) if large else {}
    config = CLIPConfig(text_config=dict(vocab_size=len(vocab), bos_token_id=0, eos_token_id=1, pad_token_id=1, **text),
                        vision_config=dict(image_size=224, **vision), projection_dim=768 if large else 512)
    CLIPModel(config).eval().save_pretrained(folder)
    CLIPTokenizer(vocab=vocab, merges=[]).save_pretrained(folder)
    CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(folder)
    dim = config.projection_dim
    save_file({"layers.0.weight": torch.randn(1024, dim) * 0.01, "layers.0.bias": torch.zeros(1024),
               "layers.1.weight": torch.randn(1, 1024) * 0.01, "layers.1.bias": torch.zeros(1)},
              str(folder / "aesthetic_head.safetensors"))
    return folder


def seconds_per_image(scorer, images, prompts, repeats: int) -> float:
    """Median seconds per image of `repeats` calls after one warm-up call (printed as it is measured)."""
    scorer(images, prompts, [{}] * len(prompts))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        scorer(images, prompts, [{}] * len(prompts))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times) / len(prompts)
    print(f"{getattr(scorer, 'name', '?')}: {seconds:.4g} s/image", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    out = {"threads": torch.get_num_threads(), "batch": args.batch}
    digits = torch.rand(args.batch, 1, 8, 8)
    prompts = ["the digit 3"] * args.batch
    for name in ("digit_alignment", "jpeg_compressibility"):
        out[name] = seconds_per_image(rewards.get(name), digits, prompts, args.repeats)
    out["number_alignment"] = seconds_per_image(rewards.get("number_alignment"), torch.rand(args.batch, 1, 8, 16),
                                                ["the number 42"] * args.batch, args.repeats)
    images = torch.rand(args.batch, 3, 512, 512)
    out["jpeg_compressibility@512"] = seconds_per_image(rewards.get("jpeg_compressibility"), images, prompts,
                                                        args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        for large, names in ((False, ("clip_score",)), (True, ("pickscore", "aesthetic"))):
            folder = clip_folder(Path(tmp), large)
            for name in names:
                out[f"{name}@512 ({'ViT-L/14' if large else 'ViT-B/32'})"] = seconds_per_image(
                    rewards.get(name, path=str(folder)), images, ["a photo of a cat"] * args.batch, args.repeats)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
