"""JPEG (in)compressibility scorers, as in DDPO: the size in kB of each image saved as JPEG at quality 95."""

from __future__ import annotations

import io

import torch
from PIL import Image

QUALITY = 95
_MODES = {1: "L", 3: "RGB"}


def jpeg_sizes_kb(images: torch.Tensor, quality: int = QUALITY) -> torch.Tensor:
    """Images [B, C, H, W] in [0, 1] (C = 1 or 3) -> float32 [B] JPEG size in kilobytes (1 kB = 1000 bytes)."""
    if images.ndim != 4 or images.shape[1] not in _MODES:
        raise ValueError(f"expected images [B, C, H, W] with C in {sorted(_MODES)}, got shape {tuple(images.shape)}")
    mode = _MODES[images.shape[1]]
    # One host transfer for the whole batch; PIL needs HWC uint8.
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        # 2-D uint8 -> "L", HxWx3 uint8 -> "RGB" (fromarray infers the mode).
        Image.fromarray(array[..., 0] if mode == "L" else array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility:
    """Scorer: minus the JPEG size in kB (smaller files score higher)."""

    name = "jpeg_compressibility"

    def __init__(self, quality: int = QUALITY):
        self.quality = quality

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host."""
        return -jpeg_sizes_kb(images, self.quality)


class JpegIncompressibility:
    """Scorer: the JPEG size in kB (larger files score higher)."""

    name = "jpeg_incompressibility"

    def __init__(self, quality: int = QUALITY):
        self.quality = quality

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host."""
        return jpeg_sizes_kb(images, self.quality)
