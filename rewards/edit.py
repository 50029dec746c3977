"""Editing rewards: how much of the source image an edit keeps, and whether it follows the instruction.

An editing rollout's source image reaches the scorers in its row's metadata:
`metadata[i]["image"]`, the local path its dataset row (`{"prompt": ...,
"image": "path.png"}`) or request named (the engine writes each request's
image into its trajectory row's metadata, and the training loop scores with
it). A path rather than a tensor, so the metadata stays JSON for logs and
remote scorers (which must see the same file system).

- `edit_consistency`: cosine similarity of the CLIP image embeddings of the
  source and the output, in [-1, 1] (1: CLIP sees the same image). The
  source goes through the same preprocessing as the output (shorter side
  resized, centre crop), from its own size.
- `edit_instruction_clip`: CLIP's text-image cosine similarity of the output
  and the instruction, the standing-in instruction-following score until a
  VLM judge reads both images (`vlm_judge` with `source_image=true` does).
  Instructions are phrased as changes ("make it red"), not captions, so it
  is a weak signal; pair it with `edit_consistency`, which penalises
  ignoring the source.

Both load CLIP from a local folder (`path=`, or FLYWHEEL_CLIP_PATH), as
`clip_score` does.
"""

from __future__ import annotations

import numpy as np
import torch

from rewards.clip import _ClipBase

SOURCE_KEY = "image"  # the metadata key holding a row's source image path
SOURCE_CACHE = 1024  # source embeddings kept per scorer (a dataset's images recur every epoch)


def source_paths(metadata: list[dict], scorer: str) -> list[str]:
    """Each row's source image path; a row without one is an error naming the scorer and the row."""
    missing = [i for i, m in enumerate(metadata) if not isinstance(m.get(SOURCE_KEY), str)]
    if missing:
        raise ValueError(f"reward {scorer!r} scores edits against their source image, but row(s) "
                         f"{', '.join(map(str, missing[:10]))} have no metadata[{SOURCE_KEY!r}] path; use an "
                         f"editing card with a .jsonl dataset whose rows are {{\"prompt\": ..., \"image\": \"path.png\"}}")
    return [m[SOURCE_KEY] for m in metadata]


def read_image(path: str, scorer: str) -> torch.Tensor:
    """An image file as [1, 3, H, W] float in [0, 1] (EXIF rotation applied, RGB)."""
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as im:
            rgb = ImageOps.exif_transpose(im).convert("RGB")
    except (OSError, ValueError) as e:
        raise ValueError(f"reward {scorer!r}: cannot read the source image {path!r} ({e})") from None
    return torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]


class EditConsistency(_ClipBase):
    """Scorer: CLIP image-image cosine similarity of each output and its source image (in [-1, 1])."""

    env = "FLYWHEEL_CLIP_PATH"
    name = "edit_consistency"
    output_range = (-1.0, 1.0)  # a cosine

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sources: dict[str, torch.Tensor] = {}

    def source_embeds(self, paths: list[str]) -> torch.Tensor:
        """L2-normalised embeddings [B, D] of the source images, each file embedded once."""
        for path in dict.fromkeys(paths):
            if path not in self._sources:
                if len(self._sources) >= SOURCE_CACHE:
                    self._sources.pop(next(iter(self._sources)))
                self._sources[path] = self.image_embeds(read_image(path, self.name))[0]
        return torch.stack([self._sources[p] for p in paths])

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host."""
        sources = self.source_embeds(source_paths(metadata, self.name))
        return (self.image_embeds(images) * sources).sum(-1).cpu()


class EditInstructionClip(_ClipBase):
    """Scorer: CLIP text-image cosine similarity of each output and its edit instruction (in [-1, 1]); the
    source image must be given (it is an editing reward), though only the output is scored."""

    env = "FLYWHEEL_CLIP_PATH"
    name = "edit_instruction_clip"
    output_range = (-1.0, 1.0)  # a cosine

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host."""
        source_paths(metadata, self.name)
        return (self.image_embeds(images) * self.text_embeds(prompts)).sum(-1).cpu()
