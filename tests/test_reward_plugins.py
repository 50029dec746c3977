"""Scorers from other packages: entry points under `flywheel.rewards`, modules named in the config, scorer
arguments from the config, and short names for remote scorers.

The plugin is a separate distribution written into tmp_path the way an installer leaves one: the package
and its `<name>.dist-info` (METADATA, entry_points.txt), found by `importlib.metadata` on sys.path or
PYTHONPATH, with no network and nothing installed into the environment."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flywheel.recipe.sections import check_shared_sections
from flywheel.runs.config import parse_config
from flywheel.runs.rundir import read_metrics
from flywheel.scale.config import RolloutConfig, build_rewards
from rewards import RewardSet, registry
from rewards.serve import ServerThread

ROOT = Path(__file__).resolve().parents[1]
HALF = '''
import torch


class Half:
    """Scores every image `value` (0.5 unless the config says otherwise)."""

    def __init__(self, value: float = 0.5):
        self.value = value

    def __call__(self, images, prompts, metadata):
        return torch.full((len(prompts),), float(self.value))
'''


def write_distribution(site: Path, dist: str, module: str, source: str, entry_points: dict[str, str]) -> Path:
    """A distribution as an installer leaves it in `site`: the module and its dist-info."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[flywheel.rewards]\n{lines}")
    return site


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    """sys.path with the `half-scorer` distribution (entry point `half`); the registry forgets it afterwards."""
    site = write_distribution(tmp_path / "site", "half-scorer", "half_scorer", HALF, {"half": "half_scorer:Half"})
    monkeypatch.syspath_prepend(str(site))
    registry.find_plugins(refresh=True)
    yield site
    registry.unregister("half")
    sys.modules.pop("half_scorer", None)
    monkeypatch.undo()
    registry.find_plugins(refresh=True)


def images(n: int) -> torch.Tensor:
    return torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def test_an_installed_plugin_is_listed_and_built_by_name_with_its_arguments(plugin_site):
    assert "half" not in registry._FACTORIES  # nothing loaded before the first lookup
    assert "half" in registry.available()
    scored = RewardSet("half:2.0").score(images(3), ["a", "b", "c"], [{}, {}, {}], 0)
    assert torch.equal(scored.scores["half"], torch.full((3,), 0.5)) and torch.equal(scored.total, torch.ones(3))
    assert registry.get("half", value=0.25)(images(2), ["a", "b"], [{}, {}]).tolist() == [0.25, 0.25]


def test_without_the_package_the_name_is_unknown_and_the_error_says_where_scorers_come_from():
    registry.find_plugins(refresh=True)
    with pytest.raises(KeyError, match="unknown scorer 'half'.*entry-point group 'flywheel.rewards'.*reward\\.modules"):
        registry.get("half")


def test_a_plugin_may_not_take_a_builtin_name_and_two_packages_may_not_share_one(tmp_path, monkeypatch):
    site = write_distribution(tmp_path / "a", "shadow-ocr", "shadow_ocr", HALF, {"ocr": "shadow_ocr:Half",
                                                                                 "twice": "shadow_ocr:Half"})
    write_distribution(tmp_path / "b", "other-twice", "other_twice", HALF, {"twice": "other_twice:Half"})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    try:
        with pytest.warns(UserWarning, match="entry point 'ocr' .* of package 'shadow-ocr' is skipped: 'ocr' is "
                                             "already a registered scorer"):
            registry.find_plugins(refresh=True)
        assert registry.factory_of("ocr").__qualname__ == "lazy(rewards.ocr.OcrReward)"  # the built-in wins
        with pytest.raises(ValueError, match="'twice' is declared under flywheel.rewards by more than one "
                                             "package: package '(shadow-ocr|other-twice)'.*package"):
            registry.get("twice")
    finally:
        monkeypatch.undo()
        registry.find_plugins(refresh=True)


def test_reward_args_reach_the_scorers_and_unknown_ones_name_the_valid_arguments(plugin_site):
    cfg = parse_config(recipe_config(), ["reward.scorers=half:1.0,jpeg_compressibility:0.1", "reward.args.half.value=0.25",
                                         "reward.args.jpeg_compressibility={quality: 30}"])
    assert check_shared_sections(cfg).problems == []
    rewards = build_rewards(RolloutConfig(), cfg.reward.scorers, cfg.reward.args)
    assert rewards.scorers["half"].value == 0.25  # the command line's text, as the float the argument takes
    assert rewards.scorers["jpeg_compressibility"].quality == 30
    bad = parse_config(recipe_config(), ["reward.scorers=half", "reward.args.half.valeu=0.25"])
    assert check_shared_sections(bad).problems == [
        "reward.args.half.valeu: scorer 'half' takes no argument 'valeu'; valid arguments: value"]
    stray = parse_config(recipe_config(), ["reward.scorers=half", "reward.args.pickscore.path=/models/pickscore"])
    assert check_shared_sections(stray).problems == [
        "reward.args.pickscore: 'pickscore' is not a scorer of rewards (half); reward.args are keyed by the names "
        "in the reward spec"]
    typed = parse_config(recipe_config(), ["reward.scorers=half", "reward.args.half.value=lots"])
    assert check_shared_sections(typed).problems == ["reward.args.half.value='lots': expected float"]


def test_builtin_arguments_come_from_the_class_and_its_bases():
    """PickScore's folder is an argument like any other (its base class's `path`), not only $FLYWHEEL_PICKSCORE_PATH."""
    assert registry.resolve_args("pickscore", {"pickscore.path": "/models/pickscore"}) == \
        {"pickscore": {"path": "/models/pickscore"}}
    assert list(registry.scorer_parameters("aesthetic")[0]) == ["path", "head", "device", "dtype"]
    assert registry.check_spec("aesthetic", {"aesthetic": {"folder": "/x"}}) == [
        "reward.args.aesthetic.folder: scorer 'aesthetic' takes no argument 'folder'; valid arguments: path, head, "
        "device, dtype"]


def test_reward_modules_are_imported_before_the_spec_is_checked(tmp_path, monkeypatch):
    (tmp_path / "quarter_scorers.py").write_text(textwrap.dedent('''
        import torch
        from rewards.registry import register

        @register("quarter")
        def quarter():
            return lambda images, prompts, metadata: torch.full((len(prompts),), 0.25)
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        unknown = parse_config(recipe_config(), ["reward.scorers=quarter"])
        assert "unknown scorer 'quarter'" in check_shared_sections(unknown).problems[0]
        cfg = parse_config(recipe_config(), ["reward.scorers=quarter", "reward.modules=[quarter_scorers]"])
        assert check_shared_sections(cfg).problems == []
        rewards = build_rewards(RolloutConfig(), cfg.reward.scorers, modules=cfg.reward.modules)
        scored = rewards.score(images(2), ["a", "b"], [{}, {}], 0)
        assert scored.scores["quarter"].tolist() == [0.25, 0.25]
        missing = parse_config(recipe_config(), ["reward.scorers=quarter", "reward.modules=[no_such_scorers]"])
        assert check_shared_sections(missing).problems == [
            "reward.modules: cannot import 'no_such_scorers' (ModuleNotFoundError: No module named "
            "'no_such_scorers'); it must be importable here (installed, or on PYTHONPATH)"]
    finally:
        registry.unregister("quarter")
        sys.modules.pop("quarter_scorers", None)


def test_a_remote_scorer_takes_a_short_name_for_its_metric_keys(plugin_site):
    assert registry.parse_spec_targets("digit_alignment:1,ocr=remote:http://127.0.0.1:8100:0.5") == [
        ("digit_alignment", "digit_alignment", 1.0), ("ocr", "remote:http://127.0.0.1:8100", 0.5)]
    assert registry.parse_spec_targets({"ocr=remote:http://h:8100/score?a=b": 2}) == [
        ("ocr", "remote:http://h:8100/score?a=b", 2.0)]
    with pytest.raises(ValueError, match="a short name \\('name='\\) is only for remote scorers"):
        registry.parse_spec("alias=digit_alignment")
    with ServerThread(registry.get("half"), "half") as server:
        rewards = RewardSet(f"half=remote:{server.url}:2.0", scorer_kwargs={"half": {"timeout_s": 5.0}})
        assert rewards.scorer_ids == ["half"] and rewards.scorers["half"].timeout_s == 5.0
        scored = rewards.score(images(2), ["a", "b"], [{}, {}], 0)
        assert scored.metrics()["reward/half/mean"] == 0.5 and scored.total.tolist() == [1.0, 1.0]
        with pytest.raises(ValueError, match="reward spec names a scorer more than once: half"):
            RewardSet(f"half,half=remote:{server.url}")


def recipe_config():
    from trainers.grpo import Config

    return Config


def plugin_env(site: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


@pytest.mark.slow
def test_a_recipe_finds_and_uses_an_installed_plugin_by_name(tmp_path):
    """The issue's acceptance run: a scorer from a separate package that scores every image 0.5, found by
    name with no wrapper script. Every group is flat, so no step trains."""
    site = write_distribution(tmp_path / "site", "half-scorer", "half_scorer", HALF, {"half": "half_scorer:Half"})
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, str(ROOT / "trainers" / "grpo.py"), "reward.scorers=half", "steps=3",
                          "tracker=none", f"run_dir={run_dir}", "data.prompts_per_step=2", "data.group_size=2",
                          "sampling.steps=2", "eval.steps=2", "eval.seeds=1", "eval.every=1000",
                          "sample_every=1000", "save_every=1000"], cwd=tmp_path, env=plugin_env(site), capture_output=True, text=True,
                         timeout=300)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows, out.stderr[-2000:]
    steps = [r for r in rows if "reward/half/mean" in r]  # the training rows (evaluation rows: eval/...)
    assert len(steps) == 3, rows
    assert all(r["reward/half/mean"] == 0.5 and r["reward/zero_std_groups"] == 2.0 for r in steps)
    assert all(r["eval/reward/mean"] == 0.5 for r in rows if "eval/reward/mean" in r)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "moved the weights" in line]
    assert lines and "0 of 3 steps moved the weights" in lines[-1], (out.stdout + out.stderr)[-2000:]
    assert out.returncode != 0


def test_the_reward_server_serves_a_plugin_and_a_module_by_name(tmp_path):
    site = write_distribution(tmp_path / "site", "half-scorer", "half_scorer", HALF, {"half": "half_scorer:Half"})
    (site / "third_scorers.py").write_text("import torch\nfrom rewards.registry import register\n"
                                           "register('third', lambda: lambda i, p, m: torch.full((len(p),), 1 / 3))\n")
    from rewards.remote import RemoteScorer

    for argv, expected in ((["--reward", "half", "--kwargs", json.dumps({"value": 0.75})], 0.75),
                           (["--reward", "third", "--module", "third_scorers"], 1 / 3)):
        server = subprocess.Popen([sys.executable, "-m", "rewards.serve", *argv, "--port", "0"], cwd=tmp_path,
                                  env=plugin_env(site), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = server.stdout.readline()
            assert line.startswith("serving reward"), server.stderr.read()[-2000:] if server.poll() is not None \
                else line
            url = line.split(" at ")[-1].strip()
            scores = RemoteScorer(url)(images(2), ["a", "b"], [{}, {}])
            assert scores.tolist() == pytest.approx([expected, expected], abs=1e-7)
        finally:
            server.terminate()
            server.wait(timeout=30)


def test_a_module_the_reward_server_cannot_import_is_a_one_line_flag_error(capsys):
    from rewards.serve import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--reward", "third", "--module", "no_such_scorers"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --module: cannot import 'no_such_scorers' (ModuleNotFoundError: No module named 'no_such_scorers'); "
        "it must be importable here (installed, or on PYTHONPATH)")
