"""Merge the GPU suite's parts into one flat JSON: `python benchmarks/gpu_suite_merge.py OUT_DIR PART... [--json P]`.

Each part of benchmarks/gpu_suite.sh writes OUT_DIR/<part>.json (a flat object) and OUT_DIR/<part>.status
("<exit code> <seconds>"). The merged OUT_DIR/gpu_suite.json holds every part's keys prefixed with its name
(`rollout.engine_overhead_eager`), and per part `<part>.ok` (exit 0 and its JSON written), `<part>.exit`
(124: its timeout ran out), `<part>.seconds` and `<part>.error` when it failed; `parts_ok` counts the parts
that passed and `all_ok` says whether every one did.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import add_report_args, check_flat, write_json  # noqa: E402


def read_part(out: Path, part: str) -> dict:
    """One part's prefixed keys and its status keys."""
    status_file, json_file = out / f"{part}.status", out / f"{part}.json"
    code, seconds = (status_file.read_text().split() + ["", ""])[:2] if status_file.is_file() else ("", "")
    merged: dict = {f"{part}.exit": int(code) if code.lstrip("-").isdigit() else None,
                    f"{part}.seconds": float(seconds) if seconds else None}
    error = None
    if not json_file.is_file():
        error = "no JSON written" + (" (its timeout ran out)" if code == "124" else "")
    else:
        try:
            values = json.loads(json_file.read_text())
            check_flat(values)
            merged.update({f"{part}.{key}": value for key, value in values.items()})
        except (ValueError, TypeError) as exc:
            error = f"unreadable JSON: {exc}"[:300]
    if error is None and merged[f"{part}.exit"] != 0:
        error = f"exit {merged[f'{part}.exit']}"
    merged[f"{part}.ok"] = error is None
    if error is not None:
        merged[f"{part}.error"] = error
    return merged


def merge(out: Path, parts: list[str]) -> dict:
    result: dict = {"parts": list(parts)}
    for part in parts:
        result.update(read_part(out, part))
    result["parts_ok"] = sum(bool(result[f"{p}.ok"]) for p in parts)
    result["all_ok"] = result["parts_ok"] == len(parts)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder the parts wrote into")
    parser.add_argument("parts", nargs="+", help="the parts, in the order they ran")
    add_report_args(parser, quick=None, json_help="the merged JSON (default OUT/gpu_suite.json)")
    args = parser.parse_args(argv)
    result = merge(args.out, args.parts)
    write_json(args.json or args.out / "gpu_suite.json", result)
    for part in args.parts:
        state = "ok" if result[f"{part}.ok"] else f"FAILED ({result[f'{part}.error']})"
        print(f"{part:<12} {state}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
