"""Rewards: the scorer protocol, `RewardBatch`, built-in scorers, the registry and their combination.

Importing this package constructs no scorer and loads no weights; `build(spec)`
or `get(name)` does.
"""

from __future__ import annotations

from rewards.combine import RewardSet
from rewards.registry import available, get, parse_spec, register
from rewards.types import RewardBatch, Scorer


def build(spec: str | dict | list, **kwargs) -> RewardSet:
    """The `RewardSet` of a spec such as "digit_alignment:1.0,jpeg_compressibility:0.1"."""
    return RewardSet(spec, **kwargs)


__all__ = ["RewardBatch", "RewardSet", "Scorer", "available", "build", "get", "parse_spec", "register"]
