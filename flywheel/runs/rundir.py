"""The run directory: config.yaml, metrics.jsonl, sample grids, checkpoints.

Layout of a run directory:

    <run>/config.yaml        the resolved config (see `flywheel.config.parsing`)
    <run>/metrics.jsonl      one JSON object per line, one line a step
    <run>/samples/           PNG grids of samples
    <run>/checkpoints/       step_000123/ dirs (see `flywheel.runs.checkpoint`)
    <run>/lora/, lora_ema/, wandb/, ...  what the recipe and its trackers write
    <run>/.flywheel.lock     held (flock) by the process that runs in it

A run directory belongs to one run: `RunDir` refuses to start a fresh run in
a used one unless told to resume it or to overwrite it (see `RunDir`), and
`RunDirLock` refuses a second process while one runs there.

Everything that a crash could leave half-written (config, grids, the metrics
file when it is rewritten) goes through `atomic_write_*`: a reader sees either
the old file or the new one, never a torn one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import io
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from PIL import Image

METRICS_FILENAME = "metrics.jsonl"
CONFIG_FILENAME = "config.yaml"
RUN_INFO_FILENAME = "run.json"
LOCK_FILENAME = ".flywheel.lock"


# ---------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry to disk so that a rename inside it survives a crash."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories; nothing to do there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically: temp file in the same dir, fsync, os.replace.

    The temp file must live in the same directory so that os.replace is a rename
    within one filesystem (atomic), not a copy.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600 files; results of a run should be readable like any file.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` atomically (see `atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode(encoding))


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


def _json_value(value: Any, key: str) -> Any:
    """Turn a metric value into something strict JSON can hold.

    NaN and +-inf become null: strict JSON has no literal for them, and tools
    reading metrics.jsonl (pandas, jq, browsers) reject Python's `NaN` token.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric {key!r}: expected a scalar, got a tensor of shape {tuple(value.shape)}")
        return _json_value(value.detach().cpu().item(), key)
    if isinstance(value, (np.generic, np.ndarray)):
        if np.size(value) != 1:
            raise TypeError(f"metric {key!r}: expected a scalar, got an array of shape {np.shape(value)}")
        return _json_value(np.asarray(value).item(), key)
    if isinstance(value, dict):
        return {str(k): _json_value(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v, f"{key}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"metric {key!r}: cannot write a {type(value).__name__} to metrics.jsonl; "
        "valid values are int, float, bool, str, None, 0-d tensors and numpy scalars"
    )


def _metrics_file(path: str | os.PathLike) -> Path:
    """A run directory means its metrics.jsonl; anything else is the file itself."""
    path = Path(path)
    return path / METRICS_FILENAME if path.is_dir() else path


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Read metrics.jsonl (or a run dir's) into a list of dicts; [] if it does not exist.

    A last line that does not parse but begins as a row does ("{") is ignored:
    a process killed mid-write can leave one. Any other line that is not a
    JSON object is corruption (or not a metrics file) and raises ValueError,
    so a garbage file is not read as a run with no rows.
    """
    path = _metrics_file(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if line.lstrip().startswith("{") and all(not rest.strip() for rest in lines[i + 1:]):
                break  # trailing partial line of a killed writer
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e}): {line[:200]!r}") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {i + 1} is a JSON {type(row).__name__}, not an object "
                             f"(each line of metrics.jsonl is one row, {{\"step\": ..., ...}}): {line[:200]!r}")
        rows.append(row)
    return rows


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl.

    `path` is the metrics file, or a run directory (then its metrics.jsonl).
    Each `append` opens, writes one whole line and closes, so a killed process
    loses at most the line being written. Rows are flushed, not fsynced: a
    killed process loses nothing, a power cut may lose the last rows.
    NaN and infinite values are written as null (strict JSON has no NaN).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = _metrics_file(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_partial_tail()

    def _drop_partial_tail(self) -> None:
        # A killed writer can leave a last line without its newline; appending
        # after it would glue the next row onto it and lose both. A tail that is
        # a whole row (only the newline missing) is kept, as read_metrics keeps it.
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        if not data[cut:].lstrip().startswith(b"{"):  # not a row this writer began: cut nothing, say so
            raise ValueError(f"{self.path}: the last line is not a metrics row: {data[cut:cut + 200]!r}")
        try:
            complete = isinstance(json.loads(data[cut:]), dict)
        except ValueError:
            complete = False
        with open(self.path, "rb+") as f:
            if complete:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
            else:
                f.truncate(cut)

    def append(self, row: dict) -> None:
        """Write one row (a flat dict is usual; include "step" so resume can truncate)."""
        if not isinstance(row, dict):
            raise TypeError(f"MetricsLog.append expects a dict, got {type(row).__name__}")
        clean = {str(k): _json_value(v, str(k)) for k, v in row.items()}
        line = json.dumps(clean, allow_nan=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()

    def read(self) -> list[dict]:
        """All rows written so far (see `read_metrics`)."""
        return read_metrics(self.path)

    def truncate_after(self, step: int) -> int:
        """Drop rows with row["step"] > step; return how many were dropped.

        Used on resume from the checkpoint of `step`: rows a killed run wrote
        after its last checkpoint would otherwise appear twice. Rows without a
        "step" are kept. The file is rewritten atomically.
        """
        if not self.path.exists():
            return 0
        rows = read_metrics(self.path)
        kept = [r for r in rows if not (isinstance(r.get("step"), (int, float)) and r["step"] > step)]
        text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept)
        atomic_write_text(self.path, text)
        return len(rows) - len(kept)


# ---------------------------------------------------------------------------
# Image grids
# ---------------------------------------------------------------------------


def make_image_grid(images: torch.Tensor | np.ndarray, nrow: int | None = None, upscale: int = 4,
                    padding: int = 1, pad_value: float = 0.5) -> Image.Image:
    """Arrange images [B, C, H, W] (float in [0, 1], C = 1 or 3) in a grid.

    `nrow` is the number of columns (default ceil(sqrt(B))). Cells are separated
    and framed by `padding` pixels of `pad_value` (grey by default, visible on
    both black and white images). The whole grid is then nearest-neighbour
    upscaled by `upscale`, so the PNG is
    ((ncol * (W + padding) + padding) * upscale) pixels wide and
    ((nrows * (H + padding) + padding) * upscale) high.
    Values are clamped to [0, 1] (NaN -> 0) and mapped to round(255 * x).
    """
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a tensor [B, C, H, W], got {type(images).__name__}")
    if images.dim() == 3:
        images = images.unsqueeze(0)
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must have shape [B, C, H, W] with C = 1 or 3, got {tuple(images.shape)}")
    if images.shape[0] == 0:
        raise ValueError("images is empty (B = 0); there is nothing to put in a grid")
    if upscale < 1 or padding < 0:
        raise ValueError(f"upscale must be >= 1 and padding >= 0, got upscale={upscale}, padding={padding}")

    b, c, h, w = images.shape
    ncol = nrow if nrow is not None else math.ceil(math.sqrt(b))
    if ncol < 1:
        raise ValueError(f"nrow (columns) must be >= 1, got {nrow}")
    ncol = min(ncol, b)
    nrows = math.ceil(b / ncol)

    x = torch.nan_to_num(images.detach().to("cpu", torch.float32), nan=0.0).clamp(0.0, 1.0)
    x = (x * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()  # [B, H, W, C]
    pad = int(round(min(max(pad_value, 0.0), 1.0) * 255))
    grid = np.full((nrows * (h + padding) + padding, ncol * (w + padding) + padding, c), pad, np.uint8)
    for i in range(b):
        r, col = divmod(i, ncol)
        top, left = padding + r * (h + padding), padding + col * (w + padding)
        grid[top:top + h, left:left + w] = x[i]
    if upscale > 1:
        grid = grid.repeat(upscale, axis=0).repeat(upscale, axis=1)
    return Image.fromarray(grid[:, :, 0], mode="L") if c == 1 else Image.fromarray(grid, mode="RGB")


def save_image_grid(images: torch.Tensor | np.ndarray, path: str | os.PathLike, nrow: int | None = None,
                    upscale: int = 4, padding: int = 1, pad_value: float = 0.5) -> Image.Image:
    """Save `make_image_grid(images, ...)` as a PNG at `path` atomically; return the image."""
    image = make_image_grid(images, nrow=nrow, upscale=upscale, padding=padding, pad_value=pad_value)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())
    return image


# ---------------------------------------------------------------------------
# The run directory
# ---------------------------------------------------------------------------


# Where a resume from an older checkpoint puts what the run wrote after it (newer checkpoints, a newer best/):
# that timeline is abandoned, and neither a later resume nor best/ may pick it up again.
ABANDONED_DIRNAME = "abandoned"


class RunDirInUseError(FileExistsError):
    """A fresh run was pointed at a directory another run already used, or another process runs in it."""


# What a run writes into its directory, and so what overwrite=true may delete. Anything
# else found there is not ours and is left alone. config.yaml is deleted last: an
# overwrite killed half-way still leaves the directory recognisable as a run's.
RUN_ARTIFACTS = (METRICS_FILENAME, "checkpoints", "samples", "lora", "lora_ema", "best", ".best.old",
                 ABANDONED_DIRNAME, "wandb", RUN_INFO_FILENAME, CONFIG_FILENAME)
RUN_DIR_MODES = ("new", "resume", "overwrite")
_CREATED_EMPTY = ("checkpoints", "samples")  # made by RunDir itself before a run writes anything


def _used_entries(path: Path) -> list[str]:
    """What is in `path`, leaving out the empty dirs RunDir creates (a run that stopped before writing) and the
    lock file."""
    if not path.is_dir():
        return []
    return sorted(e.name for e in path.iterdir()
                  if e.name != LOCK_FILENAME
                  and not (e.name in _CREATED_EMPTY and e.is_dir() and not e.is_symlink() and not any(e.iterdir())))


def _delete(entry: Path) -> None:
    # A symlink is removed, never followed: nothing outside the run directory is deleted.
    if entry.is_symlink() or entry.is_file():
        entry.unlink()
    elif entry.is_dir():
        shutil.rmtree(entry)


def _check_tracker_dirs(tracker_dirs: tuple[str, ...]) -> None:
    for name in tracker_dirs:
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise ValueError(f"tracker_dirs must be plain directory names inside the run directory, got {name!r}")


def _steps_done(path: Path) -> int | None:
    """The last step a run's metrics.jsonl records (0: only the evaluation before training, or no row);
    None when the file cannot be read (then the run is not taken for an unstarted one)."""
    try:
        rows = read_metrics(path / METRICS_FILENAME)
    except (OSError, ValueError):
        return None
    return max((int(r["step"]) for r in rows if isinstance(r.get("step"), (int, float))), default=0)


def _holds_checkpoint(path: Path) -> bool:
    """Whether checkpoints/ holds anything (a step_N dir, or what a killed save left)."""
    checkpoints = path / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.iterdir())


# In-process holders of run-dir locks, by resolved path: flock excludes other processes, and a later run of
# this process in the same directory (an earlier RecipeRun left to the garbage collector) takes the lock over.
_HELD_LOCKS: dict[str, "RunDirLock"] = {}


class RunDirLock:
    """An exclusive lock on a run directory (flock on `<run>/.flywheel.lock`), held until `release`.

    Two processes never run in one directory at once: `acquire` refuses with
    RunDirInUseError naming the holder's pid while another process holds it.
    The kernel drops an flock when its process dies, so a run killed with
    kill -9 leaves a lock file that no longer locks anything: a resume takes it
    at once. The file itself stays (deleting a lock file races with a process
    opening it). One process of a launch takes it (the main one).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILENAME
        self._key = os.path.realpath(self.path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None and _HELD_LOCKS.get(self._key) is self

    def acquire(self) -> "RunDirLock":
        earlier = _HELD_LOCKS.get(self._key)
        if earlier is not None:  # this process already holds it (an earlier run of it): take it over
            self._fd, earlier._fd = earlier._fd, None
            _HELD_LOCKS[self._key] = self
            self._write_pid()
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirInUseError(
                f"run_dir {self.path.parent} is in use: another run (pid {holder}) is running in it; wait for it "
                "to end, or choose another run_dir") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _HELD_LOCKS[self._key] = self
        self._write_pid()
        return self

    def _write_pid(self) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Unlock (a no-op when not held, or when a later run of this process took it over)."""
        if not self.held:
            self._fd = None
            return
        del _HELD_LOCKS[self._key]
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: the kernel drops the lock with the process anyway
            pass


class RunDir:
    """A run directory (created if missing) and the paths inside it; it belongs to one run.

    `mode` says how the run uses it:

    - "new" (default): a fresh run. A directory that holds anything (besides
      the empty checkpoints/ and samples/ this class creates) is refused with
      RunDirInUseError: metrics, config and checkpoints of two runs would mix.
      One exception: a run that stopped before its first training step (its
      config.yaml and run.json there, no checkpoint, no step past 0 in
      metrics.jsonl) is started again in place, its files replaced, with a note.
    - "resume": continue the run that wrote it; its config.yaml must be there.
    - "overwrite": a fresh run that first deletes the previous run's files:
      `RUN_ARTIFACTS` (metrics.jsonl, checkpoints/, samples/, lora/, lora_ema/,
      best/, abandoned/, wandb/, run.json, config.yaml) and `tracker_dirs` (e.g. the TensorBoard dir
      accelerate names after the project). Anything else is kept, with a warning. A
      non-empty directory without config.yaml is refused: it is not a run's.

    With `lock=True` the main process first takes the directory's `RunDirLock`
    (kept in `self.lock` until `release()`), so a second process running in it
    is refused before anything is checked or deleted.

    `tracker_dirs`: names of further dirs the run's trackers write (TensorBoard:
    `<run>/<project>/`). With several processes pass `is_main_process`: only the
    main one locks, checks, deletes and creates; the others only get the paths.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "new", tracker_dirs: tuple[str, ...] = (),
                 is_main_process: bool = True, lock: bool = False):
        if mode not in RUN_DIR_MODES:
            raise ValueError(f"RunDir mode must be one of {', '.join(RUN_DIR_MODES)}, got {mode!r}")
        tracker_dirs = tuple(tracker_dirs)
        _check_tracker_dirs(tracker_dirs)
        self.path = Path(path)
        self.mode = mode
        self.checkpoints_dir = self.path / "checkpoints"
        self.samples_dir = self.path / "samples"
        self.config_path = self.path / CONFIG_FILENAME
        self.metrics_path = self.path / METRICS_FILENAME
        self.lock: RunDirLock | None = None
        if mode == "resume" and not self.config_path.is_file():
            raise FileNotFoundError(f"resume: {self.config_path} is missing; a run directory without its config "
                                    "cannot be resumed")
        if is_main_process:
            if lock:
                self.lock = RunDirLock(self.path).acquire()
            try:
                if mode == "new":
                    if self._never_trained():
                        print(f"note: run_dir {self.path} holds a run that stopped before its first training step "
                              "(no checkpoint, no step past 0 in metrics.jsonl): starting it again there, its files "
                              "replaced", file=sys.stderr, flush=True)
                        self._clear(tracker_dirs)
                    else:
                        self._refuse_used()
                elif mode == "overwrite":
                    self._clear(tracker_dirs)
                for d in (self.path, self.checkpoints_dir, self.samples_dir):
                    d.mkdir(parents=True, exist_ok=True)
            except BaseException:
                self.release()
                raise

    def release(self) -> None:
        """Let go of the directory's lock (a no-op without one); the process's end does it too."""
        if self.lock is not None:
            self.lock.release()

    @functools.cached_property
    def metrics(self) -> MetricsLog:
        """The run's metrics.jsonl, opened on first use (by the process that writes it: opening repairs
        a torn last line, which other processes must not race)."""
        return MetricsLog(self.metrics_path)

    def _never_trained(self) -> bool:
        """A recipe run that stopped before its first training step: nothing in it is worth resuming."""
        return (self.config_path.is_file() and (self.path / RUN_INFO_FILENAME).is_file()
                and not _holds_checkpoint(self.path) and _steps_done(self.path) == 0)

    def refuse_if_used(self) -> None:
        """RunDirInUseError for a fresh run here, unless the directory is new or holds a run that never trained
        (which a fresh run replaces)."""
        if not self._never_trained():
            self._refuse_used()

    def _refuse_used(self) -> None:
        used = _used_entries(self.path)
        if not used:
            return
        done = _steps_done(self.path)
        if self.config_path.is_file() and not _holds_checkpoint(self.path) and done:
            raise RunDirInUseError(
                f"run_dir {self.path} holds a run that stopped after step {done}, before its first checkpoint, so "
                "there is nothing to resume from. Pass overwrite=true to start it over there (deleting its run "
                f"files: {', '.join(RUN_ARTIFACTS)} and tracker logs), or choose another run_dir.")
        if not self.config_path.is_file():
            # Neither resume= (it needs the run's config.yaml) nor overwrite=true (it deletes only a run's files)
            # takes such a folder: saying so beats sending the user to two refusals.
            raise RunDirInUseError(
                f"run_dir {self.path} is not empty (it holds {', '.join(used)}) and is not a flywheel run directory "
                f"(no {CONFIG_FILENAME}), so a run cannot start, resume or overwrite there; choose a new or empty "
                "run_dir.")
        raise RunDirInUseError(
            f"run_dir {self.path} is already used (it holds {', '.join(used)}); a fresh run there would mix "
            f"with the previous one. Pass resume={self.path} to continue that run, or overwrite=true to "
            f"delete its run files ({', '.join(RUN_ARTIFACTS)} and tracker logs) and start over, or choose "
            "another run_dir.")

    def refuse_overwrite_of_other_files(self) -> None:
        """RunDirInUseError when overwrite=true would have to delete a folder that is not a run's (files but no
        config.yaml): overwrite deletes only a run's own files."""
        used = _used_entries(self.path)
        if used and not self.config_path.is_file():
            raise RunDirInUseError(
                f"overwrite=true: {self.path} holds {', '.join(used)} but no {CONFIG_FILENAME}, so it is not a "
                "flywheel run directory; nothing was deleted. Choose a new or empty run_dir.")

    def _clear(self, tracker_dirs: tuple[str, ...]) -> None:
        used = _used_entries(self.path)
        if not used:
            return
        self.refuse_overwrite_of_other_files()
        owned = (*tracker_dirs, *RUN_ARTIFACTS)  # config.yaml stays last
        for entry in sorted(self.path.iterdir()):
            # Temp files of atomic writes killed mid-way (".config.yaml.<random>.tmp").
            if entry.name.endswith(".tmp") and any(entry.name.startswith(f".{n}.") for n in owned):
                _delete(entry)
        for name in owned:
            _delete(self.path / name)
        kept = _used_entries(self.path)
        if kept:
            # A plain line, as the recipes' other warnings (warnings.warn printed its source line under it).
            print(f"warning: overwrite=true: kept {', '.join(kept)} in {self.path} (not files a run writes)",
                  file=sys.stderr, flush=True)

    def write_config(self, cfg: Any) -> Path:
        """Write config.yaml atomically from a dict or a config dataclass."""
        if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            # Imported here, not at the top: flywheel.config.parsing imports this module
            # for its atomic writes.
            from flywheel.config.parsing import config_to_dict

            cfg = config_to_dict(cfg)
        if not isinstance(cfg, dict):
            raise TypeError(f"write_config expects a dict or a config dataclass, got {type(cfg).__name__}")
        atomic_write_text(self.config_path, yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False))
        return self.config_path

    def sample_path(self, step: int, name: str = "samples") -> Path:
        """Where the sample grid of `step` goes: samples/<name>_<step:06d>.png."""
        return self.samples_dir / f"{name}_{step:06d}.png"

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r}, mode={self.mode!r})"
