"""A multi-rank run that exits with a message keeps the message last, whatever order torchrun's agent sees the
ranks leave in. The agent starts each rank in a session of its own and, once one rank has failed, stops every
rank still running with killpg(SIGTERM): these tests stand in for it with a small launcher of the same shape.
(CI once lost the repeated `error:` line this way: rank 1 had left first, and the SIGTERM to rank 0's session took
the process that waits to repeat it.)"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "ACCELERATE_DYNAMO_BACKEND": "no"}

# The launcher: starts the rank in a new session, as torchrun does; once the rank says it is ready, waits
# `sys.argv[2]` seconds, stops the rank's session with SIGTERM, waits for it, and prints its own table line last.
LAUNCHER = """
import os, signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True,
                        start_new_session=True)
assert rank.stdout.readline().strip() == "ready"
time.sleep(float(sys.argv[2]))
os.killpg(rank.pid, signal.SIGTERM)
code = rank.wait()
print(f"launcher table: rank exitcode {code}", file=sys.stderr, flush=True)
"""


def launch(rank_code: str, wait_s: float, rank: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LAUNCHER, rank_code, str(wait_s)], cwd=ROOT,
                          env={**ENV, "RANK": str(rank)}, capture_output=True, text=True, timeout=120)


def test_the_repeat_outlives_a_sigterm_to_the_ranks_session_and_comes_after_the_launchers_table():
    # The rank forks its waiter, then is stopped by the launcher while it still runs (as rank 0 is when rank 1
    # has left first).
    out = launch("import sys, time; from flywheel import cli; cli._repeat_after_launcher('error: the message'); "
                 "print('ready', flush=True); time.sleep(60)", wait_s=0.0, rank=0)
    lines = out.stderr.strip().splitlines()
    assert lines[-2] == f"launcher table: rank exitcode {-15}"  # the launcher's SIGTERM did end the rank
    assert lines[-1] == "error: the message"


def test_a_rank_leaving_with_a_message_keeps_its_exit_code_through_the_launchers_sigterm():
    # A rank other than the main one waits a moment before leaving; the launcher's SIGTERM meanwhile (sent once
    # the main rank has failed) must not turn its exit code 2 into -15.
    out = launch("from flywheel import cli; cli._OTHER_RANKS_EXIT_DELAY_S = 3.0; print('ready', flush=True); "
                 "cli._exit_with_message('error: the message', 2)", wait_s=1.0, rank=1)
    assert out.stderr.strip().splitlines() == ["launcher table: rank exitcode 2"]  # and rank 1 prints nothing

