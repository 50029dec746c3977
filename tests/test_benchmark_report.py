"""benchmarks/report.py, the report helper every benchmark script shares: its flags, its tables, its flat JSON,
and that every script in benchmarks/ goes through it."""

import argparse
import ast
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ holds scripts, not an installed package (they insert ROOT the same way)

from benchmarks.report import (Column, add_report_args, check_flat, format_metrics, format_table,  # noqa: E402
                               write_json)
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "report.py")


def test_report_args_parse_json_and_quick():
    parser = argparse.ArgumentParser()
    add_report_args(parser, quick="one round")
    args = parser.parse_args(["--json", "out/x.json", "--quick"])
    assert args.json == Path("out/x.json") and args.quick is True
    assert parser.parse_args([]).json is None and parser.parse_args([]).quick is False
    bare = argparse.ArgumentParser()
    add_report_args(bare, quick=None)
    assert not hasattr(bare.parse_args([]), "quick")
    with pytest.raises(SystemExit):
        bare.parse_args(["--quick"])


def test_table_lines_are_the_columns_formats():
    table = format_table([Column("mode", 6, align="<"), Column("steps/s", 9, ".3f"), Column("n", 4)],
                         [("sync", 1.23456, 3), ("async", None, 12)])
    assert table.splitlines() == [
        "mode    steps/s   n",
        "sync      1.235   3",
        "async         -  12",
    ]
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        format_table([Column("a", 3), Column("b", 3), Column("c", 3)], [(1, 2)])


def test_metrics_table_gives_floats_four_significant_digits():
    assert format_metrics({"step_s": 0.123456, "steps": 20, "card": "toy-digits"}, key_width=8).splitlines() == [
        "metric         value",
        "step_s        0.1235",
        "steps             20",
        "card      toy-digits",
    ]


def test_write_json_writes_a_flat_object_and_leaves_no_temporary_file(tmp_path):
    result = {"speedup": 1.5, "steps": 10, "card": "toy", "quick": True, "best": None, "seeds": [0, 1, 2],
              "never": "inf"}
    path = write_json(tmp_path / "sub" / "out.json", result)
    assert path == tmp_path / "sub" / "out.json"
    assert json.loads(path.read_text()) == result
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]
    assert write_json(None, result) is None


@pytest.mark.parametrize("value, message", [
    ({"a": 1}, "'bad' is a dict"),
    ([1, {"a": 1}], "'bad' is a dict"),
    (math.nan, "'bad' is nan"),
    (math.inf, "'bad' is inf"),
    ([1.0, -math.inf], "'bad' is -inf"),
    (Path("x"), "'bad' is a PosixPath"),
])
def test_write_json_refuses_what_is_not_flat_before_writing(tmp_path, value, message):
    path = tmp_path / "out.json"
    path.write_text("earlier\n")
    with pytest.raises(ValueError, match=message):
        write_json(path, {"ok": 1.0, "bad": value})
    assert path.read_text() == "earlier\n"


def test_a_key_must_be_a_string():
    with pytest.raises(ValueError, match="key 3 is not a string"):
        check_flat({3: 1.0})


def _calls(tree: ast.AST) -> set[str]:
    return {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_goes_through_the_report_helper(script):
    """Each script takes its --json / --quick flags from add_report_args and writes its JSON with write_json;
    none declares --json itself or dumps JSON to its output file by hand."""
    source = script.read_text()
    tree = ast.parse(source)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "benchmarks.report" for alias in node.names}
    assert {"add_report_args", "write_json"} <= imported, f"{script.name} does not import the report helper"
    assert {"add_report_args", "write_json"} <= _calls(tree)
    own_flags = [node.args[0].value for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and node.func.attr == "add_argument" and node.args and isinstance(node.args[0], ast.Constant)
                 and node.args[0].value in ("--json", "--quick")]
    assert own_flags == [], f"{script.name} declares {own_flags} itself"
    assert "json.dump(" not in source and ".write_text(json.dumps" not in source


def test_a_script_prints_its_table_and_writes_the_keys_it_returns(tmp_path, capsys):
    """reward_throughput end to end through the helper: the table on stdout, and the JSON file is the flat
    object main() returns, with the keys the script always wrote."""
    from benchmarks.reward_throughput import main

    out = main(["--reward", "jpeg_compressibility", "--batch", "4", "--size", "8", "--repeats", "1",
                "--json", str(tmp_path / "r.json")])
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split() == ["path", "images/s", "vs", "in-process"]
    assert [line.split()[0] for line in printed[2:]] == [k[: -len("_images_per_s")] for k in out
                                                          if k.endswith("_images_per_s")]
    written = json.loads((tmp_path / "r.json").read_text())
    assert written == out
    assert {"reward", "batch", "size", "in_process_images_per_s", "remote_safetensors_images_per_s",
            "remote_png_images_per_s", "remote_safetensors_max_abs_diff", "remote_png_max_abs_diff",
            "remote_safetensors_vs_in_process", "remote_png_vs_in_process"} <= set(written)
    assert written["remote_safetensors_max_abs_diff"] == 0.0  # exact float32 over safetensors


def test_the_shared_number_types_refuse_at_parse_time():
    import argparse

    from benchmarks.report import finite_float, int_at_least

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int_at_least(2))
    parser.add_argument("--target", type=finite_float)
    assert parser.parse_args(["--steps", "2", "--target", "0.5"]).steps == 2
    for argv in (["--steps", "1"], ["--steps", "x"], ["--target", "nan"], ["--target", "-inf"], ["--target", "a"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


@pytest.mark.parametrize("script, argv, why", [
    ("recipe_steps.py", ["--steps", "0"], "argument --steps: 0 must be >= 1"),  # was read as "the default"
    ("recipe_steps.py", ["--timeout", "-5"], "argument --timeout: -5 must be >= 1"),
    ("recipe_steps.py", ["--in-process", "--timeout", "5"], "--in-process runs them in this one"),
    ("step_breakdown.py", ["--steps", "1"], "argument --steps: 1 must be >= 2"),  # crashed after training
    ("step_breakdown.py", ["--", "run_dir=/tmp/x"], "the benchmark sets run_dir, steps, resume, overwrite itself"),
    ("step_breakdown.py", ["--", "nosuch=1"], "the overrides: unknown config key 'nosuch'"),  # was a traceback
    ("engine_throughput.py", ["--batch", "0"], "argument --batch: 0 must be >= 1"),
])
def test_benchmarks_refuse_bad_numbers_and_overrides_before_any_work(script, argv, why):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / script), *argv], cwd=root, capture_output=True,
                          text=True, timeout=120, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and why in done.stderr and "Traceback" not in done.stderr, done.stderr[-1500:]
