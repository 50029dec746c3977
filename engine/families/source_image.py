"""Reading the source image of an editing request (GenerationRequest.image), shared by the editing cards."""

from __future__ import annotations

from pathlib import Path


def load_source_image(path: str, card_id: str):
    """The RGB PIL image at a local path (EXIF rotation applied, as diffusers' load_image does).

    A missing file or one PIL cannot read is an error naming the card and the path.
    """
    from diffusers.utils import load_image

    if not Path(path).is_file():
        raise FileNotFoundError(f"{card_id}: the source image {path!r} does not exist (GenerationRequest.image "
                                f"must be a local image file)")
    try:
        return load_image(str(path))
    except Exception as e:  # PIL raises several kinds for a file that is not an image
        raise ValueError(f"{card_id}: cannot read the source image {path!r} as an image ({e})") from None


def distinct_rows(paths: list[str]) -> tuple[list[str], list[int]]:
    """The distinct paths in first-seen order, and each row's index into them (a GRPO group shares its image:
    it is encoded once per batch)."""
    distinct = list(dict.fromkeys(paths))
    row_of = {path: i for i, path in enumerate(distinct)}
    return distinct, [row_of[path] for path in paths]
