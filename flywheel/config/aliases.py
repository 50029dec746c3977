"""The config keys renamed when the sections were given to their owners, and the aliases that keep the old
names working for one release.

Each old key is rewritten to its new one wherever a key is read (`--config` files, `key=value` on the command
line, `apply_overrides`, a run's saved config.yaml) when the config class has the new key and not the old one,
so a recipe that still defines the old name as its own field keeps it. The first use of an old key in a
process prints one warning line naming both; giving both names in one place (one file, or the command line)
with different values is a ConfigError naming both. A sub-key follows its key: `reward_args.pickscore.path`
becomes `reward.args.pickscore.path`.
"""

from __future__ import annotations

import os
import sys

# old dotted key -> new dotted key (docs/configuration.md prints this table; tests/test_config_docs.py checks it)
ALIASES: dict[str, str] = {
    "rewards": "reward.scorers",
    "rewards_mode": "reward.aggregation",
    "reward_timeout_s": "reward.timeout_s",
    "reward_budget_s": "reward.budget_s",
    "reward_modules": "reward.modules",
    "reward_args": "reward.args",
    "train.max_masked_steps": "reward.max_masked_steps",
    "train.adv_clip_max": "advantage.clip_max",
    "train.global_std": "advantage.global_std",
    "train.ema": "ema.enabled",
    "train.ema_decay": "ema.decay",
    "train.ema_start_step": "ema.start_step",
    "train.ema_update_every": "ema.update_every",
    "eval_every": "eval.every",
    "sampling.eval_seeds": "eval.seeds",
    "sampling.eval_steps": "eval.steps",
    "sampling.eval_guidance_scale": "eval.guidance_scale",
    "sampling.eval_cache_threshold": "eval.cache_threshold",
    "eval_judges": "eval.judges",
    "train.stop_on_hacking": "eval.stop_on_hacking",
    "async_rollouts": "rollout.asynchronous",
    "max_staleness": "rollout.max_staleness",
    "overlap_scoring": "rollout.overlap_scoring",
    "model.workflow": "workflow.name",
    "model.workflow_paths": "workflow.paths",
    "train.stage": "workflow.stage",
}

# The old keys whose warning this process has printed (one line per key per process).
_warned: set[str] = set()


def warn_renamed(old: str, new: str, source: str) -> None:
    """One warning line, the first time this process reads the old key `old` (an ALIASES key)."""
    if old in _warned:
        return
    _warned.add(old)
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":  # one line per launch, not per rank
        print(f"warning: config key {old!r} ({source}) is now {new!r}; the old name works until the next release",
              file=sys.stderr, flush=True)


def alias_of(key: str, has_key) -> tuple[str, str] | None:
    """(old, new) when dotted `key` starts with an old key (whole parts) that `has_key` says the config lacks
    while it has the new one; `has_key(dotted) -> bool` asks the config class."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        old = ".".join(parts[:n])
        new = ALIASES.get(old)
        if new is not None:
            if has_key(old) or not has_key(new):
                return None
            return old, ".".join([new, *parts[n:]])
    return None


class KeySource:
    """The keys one source (a file, the command line, one apply_overrides call) has set, by their real key:
    an old name and its new one set to different values there is a ConfigError naming both."""

    def __init__(self, source: str, once: bool = False):
        """`once`: the source is a file, where a key set twice to different values (nested and dotted,
        `train: {lr: ..}` and `train.lr: ..`) is an error too; on a command line the last one wins."""
        self.source, self.once = source, once
        self.given: dict[str, tuple[str, object]] = {}  # real key -> (the name it was given as, value)

    def record(self, key: str, name: str, value: object) -> None:
        from flywheel.config.parsing import ConfigError

        earlier = self.given.get(key)
        if earlier is not None and earlier[0] != name and earlier[1] != value:
            raise ConfigError(f"config keys {earlier[0]!r} and {name!r} ({self.source}) set the same key, {key!r} "
                              f"(one is its old name), to different values: {earlier[1]!r} and {value!r}; give it "
                              f"once, as {key!r}")
        if earlier is not None and self.once and earlier[1] != value:
            raise ConfigError(f"config key {key!r} is set twice {self.source}, to {earlier[1]!r} and {value!r} "
                              f"(nested under its section and as a dotted key?); give it once")
        self.given[key] = (name, value)



def renamed_flat_keys(flat: dict[str, object]) -> dict[str, object]:
    """A flat {dotted key: value} of a saved config (e.g. a run's config.yaml written before the rename) with
    its old key names as the new ones, in the same order, so that configs of both ages compare key by key."""
    out: dict[str, object] = {}
    for key, value in flat.items():
        parts = key.split(".")
        for n in range(len(parts), 0, -1):
            new = ALIASES.get(".".join(parts[:n]))
            if new is not None:
                key = ".".join([new, *parts[n:]])
                break
        out[key] = value
    return out
