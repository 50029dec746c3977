"""A Ctrl-C that no code catches ends a recipe's script with one line, not a traceback.

flywheel.cli.run_main turns a Ctrl-C during a run into the line that says what
is kept. Before it runs, the script spends seconds importing torch and
diffusers, and a Ctrl-C there (the usual moment to stop a run started with the
wrong config) printed a traceback into whichever module was loading. The
recipes call `install(__name__)` first, before torch: when the file runs as a
script, an uncaught KeyboardInterrupt prints the interrupted-run line instead.
The process still ends as Python ends it on Ctrl-C (by SIGINT, exit status 130
in a shell), after its exit handlers. Imported as a module (tests, a notebook)
the hook is not installed: a REPL's Ctrl-C stays its own.

Nothing heavy is imported here: this runs before torch loads.
"""

from __future__ import annotations

import sys

_installed = False


def install(module_name: str) -> bool:
    """Install the hook when `module_name` is "__main__" (the recipe runs as a script); True if installed."""
    global _installed
    if module_name != "__main__" or _installed:
        return False
    previous = sys.excepthook

    def hook(kind, value, tb):
        if not issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, tb)
        print(interrupted_line(), file=sys.stderr, flush=True)

    sys.excepthook = hook
    _installed = True
    return True


def interrupted_line() -> str:
    """What an uncaught Ctrl-C says: before the recipe opened its run directory, nothing was written; after (a
    second Ctrl-C while the first one's line was being made), the same line as flywheel.cli's."""
    cli = sys.modules.get("flywheel.cli")  # loaded with torch; not imported here for the early case
    run_dir = getattr(cli, "_opened_run_dir", None)
    if cli is None or run_dir is None:
        return "interrupted (Ctrl-C) before the run directory was created: nothing was written"
    try:
        return cli.interrupted_message("Ctrl-C", run_dir, sys.argv[0])
    except BaseException:  # noqa: BLE001  another Ctrl-C, or an unreadable run dir: still one line
        return f"interrupted (Ctrl-C): see {run_dir} for what was kept"
