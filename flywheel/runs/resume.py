"""Resuming a run: its saved config as the base, the keys a resume may change, and the record of each change.

    cfg = resume_config(Config, argv, resume="runs/x", recipe="grpo")   # refuses before anything runs
    changes = resume_changes(cfg)                                      # {key: (was, now)} against config.yaml
    record_resume(cfg, step, changes)                                  # config.yaml: new values + the history

A resume continues the run that its directory holds, so its config.yaml is
the config. A key given on the command line (or in a `--config` file) with
`resume=` is compared with the run's value: an equal one changes nothing (the
original command with `resume=` appended resumes), a different one must be
one of `RESUMABLE_KEYS` or the resume is refused with a message naming it.
A change takes effect and is recorded in config.yaml: the values are updated
and the top-level `resume_overrides` list gets one entry per resume that
changed something (`at_step`, `set`, `was`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from flywheel.runs.checkpoint import CheckpointError, checkpoint_step, resolve_resume
from flywheel.config.parsing import (
    RESUME_HISTORY_KEY,
    ConfigError,
    apply_config_files,
    apply_overrides,
    config_to_dict,
    load_config,
    save_config,
    split_argv,
)
from flywheel.runs.rundir import CONFIG_FILENAME, RUN_INFO_FILENAME

# The keys a resume may change, and why each is safe to: the others are the run's (its model, data, sampling,
# rewards and algorithm), and changing one half-way would make one run out of two different ones.
RESUMABLE_KEYS = {
    "steps": "train further, or stop earlier (not before the checkpoint's step)",
    "eval.every": "evaluation cadence: which steps are measured, not what is trained",
    "sample_every": "sample-grid cadence",
    "save_every": "checkpoint cadence",
    "keep_checkpoints": "checkpoints kept on disk",
    "tracker": "where the metrics are sent (metrics.jsonl is written either way)",
    "project": "the tracker's project name",
    "reward.timeout_s": "remote rewards' bound of one call: how long to wait, not what is scored",
    "reward.budget_s": "remote rewards' bound of all retries of one batch",
    "rollout.call_timeout_s": "how long an engine process or a Ray actor is waited for, not what it computes: "
                              "the remedy for a run its video model's rollouts timed out",
    "rollout.start_timeout_s": "how long an engine process or Ray actors are waited for at the start",
    "train.learning_rate": "set on the optimizer after the checkpoint's AdamW state is loaded (its moments kept); "
                           "the usual remedy for a run that grows unstable",
    "ema.enabled": "false drops the checkpoint's average, with a warning; true needs a checkpoint that holds one",
}
# Keys that name the run rather than configure it: never compared.
_RUN_IDENTITY = ("resume", "overwrite", "run_dir")


class ResumeError(ConfigError):
    """A resume that cannot go ahead (no checkpoint, another recipe's run, a key that may not change)."""


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {dotted key: value} (lists stay whole values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(before: dict, after: dict) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (before, after)} for every key whose value differs (the run's identity keys left out)."""
    old, new = flat_config(before), flat_config(after)
    return {key: (old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys())
            if key not in _RUN_IDENTITY and old.get(key) != new.get(key)}


def _resolve(resume: str) -> tuple[Path, Path]:
    try:
        return resolve_resume(resume)
    except (FileNotFoundError, CheckpointError) as e:
        raise ResumeError(" ".join(str(e).split())) from None  # one line: the CLI prints it alone


def run_recipe(run_dir: Path) -> str | None:
    """The recipe that trained a run, from its run.json (None for a run without one)."""
    try:
        return json.loads((Path(run_dir) / RUN_INFO_FILENAME).read_text(encoding="utf-8")).get("recipe")
    except (OSError, ValueError, AttributeError):
        return None


def resume_config(config_class: type, argv: list[str], resume: str, recipe: str | None = None):
    """The config of `resume=`: the run's config.yaml, with the command line's keys that may change applied.

    Raises ResumeError (a ConfigError: one line, exit 2) before anything runs: for a run without a
    checkpoint, a run of another recipe (`recipe` against its run.json), a key that may not change on resume
    (named, with both values), or `steps` before the checkpoint's step.
    """
    run_dir, ckpt = _resolve(resume)
    trained_by = run_recipe(run_dir)
    if recipe is not None and trained_by is not None and trained_by != recipe:
        raise ResumeError(f"resume={resume}: that run was trained by the {trained_by} recipe (its {RUN_INFO_FILENAME})"
                          f" and this is the {recipe} recipe; resume it with trainers/{trained_by}.py, or start a "
                          f"fresh {recipe} run in another run_dir")
    try:
        saved = load_config(config_class, run_dir / CONFIG_FILENAME)
    except ConfigError as e:
        raise ResumeError(f"resume={resume}: {run_dir / CONFIG_FILENAME} does not fit this recipe's config"
                          f"{f' (the run was trained by the {trained_by} recipe)' if trained_by else ''}: {e}") from None
    config_files, overrides = split_argv(argv)
    cfg = apply_overrides(apply_config_files(saved, config_files), overrides)
    if Path(cfg.run_dir).resolve() != Path(run_dir).resolve() and cfg.run_dir != saved.run_dir:
        print(f"warning: run_dir={cfg.run_dir} is not used: resume={resume} continues the run in {run_dir}",
              file=sys.stderr, flush=True)
    changes = config_changes(config_to_dict(saved), config_to_dict(cfg))
    refused = [key for key in changes if key not in RESUMABLE_KEYS]
    if refused:
        listed = "; ".join(f"{key} (the run has {changes[key][0]!r}, given {changes[key][1]!r})" for key in refused)
        raise ResumeError(f"resume={resume}: {listed}: {'this key' if len(refused) == 1 else 'these keys'} cannot "
                          f"change on resume. The keys that may: {', '.join(RESUMABLE_KEYS)}. To change "
                          f"{'it' if len(refused) == 1 else 'them'}, start a fresh run (another run_dir, or "
                          "overwrite=true)")
    at = checkpoint_step(ckpt)
    if at is not None and cfg.steps < at:
        raise ResumeError(f"resume={resume}: steps={cfg.steps} is before the checkpoint's step {at} ({ckpt}); "
                          f"give steps >= {at}")
    cfg.run_dir, cfg.resume, cfg.overwrite = str(run_dir), str(ckpt), False
    return cfg


def _saved_yaml(run_dir: Path) -> dict:
    data = yaml.safe_load((Path(run_dir) / CONFIG_FILENAME).read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def resume_changes(cfg) -> dict[str, tuple[Any, Any]]:
    """What a resumed config changes against its run's config.yaml: {dotted key: (was, now)}."""
    saved = load_config(type(cfg), Path(cfg.run_dir) / CONFIG_FILENAME)
    return config_changes(config_to_dict(saved), config_to_dict(cfg))


def record_resume(cfg, step: int, changes: dict[str, tuple[Any, Any]]) -> Path:
    """Rewrite config.yaml with the resumed config's values and one more `resume_overrides` entry.

    The run's identity keys (run_dir, resume, overwrite) keep their saved values, so config.yaml still reads
    as the command that started the run, plus what each resume changed and at which step.
    """
    path = Path(cfg.run_dir) / CONFIG_FILENAME
    saved = _saved_yaml(Path(cfg.run_dir))
    data = config_to_dict(cfg)
    for key in _RUN_IDENTITY:
        if key in saved:
            data[key] = saved[key]
    history = list(saved.get(RESUME_HISTORY_KEY) or [])
    history.append({"at_step": step, "set": {k: now for k, (_, now) in changes.items()},
                    "was": {k: was for k, (was, _) in changes.items()}})
    data[RESUME_HISTORY_KEY] = history
    return save_config(data, path)
