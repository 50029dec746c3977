"""A sample grid with a judge's verdict drawn on every image.

Each image gets a frame in the verdict's colour, green where the judge sees
the class the prompt asked for, red where it sees another, grey where the
prompt names none, and a strip under it with a short label (for the digit
judge: the digit it sees and its probability). A saturated blob the reward
accepts shows up as a red cell in a row of green ones, which a bare grid of
8x8 samples does not make obvious. Pure PIL with its built-in font: nothing
is downloaded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from flywheel.runs.rundir import make_image_grid

AGREE = (0, 160, 0)
DISAGREE = (210, 0, 0)
NO_VERDICT = (128, 128, 128)
GAP = (40, 40, 40)  # between cells: darker than every frame colour, so frames stay distinct
LABEL_TEXT = (255, 255, 255)


def verdict_colour(agrees: bool | None) -> tuple[int, int, int]:
    """The frame colour of one verdict: AGREE, DISAGREE or NO_VERDICT (None)."""
    return NO_VERDICT if agrees is None else AGREE if agrees else DISAGREE


def make_verdict_grid(images: torch.Tensor | np.ndarray, agrees: Sequence[bool | None],
                      labels: Sequence[str] | None = None, nrow: int | None = None, upscale: int = 4,
                      border: int = 2, gap: int = 2) -> Image.Image:
    """An RGB grid of images [B, C, H, W] (in [0, 1], C = 1 or 3), each framed by its verdict.

    `agrees[i]`: True (green frame), False (red) or None (grey, no verdict).
    `labels[i]`: drawn in white on a strip of the frame colour under image i
    (None: no strip). `nrow` is the number of columns (default ceil(sqrt(B))).
    Layout, in pixels: a cell is the image upscaled (nearest) by `upscale`,
    framed by `border` on each side, plus the label strip of height L under
    it (L = the font's text height + 2, 0 without labels); cells are
    separated and surrounded by `gap` pixels of GAP. Cell i (row r, column k)
    has its top-left frame pixel at (gap + k·(W·upscale + 2·border + gap),
    gap + r·(H·upscale + 2·border + L + gap)).
    """
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[0] == 0:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a non-empty tensor [B, C, H, W], got {shape}")
    b, _, h, w = images.shape
    agrees = list(agrees)
    if len(agrees) != b:
        raise ValueError(f"got {b} images and {len(agrees)} verdicts; give one verdict (True/False/None) per image")
    for i, a in enumerate(agrees):
        if a is not None and not isinstance(a, (bool, np.bool_)):
            raise ValueError(f"agrees[{i}] = {a!r}; a verdict is True, False or None")
    if labels is not None:
        labels = [str(x) for x in labels]
        if len(labels) != b:
            raise ValueError(f"got {b} images and {len(labels)} labels; give one label per image or none")
    if upscale < 1 or border < 1 or gap < 0:
        raise ValueError(f"upscale and border must be >= 1 and gap >= 0, got upscale={upscale}, "
                         f"border={border}, gap={gap}")
    ncol = nrow if nrow is not None else math.ceil(math.sqrt(b))
    if ncol < 1:
        raise ValueError(f"nrow (columns) must be >= 1, got {nrow}")
    ncol = min(ncol, b)
    nrows = math.ceil(b / ncol)

    font = ImageFont.load_default()
    strip = 0
    if labels is not None:
        _, top, _, bottom = font.getbbox("0123456789.:%")
        strip = bottom - top + 2
    cell_w, cell_h = w * upscale + 2 * border, h * upscale + 2 * border + strip
    canvas = Image.new("RGB", (gap + ncol * (cell_w + gap), gap + nrows * (cell_h + gap)), GAP)
    for i in range(b):
        # Each cell is drawn on its own image, so a label wider than the cell is clipped, not spilled.
        cell = Image.new("RGB", (cell_w, cell_h), verdict_colour(agrees[i]))
        # make_image_grid of one image is the plain grid's value mapping (clamp, NaN -> 0, round) and upscale.
        cell.paste(make_image_grid(images[i:i + 1], nrow=1, upscale=upscale, padding=0).convert("RGB"),
                   (border, border))
        if labels is not None:
            ImageDraw.Draw(cell).text((border, 2 * border + h * upscale + 1 - top), labels[i], fill=LABEL_TEXT,
                                      font=font)
        r, k = divmod(i, ncol)
        canvas.paste(cell, (gap + k * (cell_w + gap), gap + r * (cell_h + gap)))
    return canvas


def judged_sample_grid(images: torch.Tensor, prompts: list[str], metadata: list[dict], judges: dict,
                       nrow: int | None = None) -> Image.Image:
    """The evaluation sample grid: framed by the verdicts of the first judge that gives them (`verdicts`),
    or the plain `make_image_grid` when none does (a task without a judge, or judges without verdicts)."""
    judge = next((j for j in judges.values() if callable(getattr(j, "verdicts", None))), None)
    if judge is None:
        return make_image_grid(images, nrow=nrow)
    verdicts = judge.verdicts(images, prompts, metadata)
    return make_verdict_grid(images, [v.agrees for v in verdicts], [v.label for v in verdicts], nrow=nrow)
