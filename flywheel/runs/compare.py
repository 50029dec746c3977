"""Reading run directories to compare runs: per-run summaries, a text table, and a plot.

This is what `python -m flywheel.runs compare` and `list` are made of (see
`flywheel.runs.__main__`). Every recipe writes the same run directory (see
`flywheel.runs.rundir`) and the same metric keys, so runs of different
algorithms are read the same way:

- `config.yaml`: the recipe's config (`steps` = training steps configured,
  `model.card` = the model card);
- `run.json` (newer runs): `{"recipe": ..., "card": ...}`;
- `metrics.jsonl`: one row a step; eval rows carry `eval/reward/mean` and
  `eval/judge/<judge>/mean`; newer rows carry `time/wall_s` (seconds since the
  run started, continued across resumes), older ones only `time/step_s`.

Older runs without run.json show recipe "?"; their wall time is the running
sum of `time/step_s`. A run still in progress is read as far as it got.

A metric a run did not measure is left out for that run (not plotted, "-" in
the table). Recipes log only what they measure; older runs of NFT, AWM and
GRPO (`train.log_kl=false`) wrote `kl` as 0.0 with no reference model to
measure it against, and `kl_placeholder` recognises those from the config.

Two distances to the reference are kept apart: `kl`, GRPO's Gaussian KL of
the per-step transitions, and `ref_mse`, the velocity MSE that NFT, AWM and
DPO measure (a different quantity on another scale). Each has its own column
in the summary and its own panel in the plot. Runs of those three recipes
written before `ref_mse` had its name logged it as `kl`; they are read as
`ref_mse` (`Run.ref_mse_key`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from flywheel.config.aliases import renamed_flat_keys
from flywheel.runs.rundir import CONFIG_FILENAME, METRICS_FILENAME, atomic_write_bytes, atomic_write_text, read_metrics

RUN_INFO_FILENAME = "run.json"
UNKNOWN = "?"  # recipe or card of a run that does not say
REWARD_KEY = "eval/reward/mean"
KL_KEY = "kl"  # GRPO's Gaussian KL to the reference
REF_MSE_KEY = "ref_mse"  # the velocity MSE to the reference of NFT, AWM, DPO and DRaFT
# The recipes whose distance to the reference is a velocity MSE: their older runs logged it as `kl`.
VELOCITY_MSE_RECIPES = ("nft", "awm", "dpo", "draft")
# Diversity of the eval samples where the recipe logs it, else of the training rollouts.
DIVERSITY_KEYS = ("eval/diversity", "diversity")
WALL_KEY = "time/wall_s"
STEP_TIME_KEY = "time/step_s"
_JUDGE_PREFIX, _JUDGE_SUFFIX = "eval/judge/", "/mean"

# The plot: 2 rows (against step, against wall time) x 5 metrics; its size in pixels is
# FIGURE_INCHES * FIGURE_DPI (no tight bounding box, so the size does not depend on the labels).
FIGURE_INCHES = (16.0, 7.0)
FIGURE_DPI = 100


class RunDirError(ValueError):
    """A path given as a run directory is not one, or its files cannot be read."""


def judge_key(judge: str) -> str:
    """The metric key of a judge's mean score on the eval samples."""
    return f"{_JUDGE_PREFIX}{judge}{_JUDGE_SUFFIX}"


def _number(value: Any) -> float | None:
    """A metric value as a float; None for what is not a number (null, strings, bools)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise RunDirError(f"{path}: cannot read it as YAML ({e})") from e
    if not isinstance(data, dict):
        raise RunDirError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return data


def _read_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RunDirError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(data, dict):
        raise RunDirError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _wall_times(rows: list[dict]) -> list[float]:
    """Seconds since the run started at each row.

    A row's own `time/wall_s` when it has one; otherwise the previous row's
    wall time plus this row's `time/step_s` (0 for the base evaluation at step
    0, which has none). Older runs thus get the cumulative sum of step times.
    """
    walls, wall = [], 0.0
    for row in rows:
        logged = _number(row.get(WALL_KEY))
        if logged is not None and math.isfinite(logged):
            wall = logged
        else:
            step_s = _number(row.get(STEP_TIME_KEY))
            if step_s is not None and math.isfinite(step_s):
                wall += step_s
        walls.append(wall)
    return walls


@dataclasses.dataclass
class Run:
    """One run directory, read: what it is (recipe, card, steps configured) and its metric rows."""

    path: Path
    name: str
    recipe: str
    card: str
    steps_configured: int | None
    rows: list[dict]  # the rows of metrics.jsonl that carry an integer "step", in file order
    walls: list[float]  # wall time (s) of each row, see `_wall_times`
    config: dict = dataclasses.field(default_factory=dict)  # config.yaml as read ({} when there is none)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Run:
        """Read the run directory at `path`; RunDirError when it is not one or cannot be read."""
        path = Path(path)
        if not path.exists():
            raise RunDirError(f"{path}: no such directory")
        if not path.is_dir():
            raise RunDirError(f"{path} is not a directory; give the run directory a recipe wrote "
                              f"(the run_dir=... of trainers/<recipe>.py)")
        config_path, metrics_path = path / CONFIG_FILENAME, path / METRICS_FILENAME
        info_path = path / RUN_INFO_FILENAME
        if not (config_path.is_file() or metrics_path.is_file()):
            raise RunDirError(f"{path} is not a run directory: it holds neither {CONFIG_FILENAME} nor "
                              f"{METRICS_FILENAME} (give the run_dir=... of trainers/<recipe>.py)")
        config = _read_yaml(config_path) if config_path.is_file() else {}
        info = _read_json_object(info_path) if info_path.is_file() else {}
        try:
            rows = read_metrics(metrics_path)
        except (OSError, ValueError) as e:
            raise RunDirError(f"{metrics_path}: cannot read the metrics ({e})") from e
        rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)
                and not isinstance(r.get("step"), bool)]
        model = config.get("model") if isinstance(config.get("model"), dict) else {}
        steps = config.get("steps")
        return cls(path=path, name=path.resolve().name, recipe=str(info.get("recipe") or UNKNOWN),
                   card=str(info.get("card") or model.get("card") or UNKNOWN),
                   steps_configured=steps if isinstance(steps, int) and not isinstance(steps, bool) else None,
                   rows=rows, walls=_wall_times(rows), config=config)

    @property
    def steps_done(self) -> int:
        """The last step logged (0 when only the base evaluation, or nothing, is there)."""
        return max((r["step"] for r in self.rows), default=0)

    @property
    def wall_s(self) -> float | None:
        """Wall time of the last row; None when there is no row."""
        return self.walls[-1] if self.walls else None

    @property
    def modified(self) -> float:
        """Last modification time of the run (its directory or the files a run keeps writing)."""
        times = [self.path.stat().st_mtime]
        for name in (METRICS_FILENAME, CONFIG_FILENAME, RUN_INFO_FILENAME):
            if (self.path / name).is_file():
                times.append((self.path / name).stat().st_mtime)
        return max(times)

    def judges(self) -> list[str]:
        """Names of the judges logged (`eval/judge/<name>/mean`), in the order they first appear."""
        names: list[str] = []
        for row in self.rows:
            for key in row:
                if key.startswith(_JUDGE_PREFIX) and key.endswith(_JUDGE_SUFFIX):
                    name = key[len(_JUDGE_PREFIX):-len(_JUDGE_SUFFIX)]
                    if name and "/" not in name and name not in names:
                        names.append(name)
        return names

    def diversity_key(self) -> str | None:
        """The first of `DIVERSITY_KEYS` the run logs, None if neither."""
        return next((k for k in DIVERSITY_KEYS if any(k in r for r in self.rows)), None)

    def measured(self, key: str) -> bool:
        """Whether the run measured `key`: it logged it, and not as a placeholder (see `kl_placeholder`)."""
        return any(key in r for r in self.rows) and not (key == KL_KEY and kl_placeholder(self))

    def kl_key(self) -> str | None:
        """The key of the run's Gaussian KL to the reference: `kl`, unless the recipe measures a velocity MSE."""
        return None if self.recipe in VELOCITY_MSE_RECIPES else KL_KEY

    def ref_mse_key(self) -> str | None:
        """The key of the run's velocity MSE to the reference: `ref_mse`, or `kl` in an older run of NFT, AWM or
        DPO; None when the run has none."""
        if any(REF_MSE_KEY in r for r in self.rows):
            return REF_MSE_KEY
        return KL_KEY if self.recipe in VELOCITY_MSE_RECIPES else None

    def series(self, key: str) -> list[tuple[int, float, float]]:
        """(step, wall time, value) of every row where `key` holds a finite number; none when not measured."""
        if not self.measured(key):
            return []
        out = []
        for row, wall in zip(self.rows, self.walls):
            value = _number(row.get(key))
            if value is not None and math.isfinite(value):
                out.append((row["step"], wall, value))
        return out

    def last(self, key: str) -> tuple[int, float] | None:
        """(step, value) of the last row holding `key`; the value is NaN when that row logged null or NaN.

        The last logged value, not the last finite one: a final evaluation that
        went NaN must show as NaN, not as the evaluation before it. None when not measured.
        """
        if not self.measured(key):
            return None
        for row in reversed(self.rows):
            if key in row:
                value = _number(row[key])
                return row["step"], value if value is not None else math.nan
        return None

    def best(self, key: str) -> tuple[int, float] | None:
        """(step, value) of the highest finite value of `key` (the earliest step on a tie)."""
        points = self.series(key)
        if not points:
            return None
        step, _, value = max(points, key=lambda p: (p[2], -p[0]))
        return step, value


def kl_placeholder(run: Run) -> bool:
    """Whether the run's `kl` is a placeholder: every value exactly 0.0 and a config that gave it no reference.

    Before recipes logged only what they measure, NFT and AWM with
    `train.kl_beta=0` and GRPO with `train.kl_beta=0, train.log_kl=false` had
    no reference model and wrote `kl: 0.0` every step. All three conditions
    must hold: a measured KL is exactly 0 only while the policy equals its
    reference, and configs without `train.kl_beta` (DPO) always measure it.
    """
    train = run.config.get("train") if isinstance(run.config.get("train"), dict) else {}
    beta = _number(train.get("kl_beta"))
    if beta is None or beta != 0.0 or train.get("log_kl") is True:
        return False
    values = [row[KL_KEY] for row in run.rows if KL_KEY in row]
    return all(_number(v) == 0.0 for v in values)


@dataclasses.dataclass
class RunSummary:
    """One line of the comparison table (None: the run has not logged it)."""

    name: str
    path: str
    recipe: str
    card: str
    steps_done: int
    steps_configured: int | None
    reward_final: float | None
    reward_final_step: int | None
    reward_best: float | None
    reward_best_step: int | None
    judge: str | None
    judge_final: float | None
    judge_at_best_reward: float | None  # the judge at the best reward's step: high reward, low judge = hacking?
    diversity_key: str | None
    diversity_final: float | None
    kl_final: float | None  # GRPO's Gaussian KL
    wall_s: float | None
    best_checkpoint_step: int | None = None  # the step best/ holds (flywheel/recipe/best.py); None: no best/
    ref_mse_final: float | None = None  # the velocity MSE to the reference (NFT, AWM, DPO)

    def to_json(self) -> dict:
        """A dict strict JSON can hold (NaN becomes null)."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in dataclasses.asdict(self).items()}


def summarize(run: Run, judge: str | None = None) -> RunSummary:
    """The table line of `run`. `judge` names the judge to report; None takes the run's first one."""
    if judge is None:
        judges = run.judges()
        judge = judges[0] if judges else None
    elif judge_key(judge) not in {k for r in run.rows for k in r}:
        judge = None  # this run has no such judge (another card's runs may)
    final, best = run.last(REWARD_KEY), run.best(REWARD_KEY)
    judge_final = run.last(judge_key(judge)) if judge else None
    judge_at_best = None
    if judge and best is not None:
        judge_at_best = next((v for s, _, v in run.series(judge_key(judge)) if s == best[0]), None)
    diversity_key = run.diversity_key()
    diversity = run.last(diversity_key) if diversity_key else None
    kl = run.last(run.kl_key()) if run.kl_key() else None
    ref_mse = run.last(run.ref_mse_key()) if run.ref_mse_key() else None
    return RunSummary(
        name=run.name, path=str(run.path), recipe=run.recipe, card=run.card,
        steps_done=run.steps_done, steps_configured=run.steps_configured,
        reward_final=final[1] if final else None, reward_final_step=final[0] if final else None,
        reward_best=best[1] if best else None, reward_best_step=best[0] if best else None,
        judge=judge, judge_final=judge_final[1] if judge_final else None, judge_at_best_reward=judge_at_best,
        diversity_key=diversity_key, diversity_final=diversity[1] if diversity else None,
        kl_final=kl[1] if kl else None, wall_s=run.wall_s, best_checkpoint_step=best_checkpoint_step(run.path),
        ref_mse_final=ref_mse[1] if ref_mse else None)


def best_checkpoint_step(path: Path) -> int | None:
    """The step of the evaluation `path/best/` holds (best/best.json), None when the run has no best/."""
    from flywheel.recipe.best import read_best

    info = read_best(path)
    return None if info is None else info["step"]


def load_runs(paths: list[str | os.PathLike]) -> list[Run]:
    """Read each run directory (RunDirError names the first that is not one); names made unique.

    Two runs with the same directory name (a/run, b/run) are named by the
    paths as given, so the table and the plot's legend tell them apart.
    """
    runs = [Run.load(p) for p in paths]
    names = [r.name for r in runs]
    for run, given in zip(runs, paths):
        if names.count(run.name) > 1:
            run.name = str(given)
    return runs


def compare(runs: list[Run], judge: str | None = None) -> list[RunSummary]:
    """The summaries of `runs`. A named `judge` must be logged by at least one of them."""
    if judge is not None:
        found = sorted({j for r in runs for j in r.judges()})
        if judge not in found:
            raise RunDirError(f"--judge {judge}: no run logged {judge_key(judge)}; the judges these runs logged: "
                              f"{', '.join(found) or 'none'}")
    return [summarize(r, judge) for r in runs]


# ---------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------


def format_value(value: float | None, digits: int = 3) -> str:
    """A metric for the table: "-" when absent, "nan" when logged as null/NaN, "inf"/"-inf" as logged."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}f}"


def format_duration(seconds: float | None) -> str:
    """12.3s, 4m05s, 2h03m; "-" when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m{int(seconds % 60):02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def format_steps(done: int, configured: int | None) -> str:
    """"done/configured" ("done/?" when the config does not say)."""
    return f"{done}/{configured if configured is not None else UNKNOWN}"


def _step(step: int | None) -> str:
    """best/'s step as "@12", "-" when the run has no best/."""
    return "-" if step is None else f"@{step}"


def _at(value: float | None, step: int | None) -> str:
    text = format_value(value)
    return f"{text} @{step}" if value is not None and step is not None else text


def render_table(header: list[str], lines: list[list[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart, a rule under the header."""
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *lines]]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


COMPARE_HEADER = ["run", "recipe", "card", "steps", "reward final", "reward best", "judge", "judge final",
                  "judge @best", "diversity", "wall", "best/"]


def compare_table(summaries: list[RunSummary]) -> str:
    """The comparison table; eval rewards carry the step they were measured at (value @step)."""
    lines = [[s.name, s.recipe, s.card, format_steps(s.steps_done, s.steps_configured),
              _at(s.reward_final, s.reward_final_step), _at(s.reward_best, s.reward_best_step),
              s.judge or "-", format_value(s.judge_final), format_value(s.judge_at_best_reward),
              format_value(s.diversity_final), format_duration(s.wall_s), _step(s.best_checkpoint_step)]
             for s in summaries]
    return render_table(COMPARE_HEADER, lines)


def write_json(summaries: list[RunSummary], path: str | os.PathLike) -> Path:
    """The table as a JSON list of objects (one a run), written atomically."""
    return atomic_write_text(path, json.dumps([s.to_json() for s in summaries], indent=2) + "\n")


# ---------------------------------------------------------------------------
# Config differences
# ---------------------------------------------------------------------------


# Keys left out of the config diff: they differ between any two runs by construction.
CONFIG_DIFF_IGNORED = ("run_dir",)
ABSENT = "(absent)"  # a key one run's config.yaml does not hold


def flatten_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted keys (`train.learning_rate`) to leaf values, in the file's order; lists are leaves."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def format_config_value(value: Any) -> str:
    """A config value as it reads in YAML on the command line: null, true, 0.001, [a, b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(", ", ": "))
    return str(value)


def config_diff(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """(dotted key, each run's value) for every config key on which the runs differ, in config order.

    A key missing from a run's config.yaml (another recipe's section, an older
    run) shows as ABSENT; `CONFIG_DIFF_IGNORED` keys are left out.
    """
    flats = [renamed_flat_keys(flatten_config(r.config)) for r in runs]  # a run from before the rename: new names
    keys: dict[str, None] = {}
    for flat in flats:
        keys.update(dict.fromkeys(flat))
    diff = []
    for key in keys:
        if key in CONFIG_DIFF_IGNORED:
            continue
        missing = object()
        values = [flat.get(key, missing) for flat in flats]
        if all(v is not missing for v in values) and all(v == values[0] and type(v) is type(values[0])
                                                         for v in values):
            continue
        diff.append((key, [ABSENT if v is missing else format_config_value(v) for v in values]))
    return diff


def config_diff_table(runs: list[Run]) -> str:
    """The table of `config_diff` (key | run1 | run2 ...), or a line saying the configs agree."""
    ignored = ", ".join(CONFIG_DIFF_IGNORED)
    diff = config_diff(runs)
    if not diff:
        return f"the runs' configs are the same (apart from {ignored})"
    table = render_table(["key", *(r.name for r in runs)], [[key, *values] for key, values in diff])
    return f"config keys that differ ({len(diff)}; {ignored} left out):\n{table}"


# ---------------------------------------------------------------------------
# Listing a folder of runs
# ---------------------------------------------------------------------------


LIST_HEADER = ["run", "recipe", "card", "steps", "last eval reward", "judge", "best/", "modified"]


# How deep `list` looks for run directories below its root (runs/sweep/lr-1e-3/seed-0 is 3 deep).
LIST_MAX_DEPTH = 4
# Folders a run writes inside itself, and other folders that never hold runs: never searched.
NOT_RUN_FOLDERS = frozenset({"wandb", "checkpoints", "samples", "lora", "lora_ema", "best", "__pycache__"})


def is_run_dir(path: Path) -> bool:
    """A folder a recipe wrote: config.yaml beside metrics.jsonl or run.json."""
    return (path / CONFIG_FILENAME).is_file() and ((path / METRICS_FILENAME).is_file()
                                                   or (path / RUN_INFO_FILENAME).is_file())


def find_run_dirs(root: Path, max_depth: int = LIST_MAX_DEPTH) -> tuple[list[Path], list[str]]:
    """Run directories at any depth up to `max_depth` below `root`, and a note for each folder passed over.

    A run directory is not searched further (its checkpoints/, samples/,
    wandb/ and TensorBoard folder hold no runs), nor are hidden folders and
    `NOT_RUN_FOLDERS`. Symlinked folders are followed once each. A folder
    directly under `root` that holds no run gets a note, as does one that
    holds config.yaml without metrics.jsonl or run.json, and the depth limit
    when some folder at it had subfolders.
    """
    if is_run_dir(root):  # `list runs/grpo-toy`: the run itself
        return [root], []
    found, notes, seen, cut = [], [], set(), []

    def visit(folder: Path, depth: int) -> bool:  # whether a run was found at or under `folder`
        try:
            real = folder.resolve()
        except OSError:
            return False
        if real in seen:
            return False
        seen.add(real)
        try:
            entries = sorted(e for e in folder.iterdir() if e.is_dir() and not e.name.startswith(".")
                             and e.name not in NOT_RUN_FOLDERS)
        except OSError as e:
            notes.append(f"skipped {folder.relative_to(root)}: cannot read it ({e.strerror or e})")
            return False
        if depth == max_depth:
            if entries:
                cut.append(folder)
            return False
        any_run = False
        for entry in entries:
            name = entry.relative_to(root)
            if is_run_dir(entry):
                found.append(entry)
                any_run = True
                continue
            if (entry / CONFIG_FILENAME).is_file():
                notes.append(f"skipped {name}: it holds {CONFIG_FILENAME} but neither {METRICS_FILENAME} nor "
                             f"{RUN_INFO_FILENAME}, so it is not a run directory")
            held = visit(entry, depth + 1)
            any_run = any_run or held
            if depth == 0 and not held and not (entry / CONFIG_FILENAME).is_file():
                notes.append(f"skipped {name}: not a run directory, and no run directory in it")
        return any_run

    visit(root, 0)
    if cut:
        shown = ", ".join(str(c.relative_to(root)) for c in cut[:3]) + (", ..." if len(cut) > 3 else "")
        notes.append(f"did not look deeper than {max_depth} levels below {root} (folders not searched under: "
                     f"{shown}); run list on a deeper folder to see runs there")
    return found, notes


def list_runs(root: str | os.PathLike, max_depth: int = LIST_MAX_DEPTH) -> tuple[list[Run], list[str]]:
    """The runs under `root` (nested folders included, see `find_run_dirs`), most recently modified first,
    and a note for each folder skipped. Each run is named by its path below `root` (sweep/lr-1e-3)."""
    root = Path(root)
    if not root.is_dir():
        raise RunDirError(f"{root}: no such directory (give the folder that holds your run directories)")
    paths, notes = find_run_dirs(root, max_depth)
    runs = []
    for path in paths:
        try:
            run = Run.load(path)
        except RunDirError as e:
            notes.append(f"skipped {path.relative_to(root)}: {e}")
            continue
        run.name = path.name if path == root else str(path.relative_to(root))
        runs.append(run)
    runs.sort(key=lambda r: r.modified, reverse=True)
    return runs, notes


def list_table(runs: list[Run]) -> str:
    """One line a run: recipe, card, steps done/configured, the last eval reward and judge, when modified."""
    import time

    lines = []
    for run in runs:
        s = summarize(run)
        judge = f"{s.judge} {format_value(s.judge_final)}" if s.judge else "-"
        lines.append([run.name, run.recipe, run.card, format_steps(s.steps_done, s.steps_configured),
                      _at(s.reward_final, s.reward_final_step), judge, _step(s.best_checkpoint_step),
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(run.modified))])
    return render_table(LIST_HEADER, lines)


# ---------------------------------------------------------------------------
# The plot
# ---------------------------------------------------------------------------


def import_pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise RunDirError("the comparison plot needs matplotlib, which is not installed: pip install matplotlib "
                          "(or pass --no-plot for the table alone)") from e
    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: list[Run], summaries: list[RunSummary], out: str | os.PathLike) -> Path:
    """Write a PNG of eval reward, judge, KL, velocity MSE to the reference and diversity against step (top row)
    and wall time (bottom row): GRPO's Gaussian KL and the others' velocity MSE each on their own axes.

    One line per run, labelled "<run name> (<recipe>)", the same colour in
    every panel. The judge panel shows each run's judge of its summary. The
    PNG is FIGURE_INCHES * FIGURE_DPI pixels.
    """
    plt = import_pyplot()
    judges = sorted({s.judge for s in summaries if s.judge})
    panels = [("eval reward", lambda run, s: REWARD_KEY),
              (f"eval judge ({', '.join(judges) or 'none'})", lambda run, s: judge_key(s.judge) if s.judge else None),
              ("KL to reference", lambda run, s: run.kl_key()),
              ("velocity MSE to reference", lambda run, s: run.ref_mse_key()),
              ("diversity", lambda run, s: s.diversity_key)]
    fig, axes = plt.subplots(2, len(panels), figsize=FIGURE_INCHES, dpi=FIGURE_DPI, squeeze=False)
    try:
        for col, (title, key_of) in enumerate(panels):
            for row, (axis_name, index) in enumerate((("step", 0), ("wall time (s)", 1))):
                ax = axes[row][col]
                absent = []  # runs that did not measure this panel's metric: no line, named under the panel
                for i, (run, summary) in enumerate(zip(runs, summaries)):
                    key = key_of(run, summary)
                    points = run.series(key) if key else []
                    if points:
                        ax.plot([p[index] for p in points], [p[2] for p in points], marker="o", markersize=3,
                                color=f"C{i % 10}", label=f"{run.name} ({run.recipe})")
                    else:
                        absent.append(run.name)
                if len(absent) == len(runs):
                    ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes,
                            color="grey")
                elif absent:
                    ax.text(0.01, 0.01, "not logged: " + ", ".join(absent), ha="left", va="bottom",
                            transform=ax.transAxes, color="grey", fontsize=8)
                ax.set_title(title, fontsize=10)
                ax.set_xlabel(axis_name)
                ax.grid(True, alpha=0.3)
        handles = [plt.Line2D([], [], color=f"C{i % 10}", marker="o", markersize=3) for i in range(len(runs))]
        columns = max(1, min(len(runs), 4))
        fig.legend(handles, [f"{r.name} ({r.recipe})" for r in runs], loc="upper center", ncol=columns,
                   fontsize=9, frameon=False)
        legend_rows = -(-len(runs) // columns)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.04 * legend_rows - 0.02))  # room above the panels for the legend
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=FIGURE_DPI)
    finally:
        plt.close(fig)
    return atomic_write_bytes(out, buffer.getvalue())
