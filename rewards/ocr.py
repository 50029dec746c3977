"""`ocr`: how well an image spells the quoted text of its prompt, read by RapidOCR on onnxruntime.

Score (as in Flow-GRPO): 1 - min(edit_distance, len(target)) / len(target),
comparing lower-cased text with whitespace removed; 1.0 when the target occurs
in what was read. RapidOCR's ONNX models ship inside its wheel; the scorer
points RapidOCR at those files explicitly, so nothing is ever downloaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from rapidfuzz.distance import Levenshtein

_QUOTED = re.compile(r"[\"“”‘’']([^\"“”‘’']+)[\"“”‘’']")


def target_text(prompt: str, metadata: dict | None = None) -> str | None:
    """The text an image should show: metadata["text"], else the first quoted span of the prompt."""
    if metadata and isinstance(metadata.get("text"), str):
        return metadata["text"]
    match = re.search(r'"([^"]+)"', prompt) or _QUOTED.search(prompt)
    return match.group(1) if match else None


def _normalise(text: str) -> str:
    return "".join(text.split()).lower()


def ocr_score(read: str, target: str) -> float:
    """1 - min(edit distance, len) / len between what was read and the target (normalised)."""
    read, target = _normalise(read), _normalise(target)
    if not target:
        return float("nan")
    if target in read:
        return 1.0
    return 1.0 - min(Levenshtein.distance(read, target), len(target)) / len(target)


def _model_files() -> dict[str, Path]:
    """The detection, orientation and recognition models bundled in the rapidocr wheel."""
    import rapidocr

    root = Path(rapidocr.__file__).parent / "models"
    found = {kind: sorted(root.glob(pattern)) for kind, pattern in
             (("det", "*det*.onnx"), ("cls", "*cls*.onnx"), ("rec", "*rec*.onnx"))}
    missing = [kind for kind, paths in found.items() if not paths]
    if missing:
        raise FileNotFoundError(f"rapidocr's bundled models are missing ({', '.join(missing)}) under {root}; "
                                "reinstall rapidocr (its wheel ships det, cls and rec .onnx files)")
    return {kind: paths[0] for kind, paths in found.items()}


def _to_uint8_rgb(images: torch.Tensor) -> np.ndarray:
    """Images [B, C, H, W] in [0, 1] -> uint8 [B, H, W, 3] on the host, in one transfer."""
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"expected images [B, C, H, W] with C in (1, 3), got shape {tuple(images.shape)}")
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    if pixels.shape[1] == 1:
        pixels = pixels.expand(-1, 3, -1, -1)
    return pixels.permute(0, 2, 3, 1).contiguous().cpu().numpy()


class OcrReward:
    """Scorer: does the image spell its prompt's quoted text? Rows without quoted text are NaN (masked)."""

    name = "ocr"
    output_range = (0.0, 1.0)  # 1 - normalised edit distance
    prompt_needs = 'text to spell, quoted in the prompt (a sign that says "HELLO") or as metadata "text"'

    @staticmethod
    def scored_rows(prompts: list[str], metadata: list[dict]) -> list[bool]:
        """Which rows give a text to read (the others score NaN: masked), checked before a run starts."""
        return [bool(target_text(p, m)) for p, m in zip(prompts, metadata)]

    def __init__(self, detect: bool = True, det_side_len: int = 960, min_text_score: float = 0.5,
                 threads: int = -1):
        """`detect=False` reads each whole image as one text line (fast; for images that are just text)."""
        from rapidocr import RapidOCR

        files = _model_files()
        self.detect, self.min_text_score = detect, min_text_score
        self.engine = RapidOCR(params={
            "Global.log_level": "error",
            "Det.model_path": str(files["det"]), "Cls.model_path": str(files["cls"]),
            "Rec.model_path": str(files["rec"]),
            # RapidOCR's default upscales the *shorter* side to 736 px, which makes detection
            # take seconds per image; bounding the longer side is PaddleOCR's usual choice.
            "Det.limit_type": "max", "Det.limit_side_len": det_side_len,
            "EngineConfig.onnxruntime.intra_op_num_threads": threads,
        })

    def _crops(self, image: np.ndarray) -> list[np.ndarray]:
        """Text-line crops of one image, upright (detection + orientation); [] when no text is found."""
        from rapidocr.main import RapidOCRError

        try:
            img, record = self.engine.preprocess_img(image)
            crops, _ = self.engine.detect_and_crop(img, record)
            crops, _ = self.engine.cls_and_rotate(crops)
        except RapidOCRError:
            return []
        return list(crops)

    def read(self, images: torch.Tensor) -> list[str]:
        """The text read in each image; every text line of the batch goes through one batched recognition."""
        arrays = _to_uint8_rgb(images)
        crops = [self._crops(a) for a in arrays] if self.detect else [[a] for a in arrays]
        flat = [c for per_image in crops for c in per_image]
        if not flat:
            return ["" for _ in crops]
        result = self.engine.recognize_txt(flat)
        texts = [t if s >= self.min_text_score else "" for t, s in zip(result.txts, result.scores)]
        out, start = [], 0
        for per_image in crops:
            out.append(" ".join(t for t in texts[start:start + len(per_image)] if t))
            start += len(per_image)
        return out

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 in [0, 1]; NaN where the prompt quotes no text."""
        targets = [target_text(p, m) for p, m in zip(prompts, metadata)]
        wanted = [i for i, t in enumerate(targets) if t]
        scores = torch.full((len(prompts),), float("nan"))
        if wanted:
            read = self.read(images[wanted])
            for i, text in zip(wanted, read):
                scores[i] = ocr_score(text, targets[i])
        return scores
