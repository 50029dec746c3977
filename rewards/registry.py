"""Reward registry: scorer factories by name, and parsing of reward specs like "a:1.0,b:0.1"."""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable

from rewards.types import Scorer

ScorerFactory = Callable[..., Scorer]

_FACTORIES: dict[str, ScorerFactory] = {}


def register(name: str, factory: ScorerFactory | None = None, *, replace: bool = False):
    """Register a scorer factory under `name`; without `factory`, returns a decorator."""
    if not isinstance(name, str) or not name.strip() or any(c in name for c in ",: \t"):
        raise ValueError(f"scorer name {name!r} is not valid: use a non-empty name without ',', ':' or spaces")

    def _add(f: ScorerFactory) -> ScorerFactory:
        if not callable(f):
            raise TypeError(f"factory for {name!r} must be callable, got {type(f).__name__}")
        # Re-registering the same object is harmless (module reloads); a different one is a clash.
        if name in _FACTORIES and _FACTORIES[name] is not f and not replace:
            raise ValueError(f"scorer {name!r} is already registered; pass replace=True to override it")
        _FACTORIES[name] = f
        return f

    return _add if factory is None else _add(factory)


def unregister(name: str) -> None:
    """Remove a registered scorer (plugins and tests that register temporary ones)."""
    _FACTORIES.pop(name, None)


def available() -> list[str]:
    """Names of all registered scorers, sorted."""
    return sorted(_FACTORIES)


REMOTE = "remote:"  # "remote:<url>" names a scorer served by `python -m rewards.serve` at that address


def get(name: str, **kwargs: Any) -> Scorer:
    """Construct the scorer registered as `name` (or the client of `remote:<url>`), passing `kwargs`."""
    if name.startswith(REMOTE):
        from rewards.remote import RemoteScorer

        return RemoteScorer(name[len(REMOTE):], **kwargs)
    if name not in _FACTORIES:
        raise KeyError(f"unknown scorer {name!r}; known scorers: {', '.join(available()) or '(none)'}")
    return _FACTORIES[name](**kwargs)


def _weight(value: Any, where: str) -> float:
    """A finite float weight; `where` names the spec entry for the error message."""
    if value is None:  # YAML `name:` with nothing after it: same as a bare name.
        return 1.0
    if isinstance(value, bool):
        raise ValueError(f"bad weight {value!r} in reward spec entry {where!r}: expected a number")
    try:
        w = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"bad weight {value!r} in reward spec entry {where!r}: expected a number") from None
    if not math.isfinite(w):
        raise ValueError(f"bad weight {value!r} in reward spec entry {where!r}: must be finite")
    return w


def _name(value: Any, where: str) -> str:
    """A stripped, non-empty scorer name."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"reward spec entry {where!r} needs a non-empty scorer name, got {value!r}")
    return value.strip()


def _split_remote(text: str) -> tuple[str, float]:
    """A "remote:<url>[:weight]" entry: the weight is a trailing ":<number>" after the URL's port.

    "remote:http://h:8100" has no weight (8100 is the port); "remote:http://h:8100:0.5"
    and "remote:http://h:8100/score:0.5" have weight 0.5. A URL without an explicit port
    cannot carry a weight in a string spec; use the dict/YAML form {"remote:http://h": 0.5}.
    """
    from urllib.parse import urlsplit

    entry = text.strip()
    head, sep, tail = entry.rpartition(":")
    try:
        # A trailing ":number" inside the path (".../score:0.5") is a weight too: paths have no colons here.
        whole_is_url = ":" not in urlsplit(entry[len(REMOTE):]).path
        urlsplit(entry[len(REMOTE):]).port  # noqa: B018
    except ValueError:
        whole_is_url = False
    if sep and not whole_is_url and head != REMOTE.rstrip(":"):
        return head, _weight(tail.strip(), entry)
    if entry == REMOTE or "//" not in entry:
        raise ValueError(f"reward spec entry {entry!r} needs an address: 'remote:http://host:port[:weight]'")
    return entry, 1.0


def _parse_entry(text: str) -> tuple[str, float]:
    """One "name" or "name:weight" entry of a string spec (or "remote:<url>[:weight]")."""
    if text.strip().startswith(REMOTE):
        return _split_remote(text)
    parts = text.split(":")
    if len(parts) > 2:
        raise ValueError(f"reward spec entry {text.strip()!r} has more than one ':'; expected 'name' or 'name:weight'")
    name = _name(parts[0], text.strip())
    return name, (_weight(parts[1].strip(), text.strip()) if len(parts) == 2 else 1.0)


def parse_spec(spec: str | dict | list | tuple) -> list[tuple[str, float]]:
    """Parse a reward spec into (name, weight) pairs; a name without a weight gets 1.0.

    Accepts "a:1.0, b:0.1", a dict {name: weight}, or a list of (name, weight)
    pairs or "name[:weight]" strings (the forms a YAML config produces).
    """
    if isinstance(spec, str):
        if not spec.strip():
            raise ValueError("reward spec is empty; expected e.g. 'digit_alignment:1.0,jpeg_compressibility:0.1'")
        pairs = []
        for i, part in enumerate(spec.split(",")):
            if not part.strip():
                raise ValueError(f"reward spec {spec!r} has an empty entry at position {i}")
            pairs.append(_parse_entry(part))
    elif isinstance(spec, dict):
        pairs = [(_name(k, str(k)), _weight(v, f"{k}: {v}")) for k, v in spec.items()]
    elif isinstance(spec, (list, tuple)):
        pairs = []
        for item in spec:
            if isinstance(item, str):
                pairs.append(_parse_entry(item))
            elif isinstance(item, (list, tuple)) and len(item) == 2:
                pairs.append((_name(item[0], str(item)), _weight(item[1], str(item))))
            else:
                raise ValueError(f"reward spec entry {item!r} is not valid; expected 'name[:weight]' or (name, weight)")
    else:
        raise ValueError(f"reward spec must be a string, dict or list, got {type(spec).__name__}")
    if not pairs:
        raise ValueError("reward spec is empty; expected at least one scorer name")
    names = [n for n, _ in pairs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"reward spec names a scorer more than once: {', '.join(dupes)}")
    return pairs


def _lazy(module: str, attr: str) -> ScorerFactory:
    """A factory that imports `module.attr` only when called, so importing `rewards` loads no weights."""

    def factory(**kwargs: Any) -> Scorer:
        return getattr(importlib.import_module(module), attr)(**kwargs)

    factory.__qualname__ = f"lazy({module}.{attr})"
    return factory


register("digit_alignment", _lazy("rewards.digits", "DigitAlignment"))
register("number_alignment", _lazy("rewards.digits", "NumberAlignment"))
register("jpeg_compressibility", _lazy("rewards.jpeg", "JpegCompressibility"))
register("jpeg_incompressibility", _lazy("rewards.jpeg", "JpegIncompressibility"))
register("ocr", _lazy("rewards.ocr", "OcrReward"))
register("clip_score", _lazy("rewards.clip", "ClipScore"))
register("pickscore", _lazy("rewards.clip", "PickScore"))
register("aesthetic", _lazy("rewards.clip", "Aesthetic"))
register("audio_loudness", _lazy("rewards.audio", "AudioLoudness"))
register("av_onset_sync", _lazy("rewards.audio", "AvOnsetSync"))
register("vlm_judge", _lazy("rewards.vlm_judge", "VlmJudge"))
register("clip_score_video", _lazy("rewards.video", "clip_score_video"))
register("pickscore_video", _lazy("rewards.video", "pickscore_video"))
register("aesthetic_video", _lazy("rewards.video", "aesthetic_video"))
register("hpsv3", _lazy("rewards.hpsv3", "HPSv3"))
