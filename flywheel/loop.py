"""Deprecated name of `flywheel.rollout_collector` (the rollout collector: it holds no training loop, which is
`flywheel.recipe.training_loop`). Kept importable for one release; `evaluate` is now `eval_samples`."""

import warnings

import flywheel.rollout_collector as _collector

warnings.warn("flywheel.loop is renamed flywheel.rollout_collector (and its evaluate is eval_samples); the old "
              "name goes in the next release", DeprecationWarning, stacklevel=2)

_RENAMED = {"evaluate": "eval_samples"}


def __getattr__(name: str):
    return getattr(_collector, _RENAMED.get(name, name))
