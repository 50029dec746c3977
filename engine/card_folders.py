"""Whether a weights path fits a card, from its files alone (nothing loaded): for the checks that run before
any work (a training config, a server's flags), so a wrong folder is one line and not a traceback from
diffusers after minutes of loading."""

from __future__ import annotations

import json
from pathlib import Path

from engine.cards import get_card, list_cards
from engine.families.common import diffusers_folder_problems


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_card_path(card_id: str, path: str | None) -> None:
    """Raise ValueError (a sentence about the path) when `path` cannot be card `card_id`'s weights.

    Built-in cards: None (the shipped weights), or a file or folder that exists. Diffusers cards: a folder
    whose model_index.json names the card's pipeline (a FLUX folder given to the sd3 card names the card
    that loads it), with every component it lists, and a transformer config of the class it lists.
    KeyError for an unknown card.
    """
    card = get_card(card_id)
    if path is not None and not str(path).strip():
        raise ValueError("is empty: give a local weights folder, or null for the weights the project ships "
                         "(toy cards only)")
    pipeline = card.defaults.get("diffusers_pipeline")
    if pipeline is None:  # a built-in card: its shipped weights, or a file or folder of them
        if path is not None and not Path(path).expanduser().exists():
            raise ValueError(f"does not exist (card {card_id!r}: a weights file or a folder holding it, or null "
                             "for the shipped weights)")
        from engine.toy.card import SPECS, weights_file_problem, weights_path  # the file the toy loader would open

        spec = SPECS.get(card_id)
        if spec is None or path is None:
            return
        folder = Path(path).expanduser()
        file = weights_path(spec, folder)
        if not file.is_file():
            raise ValueError((f"is a folder without {spec.weights_file}" if folder.is_dir() else "is not a regular file")
                             + f" (card {card_id!r}: a weights file or a folder holding it, or null for the shipped "
                             "weights)")
        problem = weights_file_problem(spec, file)
        if problem is not None:
            raise ValueError(f"cannot be loaded: {file.name} is {problem}" if problem.startswith("not a ")
                             else f"cannot be loaded: {file.name}: {problem}")
        return
    if path is None:
        raise ValueError(f"is not set: card {card_id!r} loads a local diffusers folder of a {pipeline} "
                         "(model_index.json and its components); nothing is downloaded")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"is not a folder: card {card_id!r} loads a local diffusers folder of a {pipeline}")
    index = _read_json(root / "model_index.json")
    if index is None:
        raise ValueError(f"is not a diffusers folder: no readable model_index.json (card {card_id!r} loads a "
                         f"{pipeline} folder)")
    found = index.get("_class_name")
    if found != pipeline:
        fits = [c for c in list_cards() if get_card(c).defaults.get("diffusers_pipeline") == found]
        raise ValueError(f"holds a {found} (model_index.json) but card {card_id!r} loads a {pipeline}"
                         + (f": use the card {fits[0]!r}" if fits else ": give a folder of that family"))
    missing = [name for name, entry in index.items() if not name.startswith("_") and isinstance(entry, list)
               and entry and entry[0] is not None and not (root / name).is_dir()]
    if missing:
        raise ValueError(f"lacks {', '.join(missing)}/, listed in its model_index.json")
    expected = (index.get("transformer") or [None, None])[-1]
    transformer = _read_json(root / "transformer" / "config.json")
    if expected and transformer is not None and transformer.get("_class_name") != expected:
        raise ValueError(f"transformer/config.json is a {transformer.get('_class_name')}, but model_index.json "
                         f"lists a {expected}")
    # Each listed component's own files: a folder without its weights (a download stopped half-way, a
    # `git clone` without LFS) would otherwise fail in diffusers after the other components have loaded.
    components = {name: component_kind(entry[-1]) for name, entry in index.items()
                  if not name.startswith("_") and isinstance(entry, list) and entry and entry[0] is not None}
    problems = diffusers_folder_problems(root, components)
    if problems:
        raise ValueError("is incomplete: " + "; ".join(problems))


def component_kind(class_name: str | None) -> str:
    """The kind of files a model_index.json entry's folder holds, from its class name (see
    `engine.families.common.diffusers_folder_problems`): a scheduler's config, a tokenizer's files, a processor's
    config, else a model's config and weights."""
    name = class_name or ""
    if name.endswith("Scheduler"):
        return "scheduler"
    if "Tokenizer" in name:
        return "tokenizer"
    if "Processor" in name or "FeatureExtractor" in name:
        return "processor"
    return "model"
