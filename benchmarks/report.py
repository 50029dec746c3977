"""What every benchmark script shares: its --json / --quick flags, the table it prints, the flat JSON it writes.

    parser = argparse.ArgumentParser(...)
    add_report_args(parser, quick="6 steps (under a minute)")
    ...
    print_table([Column("mode", 16, align="<"), Column("steps/s", 9, ".3f")], rows)   # or print_metrics(result)
    write_json(args.json, result)

A flat JSON object is one level of string keys whose values are numbers, strings, booleans or null (or a list
of those, one entry per seed or recipe), so any two runs' files compare key by key (`docs/benchmarks.md`
quotes them). `write_json` refuses anything else,
naming the key, before it writes, and replaces the file in one rename so a killed run leaves no half file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

JSON_HELP = "write the results as a flat JSON object here"


def writable_file(value: str) -> Path:
    """An argparse type for a file the script writes at its end: refused at parse time, before any work, when it
    is a folder, or when the folder it would go in is a file or cannot be written (a missing folder is made)."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a folder; give a file path")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: {folder} is a file, so no folder can be made there")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{value}: {folder} is not writable")
    return path


def int_at_least(low: int):
    """An argparse type: an integer >= `low`, refused at parse time naming the bound (not a traceback from the
    benchmark's middle, or a 0 quietly read as "the default")."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"{number} must be >= {low}")
        return number
    parse.__name__ = f"integer >= {low}"  # argparse names the type in its message
    return parse


def finite_float(value: str) -> float:
    """An argparse type: a finite number (NaN compares false with everything, so a NaN bound passes no test)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number")
    return number


def add_report_args(parser: argparse.ArgumentParser, *, quick: str | None, json_help: str = JSON_HELP) -> None:
    """Add `--json PATH` (checked writable at parse time: `writable_file`) and, unless `quick` is None, `--quick`
    (its help says what the quick run cuts)."""
    parser.add_argument("--json", type=writable_file, metavar="PATH", help=json_help)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)


@dataclass(frozen=True)
class Column:
    """One column of a printed table: its title, width, the format of its values and their alignment."""

    title: str
    width: int
    fmt: str = ""
    align: str = ">"

    def cell(self, value: Any) -> str:
        if value is None:
            value, fmt = "-", ""
        else:
            fmt = self.fmt if not isinstance(value, str) else ""
        return f"{value:{self.align}{self.width}{fmt}}"

    def header(self) -> str:
        return f"{self.title:{self.align}{self.width}}"


def format_table(columns: Sequence[Column], rows: Iterable[Sequence[Any]]) -> str:
    """A header line and one line per row; None prints as '-'."""
    lines = ["".join(c.header() for c in columns)]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a row has {len(row)} cells for {len(columns)} columns: {row!r}")
        lines.append("".join(c.cell(v) for c, v in zip(columns, row)))
    return "\n".join(lines)


def print_table(columns: Sequence[Column], rows: Iterable[Sequence[Any]]) -> None:
    print(format_table(columns, rows))


def format_metrics(result: Mapping[str, Any], key_width: int = 36, value_width: int = 12) -> str:
    """A two-column metric / value table of a flat result: floats with 4 significant digits, the rest as is."""
    lines = [f"{'metric':<{key_width}}{'value':>{value_width}}"]
    for key, value in result.items():
        text = f"{value:>{value_width}.4g}" if isinstance(value, float) else f"{value!s:>{value_width}}"
        lines.append(f"{key:<{key_width}}{text}")
    return "\n".join(lines)


def print_metrics(result: Mapping[str, Any], key_width: int = 36, value_width: int = 12) -> None:
    print(format_metrics(result, key_width, value_width))


SCALARS = (bool, int, float, str, type(None))


def _check_scalar(key: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"benchmark result {key!r} is {value}: write a string (\"inf\") or null instead, "
                         f"since JSON has no non-finite numbers")
    if not isinstance(value, SCALARS):
        raise ValueError(f"benchmark result {key!r} is a {type(value).__name__}: a flat JSON object holds only "
                         f"numbers, strings, booleans, null and lists of those (give each entry its own key)")


def check_flat(result: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first key that is not a string or whose value is neither a finite scalar
    nor a list (or tuple) of finite scalars."""
    for key, value in result.items():
        if not isinstance(key, str):
            raise ValueError(f"benchmark result key {key!r} is not a string")
        for item in value if isinstance(value, (list, tuple)) else [value]:
            _check_scalar(key, item)


def write_json(path: str | os.PathLike | None, result: Mapping[str, Any], indent: int = 2) -> Path | None:
    """Write `result` as a flat JSON object to `path` (nothing when path is None); returns the path written."""
    if path is None:
        return None
    check_flat(result)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dict(result), indent=indent, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
