"""The suite runs however it is started: `venv/bin/python -m pytest` without activating the venv puts none of
the venv's console scripts (accelerate, ray, wandb, pytest, ...) on PATH, so no test or benchmark may start
one by name; they run the interpreter that runs them (`sys.executable -m accelerate.commands.launch`)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPTS = {"accelerate", "ray", "wandb", "python", "python3", "pytest", "torchrun", "tensorboard",
                   "huggingface-cli", "hf", "pip", "flywheel"}
SUBPROCESS_CALLS = {"run", "Popen", "call", "check_call", "check_output"}


def programs_started_by_name(source: str) -> list[tuple[int, str]]:
    """(line, program) of each subprocess call whose command list starts with one of CONSOLE_SCRIPTS."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in SUBPROCESS_CALLS and node.args):
            continue
        command = node.args[0]
        first = command.elts[0] if isinstance(command, ast.List) and command.elts else command
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            program = first.value.split()[0] if first.value.split() else ""
            if Path(program).name in CONSOLE_SCRIPTS:
                found.append((node.lineno, program))
    return found


def test_the_check_finds_a_launcher_started_from_path():
    assert programs_started_by_name('subprocess.run(["accelerate", "launch", "x.py"])') == [(1, "accelerate")]
    assert programs_started_by_name('subprocess.Popen("ray start --head", shell=True)') == [(1, "ray")]
    assert programs_started_by_name('subprocess.run([sys.executable, "-m", "accelerate.commands.launch"])') == []


def test_no_test_or_benchmark_starts_a_console_script_by_name():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {program}"
                 for folder in ("tests", "benchmarks", "scripts") for path in sorted((ROOT / folder).rglob("*.py"))
                 for line, program in programs_started_by_name(path.read_text())]
    assert not offenders, f"started from PATH (use sys.executable -m ...): {offenders}"
