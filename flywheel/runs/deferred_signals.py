"""Ctrl-C and SIGTERM held back while a checkpoint is written, so that the checkpoint is not lost with them.

A Ctrl-C that lands inside `save_checkpoint` used to abandon the checkpoint half-written: its temporary folder
is discarded, the run stops, and a resume goes back to the checkpoint before it (exact, but those steps are
trained again). Inside `signals_deferred(what)`, the first SIGINT or SIGTERM prints one line saying the
signal waits for `what`, and is delivered once the block ends, by the handler that was installed before it
(KeyboardInterrupt for Ctrl-C, flywheel.cli's SystemExit(143) for SIGTERM, or the default action). A second
signal inside the block is not held: it goes to that handler at once, for a user who will not wait.

Only the main thread can install handlers; elsewhere the block runs with the signals as they are.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

DEFERRED = (signal.SIGINT, signal.SIGTERM)
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@contextlib.contextmanager
def signals_deferred(what: str) -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends (see the module's docstring); `what` names the work."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in DEFERRED}
    held: list[int] = []

    def hold(signum, frame):
        if held:  # a second signal: not held (restore the handlers first, so the one it reaches is theirs)
            _restore(previous)
            _deliver(signum, previous[signum], frame)
            return
        held.append(signum)
        print(f"{NAMES[signum]}: finishing {what} first (again to stop at once)", file=sys.stderr, flush=True)

    for signum in DEFERRED:
        signal.signal(signum, hold)
    try:
        yield
    finally:
        _restore(previous)
    if held:
        _deliver(held[0], previous[held[0]], None)


def _restore(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _deliver(signum: int, handler, frame) -> None:
    """What the signal would have done without the block: its handler called, or its default action."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL or handler is None:
        os.kill(os.getpid(), signum)  # the handlers are restored: the default action (a SIGTERM ends the process)
    # SIG_IGN: ignored, as it would have been
