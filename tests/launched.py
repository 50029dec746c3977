"""Run a command that starts processes of its own (accelerate's launcher and its ranks, ray) so that a timeout
kills all of them: subprocess.run kills only the launcher, and its ranks went on holding the cores and the port
for the rest of the suite."""

from __future__ import annotations

import os
import signal
import subprocess


def run_process_group(cmd: list[str], *, timeout: float, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, timeout=timeout, **kwargs) in a session of its own, whose whole process group is
    killed when the timeout passes (then TimeoutExpired is raised, as subprocess.run raises it)."""
    with subprocess.Popen(cmd, start_new_session=True, **_pipes(kwargs)) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.communicate()
            raise
        except BaseException:  # KeyboardInterrupt and the like: leave no rank behind either
            kill_group(proc)
            raise
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process of `proc`'s group (its session: start_new_session made it the leader)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pipes(kwargs: dict) -> dict:
    """subprocess.run's capture_output as Popen's pipes."""
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    return kwargs
