"""Validation of a parsed config: every field checked before a run does any work, all problems in one error."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from flywheel.config.parsing import ConfigError



def config_value(cfg: Any, key: str) -> Any:
    """The value at a dotted key of a config dataclass ("train.learning_rate")."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def non_finite_fields(cfg: Any, prefix: str = "") -> list[str]:
    """Dotted keys of every float field (or float inside a tuple/list field) that is NaN or inf."""
    bad = []
    for name in (f.name for f in dataclasses.fields(cfg) if f.init):
        value, key = getattr(cfg, name), f"{prefix}{name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            bad += non_finite_fields(value, f"{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(key)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
            bad.append(key)
    return bad


class ConfigChecks:
    """Collects every problem of a config, then raises one ConfigError that lists them all.

        checks = ConfigChecks(cfg)
        checks.require("steps", lambda v: v >= 1, "a positive number of training steps")
        checks.raise_if_any()
    """

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._non_finite = non_finite_fields(cfg)
        self.problems = [f"{key}={config_value(cfg, key)}: must be a finite number" for key in self._non_finite]

    def require(self, key: str, ok: Callable[[Any], bool], valid: str, allow_none: bool = False) -> None:
        """Record `key` as invalid unless `ok(value)` (None passes when `allow_none`); `valid` says what is."""
        value = config_value(self.cfg, key)
        if (value is None and allow_none) or key in self._non_finite:  # a non-finite value is reported once
            return
        try:
            good = value is not None and bool(ok(value))
        except (TypeError, ValueError):
            good = False
        if not good:
            self.problems.append(f"{key}={value!r}: {valid}")

    def fail(self, message: str) -> None:
        """Record a problem that spans several keys (the message names them)."""
        self.problems.append(message)

    def raise_if_any(self) -> None:
        if self.problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(self.problems))
