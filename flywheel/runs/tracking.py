"""Experiment tracking through accelerate's trackers: wandb (the default), TensorBoard, trackio, MLflow, or none.

`tracker=` takes one name or several ("wandb,trackio"); every one gets the same
metrics, config and sample grids. wandb runs offline when no account is
configured (no WANDB_API_KEY and no api.wandb.ai entry in ~/.netrc), so a
first run never blocks on a login and its files land in the run directory for
a later `wandb sync`. trackio is local-first: it writes to $TRACKIO_DIR
(default ~/.cache/huggingface/trackio, one place for all runs, which its
dashboard `trackio show` compares). MLflow writes to $MLFLOW_TRACKING_URI when
set, else to the run directory's mlruns/ (`mlflow ui --backend-store-uri
<run>/mlruns`). TensorBoard (accelerate's tracker)
writes into `<run_dir>/<project>/` (`project` defaults to "flywheel"). A wandb run
that logs offline says so in one line, with the sync command.
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os
from pathlib import Path

TRACKERS = ("wandb", "tensorboard", "trackio", "mlflow", "none")
PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "trackio": ("trackio",), "mlflow": ("mlflow",)}

log = logging.getLogger(__name__)


def wandb_account_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def tracker_names(tracker: str) -> list[str]:
    """The trackers of a `tracker=` value ("wandb", "wandb,trackio", "none" -> []); ValueError naming a bad one."""
    names = [n.strip() for n in str(tracker).split(",")]
    bad = [n for n in names if n not in TRACKERS]
    if bad or not names or ("none" in names and len(names) > 1) or len(set(names)) != len(names):
        raise ValueError(f"tracker={tracker!r} is not valid: give one or more of {', '.join(TRACKERS[:-1])} "
                         "separated by commas (each once), or none")
    return [] if names == ["none"] else names


# How to install each tracker's package: the dashboards extra brings trackio and mlflow-skinny, not TensorBoard.
INSTALL = {"tensorboard": "`pip install tensorboard`", "trackio": "`pip install -e .[dashboards]`",
           "mlflow": "`pip install -e .[dashboards]` (or `pip install mlflow`)"}


def missing_tracker_packages(tracker: str) -> list[str]:
    """One message for each tracker of a `tracker=` value whose package is not installed."""
    return [f"tracker={name} needs the {PACKAGES[name][0]} package, which is not installed: {INSTALL[name]}, or "
            f"use tracker=wandb / tracker=none" for name in tracker_names(tracker)
            if name in PACKAGES and not any(importlib.util.find_spec(p) for p in PACKAGES[name])]


def prepare_tracker(tracker: str, run_dir: Path) -> dict:
    """Environment and init kwargs for `Accelerator.init_trackers`; call before creating trackers."""
    names = tracker_names(tracker)
    missing = missing_tracker_packages(tracker)
    if missing:
        raise ModuleNotFoundError("; ".join(missing))
    kwargs: dict = {}
    if "wandb" in names:
        reason = None
        if "WANDB_MODE" not in os.environ and not wandb_account_configured():
            os.environ["WANDB_MODE"] = "offline"
            reason = "no wandb account configured"
        elif os.environ.get("WANDB_MODE") in WANDB_OFFLINE_MODES:
            reason = f"WANDB_MODE={os.environ['WANDB_MODE']}"
        if reason is not None and _is_main_rank():
            # WANDB_SILENT hides wandb's own notice of this: say it once, with the command that uploads the run.
            print(wandb_offline_line(run_dir, reason), flush=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        kwargs["wandb"] = {"dir": str(run_dir), "name": run_dir.name}
    if "trackio" in names:
        kwargs["trackio"] = {"name": run_dir.name, "embed": False, "auto_log_gpu": False, "auto_log_cpu": False}
    if "mlflow" in names:
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            import mlflow

            # MLflow 3 keeps its file store in maintenance mode behind this switch; a database backend
            # (sqlite:///...) needs sqlalchemy, which mlflow-skinny does not bring: set MLFLOW_TRACKING_URI for one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((Path(run_dir).resolve() / "mlruns").as_uri())
        kwargs["mlflow"] = {"run_name": run_dir.name}
    return kwargs


# WANDB_MODE values in which wandb writes the run locally only ("dryrun" is wandb's older name for offline).
WANDB_OFFLINE_MODES = ("offline", "dryrun")


def wandb_offline_line(run_dir: Path, reason: str) -> str:
    """The line a run prints when wandb logs offline: why, where, and the command that uploads it later.

    wandb names each run's folder `<run_dir>/wandb/offline-run-<time>-<id>`; a resumed run adds another, and
    the glob syncs them all.
    """
    return f"wandb is offline ({reason}): sync with `wandb sync {Path(run_dir) / 'wandb'}/offline-run-*`"


def _is_main_rank() -> bool:
    """Whether this is the launch's first process (RANK as accelerate launch and torchrun set it; 0 when unset)."""
    return os.environ.get("RANK", "0") in ("", "0")


def log_images(accelerator, name: str, images: list, step: int) -> None:
    """Log PIL images to whichever trackers are active."""
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            import wandb

            tracker.log({name: [wandb.Image(im) for im in images]}, step=step)
        elif tracker.name == "tensorboard":
            import numpy as np

            for i, im in enumerate(images):
                tracker.writer.add_image(f"{name}/{i}", np.asarray(im), step, dataformats="HWC")
        elif tracker.name == "trackio":
            import trackio

            tracker.log({f"{name}/{i}" if len(images) > 1 else name: trackio.Image(im)
                         for i, im in enumerate(images)}, step=step)
        elif tracker.name == "mlflow":
            import mlflow

            for i, im in enumerate(images):  # an image series per key: MLflow's UI steps through it
                mlflow.log_image(im, key=f"{name}/{i}".replace("/", "_") if len(images) > 1 else
                                 name.replace("/", "_"), step=step)


def log_videos(accelerator, name: str, paths: list, step: int, fps: int = 16) -> None:
    """Log MP4 files (see `flywheel.video.write_mp4`) to whichever trackers are active.

    wandb gets the MP4 files as they are, so a clip written with its audio
    plays with sound there. TensorBoard (whose video summaries need moviepy)
    gets each video's frames side by side as one image, and its sound, when the
    file has any, as an audio summary `<name>/<i>/audio` (channels averaged: it
    plays mono). `fps` is unused: the file carries its frame rate (kept for callers).
    """
    for tracker in accelerator.trackers:
        if tracker.name == "trackio":
            import trackio

            tracker.log({f"{name}/{i}": trackio.Video(str(p)) for i, p in enumerate(paths)}, step=step)
        elif tracker.name == "mlflow":
            import mlflow

            for p in paths:
                mlflow.log_artifact(str(p), artifact_path=f"{name}/step_{step:06d}")
        elif tracker.name == "wandb":
            import wandb

            # No fps argument: for a file wandb ignores it and warns on every call.
            tracker.log({name: [wandb.Video(str(p), format="mp4") for p in paths]}, step=step)
        elif tracker.name == "tensorboard":
            import numpy as np

            from flywheel.video import probe_media, read_audio, read_mp4

            for i, p in enumerate(paths):
                frames = read_mp4(p)
                tracker.writer.add_image(f"{name}/{i}", np.concatenate(list(frames), axis=1), step,
                                         dataformats="HWC")
                if probe_media(p)["audio"] is not None:
                    audio, rate = read_audio(p)
                    tracker.writer.add_audio(f"{name}/{i}/audio", audio.mean(dim=0, keepdim=True).clamp(-1, 1),
                                             step, sample_rate=rate)


def end_trackers(accelerator) -> None:
    """`accelerator.end_training()`, with a trackio run finished once. accelerate's trackio tracker finishes its
    run object but leaves it as trackio's current run, and trackio's exit handler finishes the current run: the
    run ended twice ("Run finished. Uploading logs to Trackio (please wait...)" twice, and a second wait).
    `trackio.finish()` ends the current run and clears it; the tracker is then left out of end_training."""
    if any(t.name == "trackio" for t in accelerator.trackers) and _is_main_rank():
        import trackio

        trackio.finish()
        accelerator.trackers = [t for t in accelerator.trackers if t.name != "trackio"]
    accelerator.end_training()
