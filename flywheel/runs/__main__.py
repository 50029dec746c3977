"""`python -m flywheel.runs`: compare runs, list a folder of runs.

    python -m flywheel.runs compare RUN_DIR [RUN_DIR ...] [--out compare.png] [--json table.json] [--judge NAME]
                                    [--config-diff] [--no-plot]
    python -m flywheel.runs list [ROOT] [--max-depth N]

The reading, table and plot live in `flywheel.runs.compare`; this is only the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from flywheel.runs.compare import (LIST_MAX_DEPTH, RunDirError, compare, compare_table, config_diff_table, list_runs,
                                   list_table, load_runs, plot_runs, write_json)

USAGE_ERROR_EXIT = 2  # as argparse: what was asked for cannot be done as given


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flywheel.runs",
                                     description="Compare runs of any recipe, or list a folder of runs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{compare,list}")

    cmp = commands.add_parser("compare", help="a table of final/best eval reward, judge, diversity, wall time and "
                                              "steps, and a PNG of the curves, one line per run")
    cmp.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (the run_dir=... of a recipe)")
    cmp.add_argument("--out", default=None, metavar="PNG",
                     help="where to write the plot (default: compare.png in the current directory)")
    cmp.add_argument("--json", metavar="PATH", help="also write the table as JSON (a list of objects, one a run)")
    cmp.add_argument("--judge", metavar="NAME",
                     help="the judge to report (eval/judge/NAME/mean); default: each run's first judge")
    cmp.add_argument("--no-plot", action="store_true", help="print the table only (no matplotlib needed)")
    cmp.add_argument("--config-diff", action="store_true",
                     help="also print the config keys on which the runs differ (from each config.yaml, dotted "
                          "keys; run_dir left out): key | run1 | run2 ...")

    lst = commands.add_parser("list", help="the runs in a folder and its subfolders, most recently modified first")
    lst.add_argument("root", nargs="?", default="runs", metavar="ROOT",
                     help="the folder holding run directories, at any depth (default: runs)")
    lst.add_argument("--max-depth", type=int, default=LIST_MAX_DEPTH, metavar="N",
                     help=f"how many folder levels below ROOT to search (default: {LIST_MAX_DEPTH})")
    return parser


def check_output_file(value: str, flag: str) -> None:
    """A file this command writes at its end, checked before anything is read or printed: not a folder, and its
    folder (or the nearest one that exists, under which the rest is made) a writable folder."""
    path = Path(value)
    if not value.strip() or path.is_dir():
        raise RunDirError(f"{flag} {value!r} is a folder (or empty); give a file path")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise RunDirError(f"{flag} {value}: {folder} is a file, so no folder can be made there")
    try:  # a real write, removed: os.access says yes to root, and under /proc
        fd, probe = tempfile.mkstemp(prefix=".flywheel-probe-", dir=folder)
    except OSError as e:
        raise RunDirError(f"{flag} {value}: cannot write in {folder} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def run_compare(args: argparse.Namespace) -> None:
    if args.config_diff and len(args.runs) < 2:
        raise RunDirError(f"--config-diff compares the configs of two runs or more; got one: {args.runs[0]}")
    resolved = [os.path.realpath(r) for r in args.runs]
    twice = sorted({r for r, real in zip(args.runs, resolved) if resolved.count(real) > 1})
    if twice:
        raise RunDirError(f"{', '.join(twice)}: the same run is named more than once; name each run once")
    if args.no_plot and args.out is not None:
        raise RunDirError(f"--out {args.out} with --no-plot: no plot is written; give one of them")
    args.out = "compare.png" if args.out is None else args.out
    for flag, value in (("--json", args.json), ("--out", None if args.no_plot else args.out)):
        if value is not None:  # before the table: a bad path once left half the output and a temp file's name
            check_output_file(value, flag)
    runs = load_runs(args.runs)
    summaries = compare(runs, judge=args.judge)
    print(compare_table(summaries))
    if args.config_diff:
        print()
        print(config_diff_table(runs))
    if args.json:
        print(f"wrote {write_json(summaries, args.json)}")
    if not args.no_plot:
        print(f"wrote {plot_runs(runs, summaries, args.out)}")


def run_list(args: argparse.Namespace) -> None:
    if args.max_depth < 1:
        raise RunDirError(f"--max-depth {args.max_depth}: must be >= 1 (1 = only the folders directly in ROOT)")
    runs, notes = list_runs(args.root, args.max_depth)
    if runs:
        print(list_table(runs))
    else:
        print(f"no runs in {args.root}")
    for note in notes:
        print(note)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"compare": run_compare, "list": run_list}[args.command](args)
    except (RunDirError, OSError) as e:  # OSError: an output path that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
