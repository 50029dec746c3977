"""Prompt datasets and a resumable, rank-independent prompt sampler.

A dataset is a list of `PromptItem`s: built-in names (`toy-digits`,
`toy-digits-heldout`, `toy-numbers`, `toy-numbers-heldout`) or a local file,
`.txt` (one prompt per line) or `.jsonl` (one object per line with a "prompt"
key; the other keys travel as metadata to the rewards, e.g. {"prompt": "a 7",
"digit": 7}).

An "image" key in a .jsonl row is the conditioning image of an image-to-video
card (its first frame): a path, relative paths taken from the .jsonl's own
folder. It is stored resolved in the item's metadata (the flywheel passes it on
as `GenerationRequest.image`), and every row's image must exist when the file is
loaded: the missing ones are named together, with their lines, before any work.

`toy-numbers` is the train numbers in the train phrasings; `toy-numbers-heldout`
is ten numbers, five of them never trained on, in held-out phrasings, number by
number (engine/toy/numbers.py).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path


MISSING_IMAGES_SHOWN = 10  # a dataset's missing images named in its error (the count covers all of them)
PROMPT_FILE_SUFFIXES = (".txt", ".jsonl")  # any other file would be read as lines of text: a .json array's
# brackets, a .csv's header, each a "prompt"; so it is refused by name


@dataclass(frozen=True)
class PromptItem:
    prompt: str
    metadata: dict = field(default_factory=dict, compare=False, hash=False)


def _toy(split: str) -> list[PromptItem]:
    from engine.toy.prompts import heldout_prompts, train_prompts

    pairs = train_prompts() if split == "train" else heldout_prompts()
    return [PromptItem(p, {"digit": d}) for p, d in pairs]


def _toy_numbers(split: str) -> list[PromptItem]:
    from engine.toy.numbers import heldout_number_prompts, number_digits, train_number_prompts

    pairs = train_number_prompts() if split == "train" else heldout_number_prompts()
    return [PromptItem(p, {"number": n, "digits": list(number_digits(n))}) for p, n in pairs]


BUILTIN_DATASETS = {
    "toy-digits": lambda: _toy("train"),
    "toy-digits-heldout": lambda: _toy("heldout"),
    "toy-numbers": lambda: _toy_numbers("train"),
    "toy-numbers-heldout": lambda: _toy_numbers("heldout"),
}


def load_prompts(source: str) -> list[PromptItem]:
    """A built-in dataset by name, or prompts read from a .txt / .jsonl file."""
    if source in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[source]()
    path = Path(source)
    if not str(source).strip() or not path.is_file():  # '' would be Path('.'), a directory
        raise FileNotFoundError(
            f"prompt dataset {source!r} is neither a built-in ({', '.join(BUILTIN_DATASETS)}) nor an existing file")
    if path.suffix.lower() not in PROMPT_FILE_SUFFIXES:
        raise ValueError(f"prompt file {path} has the suffix {path.suffix or '(none)'!r}; a prompt file is .txt (one "
                         f"prompt per line) or .jsonl (one JSON object per line with a \"prompt\" string)")
    items: list[PromptItem] = []
    missing_images: list[str] = []  # every missing image is named in one error, after the whole file is read
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM is dropped; universal newlines: \r\n, \r end lines too
    except UnicodeDecodeError as e:
        line_no = path.read_bytes()[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line_no}: not UTF-8 text (byte {e.object[e.start]:#04x}); a prompt file is "
                         f"UTF-8 .txt or .jsonl") from None
    for line_no, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        if path.suffix.lower() == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e}); each line must be a JSON object "
                                 f"with a \"prompt\" string") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                got = type(row).__name__ if not isinstance(row, dict) else f"prompt={row.get('prompt')!r}"
                raise ValueError(f"{path}:{line_no}: expected a JSON object with a non-empty \"prompt\" string, "
                                 f"got {got}")
            prompt = row.pop("prompt")
            if "image" in row:
                row["image"] = _image_path(path, line_no, row["image"], missing_images)
            items.append(PromptItem(prompt, row))
        else:
            items.append(PromptItem(line))
    if missing_images:
        shown = "; ".join(missing_images[:MISSING_IMAGES_SHOWN])
        more = len(missing_images) - MISSING_IMAGES_SHOWN
        raise FileNotFoundError(f"{path}: {len(missing_images)} image(s) not found (relative paths are read from "
                                f"{path.parent}): {shown}" + (f"; and {more} more" if more > 0 else ""))
    if not items:
        raise ValueError(f"prompt file {path} holds no prompts")
    return items


def _image_path(dataset: Path, line_no: int, value, missing: list[str]) -> str:
    """A row's "image" resolved against the dataset's folder; a missing file is noted in `missing`."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{dataset}:{line_no}: \"image\" must be a non-empty path string, got {value!r}")
    resolved = (dataset.parent / Path(value).expanduser()).resolve()
    if not resolved.is_file():
        missing.append(f"line {line_no}: {value!r}" + ("" if str(resolved) == value else f" ({resolved})"))
    return str(resolved)


class PromptSampler:
    """Which prompts a step uses: a fresh shuffle every epoch, a pure function of (seed, step).

    Because the choice depends only on the seed and the step, resuming at
    step s needs nothing but s, and every rank agrees on the global batch.
    """

    def __init__(self, items: list[PromptItem], prompts_per_step: int, seed: int = 0):
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        self.items = items
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            random.Random(f"prompts-{self.seed}-{epoch}").shuffle(order)
            self._orders = {epoch: order}  # only the current epoch is ever needed again
        return self._orders[epoch]

    def batch(self, step: int) -> list[PromptItem]:
        """The prompts of step `step` (0-based), in global order."""
        out = []
        for j in range(self.prompts_per_step):
            k = step * self.prompts_per_step + j
            epoch, pos = divmod(k, len(self.items))
            out.append(self.items[self._order(epoch)[pos]])
        return out

    def fingerprint(self) -> str:
        """sha256 of the prompts and their metadata, in file order (recorded in checkpoints: a resume on a
        prompts file whose content changed, same count or not, would train on other prompts than it says)."""
        digest = hashlib.sha256()
        for item in self.items:
            digest.update(json.dumps([item.prompt, item.metadata], sort_keys=True, default=str).encode())
            digest.update(b"\n")
        return digest.hexdigest()

    def position(self, step: int) -> dict[str, int]:
        """Where in the data a run is after `step` steps (recorded in checkpoints)."""
        consumed = step * self.prompts_per_step
        return {"epoch": consumed // len(self.items), "index_in_epoch": consumed % len(self.items)}
