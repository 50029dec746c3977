"""Test helper: start a recipe as its own process and SIGKILL it once a given checkpoint is on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kill_after_checkpoint(recipe: str, run_dir: Path, args: list[str], step: int = 2, timeout_s: float = 300) -> None:
    """Run `python trainers/<recipe>.py run_dir=<run_dir> *args` and kill -9 it when step_<step> is saved."""
    cmd = [sys.executable, str(ROOT / "trainers" / f"{recipe}.py"), f"run_dir={run_dir}", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "checkpoints" / f"step_{step:06d}").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
