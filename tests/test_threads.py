"""A recipe's CPU threads: the user's setting wins, the per-rank division is only the default.

A run on a shared machine that asked for one thread (OMP_NUM_THREADS=1, or
`threads=1`) must not be given every core behind its back.
"""

import io
import os
from unittest import mock

import pytest
import torch

from flywheel.recipe.threads import THREADS_ENV, rank_threads
from flywheel.runs.config import ConfigError, parse_config
from trainers.grpo import Config, validate_config


@pytest.fixture
def torch_threads():
    """Set torch's thread count for a test and give the session's back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_the_threads_key_wins_over_everything(torch_threads):
    torch_threads(1)
    with mock.patch("os.cpu_count", return_value=8):
        assert rank_threads(3, ranks=2, environ={THREADS_ENV: "1"}) == 3
        assert rank_threads(5, ranks=1, environ={}) == 5


def test_omp_num_threads_from_the_environment_is_honoured(torch_threads):
    with mock.patch("os.cpu_count", return_value=8):
        torch_threads(1)  # what torch starts with under OMP_NUM_THREADS=1
        assert rank_threads(None, ranks=1, environ={THREADS_ENV: "1"}) == 1
        assert rank_threads(0, ranks=1, environ={THREADS_ENV: "1"}) == 1
        torch_threads(4)  # more than cores // ranks: the user asked for it, it is kept
        assert rank_threads(None, ranks=4, environ={THREADS_ENV: "4"}) == 4


def test_without_a_setting_the_cores_are_divided_among_the_ranks(torch_threads):
    with mock.patch("os.cpu_count", return_value=8):
        torch_threads(8)
        assert rank_threads(None, ranks=1, environ={}) == 8
        assert rank_threads(None, ranks=2, environ={}) == 4
        assert rank_threads(None, ranks=3, environ={}) == 2
        assert rank_threads(None, ranks=16, environ={}) == 1  # never 0
        torch_threads(2)  # a caller that lowered torch's threads first keeps its count
        assert rank_threads(None, ranks=1, environ={}) == 2
        assert rank_threads(None, ranks=8, environ={}) == 1
    with mock.patch("os.cpu_count", return_value=None):  # unknown cores: one thread per rank
        assert rank_threads(None, ranks=1, environ={}) == 1


def test_a_recipe_run_applies_the_threads_key_and_the_environment(tmp_path, torch_threads, monkeypatch):
    from flywheel.recipe.session import RecipeRun

    def threads_after_start(*overrides: str) -> int:
        cfg = parse_config(Config, [f"run_dir={tmp_path / str(len(os.listdir(tmp_path)))}", "tracker=none",
                                    *overrides])
        validate_config(cfg)
        RecipeRun(cfg, recipe="grpo")
        return torch.get_num_threads()

    monkeypatch.delenv(THREADS_ENV, raising=False)
    with mock.patch("os.cpu_count", return_value=4):
        torch_threads(4)
        assert threads_after_start("threads=3") == 3
        torch_threads(4)
        assert threads_after_start() == 4  # one process: every core
        monkeypatch.setenv(THREADS_ENV, "1")
        torch_threads(1)
        assert threads_after_start() == 1  # the code before this gave a run under OMP_NUM_THREADS=1 every core


@pytest.mark.parametrize("value", ["-1", "-8"])
def test_a_negative_threads_key_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match=rf"threads={value}: must be an integer >= 0 or null"):
        validate_config(parse_config(Config, [f"threads={value}"]))


def test_threads_zero_and_null_mean_auto():
    for value in ("0", "null"):
        validate_config(parse_config(Config, [f"threads={value}"]))
    with pytest.raises(ConfigError, match="threads"):
        parse_config(Config, ["threads=two"])


@pytest.mark.parametrize("threads", [1, 2])
def test_an_engine_process_starts_on_the_thread_count_of_its_parent(torch_threads, threads, monkeypatch):
    """Bitwise parity of its rollouts with a local Engine's needs the same count (CPU kernels round by it)."""
    from flywheel.sync import engine_process

    started = []

    class NotServing:  # the process exits before its port line: start() raises after recording the command
        def __init__(self, cmd, **kwargs):
            started.append(cmd)
            self.stdout, self.returncode = io.StringIO(""), 1  # no line at all

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(engine_process.subprocess, "Popen", NotServing)
    torch_threads(threads)
    for asked, expected in ((None, threads), (3, 3)):
        with pytest.raises(RuntimeError, match="exited with code 1 before serving"):
            engine_process.EngineProcess.start("toy-digits", threads=asked)
        cmd = started.pop()
        assert cmd[cmd.index("--threads") + 1] == str(expected)


# --- OpenMP's idle threads sleep unless the user chose -------------------------------------------

def spin_count_seen_by_openmp(code: str, **env: str) -> str:
    """GNU OpenMP's spin count in a fresh interpreter that runs `code` (libgomp prints it as it loads)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from flywheel.openmp_env import WAIT_ENV_KEYS

    clean = {k: v for k, v in os.environ.items() if k not in WAIT_ENV_KEYS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1], env={**clean, "OMP_DISPLAY_ENV": "verbose", **env})
    assert out.returncode == 0, out.stderr[-2000:]
    counts = set(re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr))
    assert len(counts) == 1, out.stderr[-2000:]
    return counts.pop()


def test_importing_the_openmp_default_before_torch_makes_idle_threads_sleep():
    assert spin_count_seen_by_openmp("import torch") != "0"  # torch alone: its threads spin before they sleep
    assert spin_count_seen_by_openmp("import flywheel.openmp_env, torch") == "0"  # OMP_WAIT_POLICY=PASSIVE


def test_every_recipe_imports_the_openmp_default_before_torch():
    import ast
    from pathlib import Path

    for recipe in ("grpo", "nft", "awm", "dpo", "draft"):
        tree = ast.parse((Path(__file__).resolve().parents[1] / "trainers" / f"{recipe}.py").read_text())
        imported = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
        assert "flywheel.openmp_env" in imported and "torch" in imported, recipe
        assert imported.index("flywheel.openmp_env") < imported.index("torch"), recipe


def test_the_openmp_default_leaves_a_users_wait_setting_alone():
    from flywheel.openmp_env import passive_wait_by_default

    for key, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "10000"), ("KMP_BLOCKTIME", "0")):
        environ = {key: value}
        assert not passive_wait_by_default(environ) and environ == {key: value}
    environ = {"OMP_WAIT_POLICY": " "}
    assert passive_wait_by_default(environ) and environ == {"OMP_WAIT_POLICY": "PASSIVE"}
