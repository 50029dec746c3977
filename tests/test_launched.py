"""The launcher helper of the multi-process tests kills a timed-out command's children too."""

import os
import subprocess
import sys
import time

import pytest

from launched import run_process_group

# The command starts a child (as accelerate's launcher starts its ranks), says the child's pid, and waits.
PARENT = ("import subprocess, sys, time; "
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
          "print(child.pid, flush=True); time.sleep(120)")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of an exited parent is reaped by init; one still listed as a zombie is dead too.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_a_timeout_kills_the_commands_children_not_only_the_command(tmp_path):
    out = tmp_path / "pid.txt"
    with open(out, "w") as f, pytest.raises(subprocess.TimeoutExpired):
        run_process_group([sys.executable, "-c", PARENT], timeout=3, stdout=f)
    child = int(out.read_text().split()[0])
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_a_finished_command_returns_as_subprocess_run_does():
    result = run_process_group([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"], timeout=30,
                               capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (3, "hi\n")
    with pytest.raises(subprocess.CalledProcessError):
        run_process_group([sys.executable, "-c", "raise SystemExit(1)"], timeout=30, check=True, capture_output=True)
