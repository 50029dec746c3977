"""Running a recipe's main from the command line: config errors as one clear message, clean exits.

A bad config raises ConfigError before any work starts. Printed as a plain
message (no traceback) it is the last thing the user sees with `python
trainers/<recipe>.py`; under `accelerate launch`, the launcher answers a
child's non-zero exit with a traceback of its own (CalledProcessError, or
torchrun's ChildFailedError table) printed after the child's output. So there
the message is printed again once the launcher has exited, by a small forked
process that waits for it: the launcher's traceback cannot be suppressed from
the child, and repeating the message after it is what keeps it last.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

from flywheel.config.parsing import ConfigError
from flywheel.guards import RunStoppedError
from flywheel.runs.rundir import RunDirInUseError



class NothingTrainedError(RuntimeError):
    """A run that ended with everything saved but took no optimizer step: its weights are the ones it
    started from. `summary` is what the recipe's main would have returned."""

    def __init__(self, message: str, summary: dict | None = None):
        super().__init__(message)
        self.summary = summary or {}


# Errors that say the command line was wrong: shown as a message, not a traceback.
USAGE_ERRORS = (ConfigError, RunDirInUseError)

CONFIG_ERROR_EXIT = 2  # as argparse: the command line was wrong
NOTHING_TRAINED_EXIT = 3  # the run went through, saved, and trained nothing
RUN_STOPPED_EXIT = 1  # the run stopped itself at a step (RunStoppedError): an error, as an uncaught exception's
_LAUNCHER_WAIT_S = 60.0
_WAITER_READY_S = 5.0  # at most this long for the forked waiter to leave the rank's session
_OTHER_RANKS_EXIT_DELAY_S = 0.5


def _under_accelerate_launch() -> bool:
    return "ACCELERATE_DYNAMO_BACKEND" in os.environ  # set by `accelerate launch` for every launcher kind


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def _process_alive(pid: int) -> bool:
    """Whether `pid` still runs. An exited launcher stays a zombie until its own parent reaps it, and that parent
    (a shell's pipe, subprocess.run) often waits first for stderr's end, which the waiting process below holds
    open: signal 0 reaches a zombie, so on Linux /proc's state tells them apart."""
    if not os.path.exists("/proc/self/stat"):  # no /proc (macOS): signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # the state follows the (command name)
    except FileNotFoundError:
        return False


def _repeat_after_launcher(message: str) -> None:
    """Fork a process that prints `message` to stderr once our parent (the launcher) has exited."""
    launcher = os.getppid()
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    if os.fork() != 0:
        # Returns once the waiter has its own session, so that a killpg from here on cannot reach it.
        os.close(ready_w)
        select.select([ready_r], [], [], _WAITER_READY_S)
        os.close(ready_r)
        return
    try:
        # torchrun starts each rank in a session of its own and stops a rank still running when another has
        # failed with killpg: a session of our own keeps that from taking the repeat with it (a CI run lost the
        # message this way, rank 1 having exited first).
        os.close(ready_r)
        os.setsid()
        os.write(ready_w, b"1")
        os.close(ready_w)
        deadline = time.monotonic() + _LAUNCHER_WAIT_S
        while time.monotonic() < deadline and _process_alive(launcher):
            time.sleep(0.02)
        os.write(2, message.encode() + b"\n")
    finally:
        os._exit(0)


@contextlib.contextmanager
def sigterm_as_exit():
    """Inside the block, SIGTERM raises SystemExit(143) instead of ending the process on the spot.

    SIGTERM (`kill`, a job scheduler's stop) then unwinds like Ctrl-C does:
    `finally` clauses and context managers run, so the trainer closes its
    engine process and unlinks its shared memory itself. Only the main thread
    can install a handler; called from another thread this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# What holds a multi-process run's gloo process group (the DDP-wrapped transformer, whose reducer holds it), kept
# until the process ends. Freeing it is unsafe: the reducer's destructor joins gloo's worker threads while holding
# the GIL, and a worker still freeing the last barrier's tensors waits for that GIL, so the rank hangs after a
# finished run (3 of 24 two-process FSDP-config runs on a loaded 2-core machine; none of 65 once kept). A rank
# therefore leaves with os._exit once everything is flushed, without ever freeing it.
_kept_until_exit: list = []


def keep_until_exit(obj) -> None:
    """Keep `obj` (what holds a multi-process run's process group) alive until this process exits."""
    _kept_until_exit.append(obj)


def _distributed_rank() -> bool:
    return bool(_kept_until_exit) or (torch.distributed.is_available() and torch.distributed.is_initialized())


def _leave_rank(code: int) -> None:
    """End a rank of a multi-process run: the exit handlers (logging, trackers) as at a normal exit, a flush,
    then os._exit (the process group is never freed, see above)."""
    atexit._run_exitfuncs()  # CPython's own exit-handler run (os._exit skips it); each handler's error is printed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _end_interrupted(how: str, code: int) -> None:
    """Exit with `code` after the interrupted run's one line (rank 0), interpreter shutdown included (trackers
    flush at exit)."""
    if _is_rank_zero():
        print(interrupted_message(how, _opened_run_dir, sys.argv[0]), file=sys.stderr, flush=True)
    if _distributed_rank():
        _leave_rank(code)
    raise SystemExit(code) from None


def _end_stopped(message: str) -> None:
    """Exit RUN_STOPPED_EXIT after the stopped run's message and what it kept (rank 0; every rank stops alike)."""
    _ignore_the_launchers_sigterm()  # its trackers still flush at exit
    if _is_rank_zero():
        message = f"{message}\n{kept_message(_opened_run_dir, sys.argv[0])}"
        print(message, file=sys.stderr, flush=True)
        if _under_accelerate_launch():
            _repeat_after_launcher(message)
    if _distributed_rank():
        _leave_rank(RUN_STOPPED_EXIT)
    raise SystemExit(RUN_STOPPED_EXIT) from None


def _ignore_the_launchers_sigterm() -> None:
    """A rank on its way out ignores SIGTERM. When another rank has exited first, torchrun stops the rest with
    SIGTERM; one arriving now would end this rank before its message is printed, or with -15 instead of its
    own exit code. SIGKILL still follows after the launcher's 30 s, should a rank hang."""
    if _under_accelerate_launch() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _exit_with_message(message: str, code: int) -> None:
    """Print `message` as the last line (rank 0; again after the launcher's traceback) and exit with `code`."""
    _ignore_the_launchers_sigterm()
    if _is_rank_zero():
        print(message, file=sys.stderr, flush=True)
        if _under_accelerate_launch():
            _repeat_after_launcher(message)
    elif _under_accelerate_launch():
        # Every rank raises the same error; the others leave a moment after the main one, so that the launcher
        # sees the main rank's exit first and its table names the main rank as the root cause.
        time.sleep(_OTHER_RANKS_EXIT_DELAY_S)
    sys.stdout.flush()
    os._exit(code)


# The run directory the recipe opened (the main process's), for the line an interrupted run ends on.
_opened_run_dir: str | None = None


def note_run_dir(path) -> None:
    """Called once the recipe has created or taken over its run directory."""
    global _opened_run_dir
    _opened_run_dir = str(path)


def kept_message(run_dir: str | None, script: str) -> str:
    """After a run stopped itself: the newest checkpoint (written before the step that stopped it) and how to go
    on from it."""
    if run_dir is None:
        return "the run directory was not created: nothing was written"
    from flywheel.runs.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run_dir)
    if latest is None:
        return f"no checkpoint was written yet in {run_dir}; start again with overwrite=true after the change"
    return f"the newest checkpoint is {latest}; continue from it after the change with `python {script} resume={run_dir}`"


def interrupted_message(how: str, run_dir: str | None, script: str) -> str:
    """The one line a run stopped by Ctrl-C or SIGTERM ends on: what is kept and how to go on."""
    if run_dir is None:
        return f"interrupted ({how}) before the run directory was created: nothing was written"
    from flywheel.runs.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run_dir)
    if latest is None:
        return (f"interrupted ({how}): no checkpoint was written yet in {run_dir}; start again with "
                f"overwrite=true")
    return (f"interrupted ({how}): the newest checkpoint is {latest}; continue with "
            f"`python {script} resume={run_dir}`")


def disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is ENOSPC: an OSError with that errno, or safetensors'
    SafetensorError, which carries the OS error only in its text ("No space left on device (os error 28)")."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if type(error).__name__ == "SafetensorError" and f"(os error {errno.ENOSPC})" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


# The OS errors that say the run directory cannot be written: no permission (EPERM is also an immutable file's),
# a read-only file system, a quota; each a fault of where the run writes, not of the run.
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.EDQUOT)


def run_dir_unwritable(error: BaseException, run_dir: str | None) -> tuple[OSError, str] | None:
    """(the OSError, the path) when `error`, or one it was raised from, refused a write to a path inside
    `run_dir` (EACCES, EPERM, EROFS, EDQUOT), else None. A refused path elsewhere (a model folder, a prompts
    file) is not the run directory's fault and keeps its traceback."""
    if run_dir is None:
        return None
    root = os.path.realpath(run_dir)
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _UNWRITABLE:
            for name in (error.filename, error.filename2):
                if name is not None and os.path.realpath(os.fsdecode(name)).startswith(root + os.sep):
                    return error, os.fsdecode(name)
        error = error.__cause__ or error.__context__
    return None


def run_main(main: Callable[[], object]) -> None:
    """Call a recipe's `main()`; exit 2 with the message alone on a usage error (a bad config, a used run
    dir, a refused resume), 3 when the run trained nothing (everything saved); leave gloo ranks cleanly."""
    try:
        with sigterm_as_exit():  # `kill` unwinds like Ctrl-C: the recipe closes its engine process itself
            main()
    except USAGE_ERRORS as e:
        _exit_with_message(f"error: {e}", CONFIG_ERROR_EXIT)
    except NothingTrainedError as e:
        _exit_with_message(f"error: {e}", NOTHING_TRAINED_EXIT)
    except RunStoppedError as e:
        # The guard's message names the step and why; a traceback into the guard would add nothing. What is kept
        # follows, as for an interrupted run. Trackers and logging flush at exit, as after any error.
        _end_stopped(f"error: {e}")
    except KeyboardInterrupt:
        # The recipe's context managers have run (engine process closed, shared memory unlinked): a traceback
        # into whichever forward was running tells the user nothing; what is kept, and the resume line, do.
        _end_interrupted("Ctrl-C", 130)
    except SystemExit as e:
        if e.code != 128 + signal.SIGTERM:
            raise
        _end_interrupted("SIGTERM", e.code)
    except Exception as e:
        if disk_full(e):
            # Every write of the run dir is atomic (temporary name, then rename): what was written before is
            # whole, so the line says where space ran out and how to go on, not a traceback into safetensors.
            where = (f"the device of the run directory ({_opened_run_dir})" if _opened_run_dir is not None
                     else "a device this run writes to")
            _end_stopped(f"error: no space left on {where}: {' '.join(str(e).split())}; free space there or "
                         "give another run_dir")
        refused = run_dir_unwritable(e, _opened_run_dir)
        if refused is not None:
            # As for a full disk: the writes before this one are whole, so say which path and why, and go on.
            refused, name = refused
            _end_stopped(f"error: cannot write {name} in the run directory: {refused.strerror} "
                         f"({errno.errorcode[refused.errno]}); make {_opened_run_dir} writable again and resume, "
                         "or give another run_dir")
        if not _distributed_rank():
            raise
        traceback.print_exc()  # as the interpreter would, then leave without freeing the process group
        _leave_rank(1)
    if _distributed_rank():
        _leave_rank(0)
