"""Experiment tracking through accelerate's trackers (wandb by default, TensorBoard, or none).

wandb runs offline when no account is configured (no WANDB_API_KEY and no
api.wandb.ai entry in ~/.netrc), so a first run never blocks on a login and
its files land in the run directory for a later `wandb sync`; the run says so
in one line, with that command. TensorBoard (accelerate's tracker) writes into
`<run_dir>/<project>/` (`project` defaults to "flywheel").
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os
from pathlib import Path

TRACKERS = ("wandb", "tensorboard", "none")

log = logging.getLogger(__name__)


def wandb_account_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def prepare_tracker(tracker: str, run_dir: Path) -> dict:
    """Environment and init kwargs for `Accelerator.init_trackers`; call before creating trackers."""
    if tracker not in TRACKERS:
        raise ValueError(f"tracker={tracker!r} is not known; valid trackers: {', '.join(TRACKERS)}")
    if tracker == "tensorboard" and importlib.util.find_spec("tensorboard") is None \
            and importlib.util.find_spec("tensorboardX") is None:
        raise ModuleNotFoundError("tracker=tensorboard needs the tensorboard package: `pip install tensorboard`, "
                                  "or use tracker=wandb / tracker=none")
    if tracker == "wandb":
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
        return {"wandb": {"dir": str(run_dir), "name": run_dir.name}}
    return {}


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


def log_videos(accelerator, name: str, paths: list, step: int, fps: int = 16) -> None:
    """Log MP4 files (see `flywheel.video.write_mp4`) to whichever trackers are active.

    wandb gets the MP4 files as they are, so a clip written with its audio
    plays with sound there. TensorBoard (whose video summaries need moviepy)
    gets each video's frames side by side as one image, and its sound, when the
    file has any, as an audio summary `<name>/<i>/audio` (channels averaged: it
    plays mono). `fps` is unused: the file carries its frame rate (kept for callers).
    """
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
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
