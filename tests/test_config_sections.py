"""The config sections by owner: the old key names as aliases (one warning line each, conflicts refused), one
check per section (a line naming the key, before anything is written), and run directories written before the
sections moved still resume."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from flywheel.config import aliases
from flywheel.config.aliases import ALIASES
from flywheel.config.parsing import ConfigError, apply_overrides, load_config, parse_config
from flywheel.config.sections import RunConfig
from flywheel.runs.resume import RESUME_HISTORY_KEY, ResumeError
from trainers.grpo import Config, main as grpo_main

ROOT = Path(__file__).resolve().parents[1]
OLD_RUN_CONFIG = ROOT / "tests" / "golden" / "run_config_before_sections.yaml"
# The same run's config.yaml written by main at 16c3fce, the commit this change starts from (it has the keys
# added since d477971, the first golden's commit: model.experts, sampling.cache_threshold, the DPPO keys...).
MAIN_RUN_CONFIG = ROOT / "tests" / "golden" / "run_config_main_16c3fce.yaml"
OLD_RUN_CONFIGS = pytest.mark.parametrize("old_config", [OLD_RUN_CONFIG, MAIN_RUN_CONFIG], ids=["d477971", "16c3fce"])
# The run that both goldens record (written by trainers/grpo.py before the sections moved, with the old key
# names: 1 step with these keys, then resumed to 2 steps with eval_every=500).
OLD_RUN = ["steps=1", "save_every=1", "eval.every=1000", "sample_every=1000", "tracker=none",
           "data.prompts_per_step=2", "data.group_size=4", "eval.seeds=1", "sampling.steps=4",
           "train.timestep_fraction=0.5"]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warnings afresh."""
    monkeypatch.setattr(aliases, "_warned", set())


# One value per old key that differs from its default, and what the new key then holds.
OLD_VALUES = {
    "rewards": ("jpeg_compressibility:1.0", "jpeg_compressibility:1.0"),
    "rewards_mode": ("gdpo", "gdpo"),
    "reward_timeout_s": ("7", 7.0),
    "reward_budget_s": ("9", 9.0),
    "reward_modules": ("[json]", ["json"]),
    "reward_args": ("{digit_alignment: {x: 1}}", {"digit_alignment": {"x": "1"}}),
    "train.max_masked_steps": ("5", 5),
    "train.adv_clip_max": ("2.5", 2.5),
    "train.global_std": ("true", True),
    "train.ema": ("true", True),
    "train.ema_decay": ("0.5", 0.5),
    "train.ema_start_step": ("3", 3),
    "train.ema_update_every": ("2", 2),
    "eval_every": ("7", 7),
    "sampling.eval_seeds": ("2", 2),
    "sampling.eval_steps": ("6", 6),
    "sampling.eval_guidance_scale": ("2.0", 2.0),
    "sampling.eval_cache_threshold": ("0.1", 0.1),
    "eval_judges": ("digit_svc", "digit_svc"),
    "train.stop_on_hacking": ("2", 2),
    "async_rollouts": ("true", True),
    "max_staleness": ("3", 3),
    "overlap_scoring": ("true", True),
    "model.workflow": ("toy.digits_then_refine", "toy.digits_then_refine"),
    "model.workflow_paths": ("{toy-digits: /x}", {"toy-digits": "/x"}),
    "train.stage": ("draw", "draw"),
}


def value_at(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_alias_has_a_value_here():
    assert set(OLD_VALUES) == set(ALIASES)


@pytest.mark.parametrize("old", list(ALIASES))
def test_an_old_key_sets_its_new_one_and_says_the_new_name_once(old, capsys):
    text, expected = OLD_VALUES[old]
    new = ALIASES[old]
    cfg = parse_config(Config, [f"{old}={text}"])
    assert value_at(cfg, new) == expected
    assert value_at(cfg, new) != value_at(Config(), new)  # the value moved: the alias did something
    assert cfg == parse_config(Config, [f"{new}={text}"])
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    assert f"warning: config key {old!r} (command line) is now {new!r}" in err
    parse_config(Config, [f"{old}={text}"])  # once per process
    assert "warning" not in capsys.readouterr().err


def test_old_keys_in_a_yaml_file_nested_or_dotted_give_the_new_config(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("rewards: jpeg_compressibility:1.0\neval_every: 5\nasync_rollouts: false\n"
                   "sampling:\n  steps: 6\n  eval_seeds: 2\n"
                   "train:\n  learning_rate: 1.0e-3\n  ema: true\n  ema_decay: 0.5\n  global_std: true\n"
                   "model.workflow: null\nreward_args.jpeg_compressibility.quality: 50\n")
    new = tmp_path / "new.yaml"
    new.write_text("reward:\n  scorers: jpeg_compressibility:1.0\nreward.args.jpeg_compressibility.quality: 50\n"
                   "eval:\n  every: 5\n  seeds: 2\nsampling:\n  steps: 6\n"
                   "train:\n  learning_rate: 1.0e-3\nema:\n  enabled: true\n  decay: 0.5\n"
                   "advantage:\n  global_std: true\n")
    cfg = parse_config(Config, ["--config", str(old)])
    assert cfg == parse_config(Config, ["--config", str(new)])
    assert (cfg.ema.decay, cfg.eval.seeds, cfg.train.learning_rate) == (0.5, 2, 1e-3)
    err = capsys.readouterr().err
    assert f"'train.ema_decay' (in {old}) is now 'ema.decay'" in err
    assert f"'reward_args' (in {old}) is now 'reward.args'" in err


def test_apply_overrides_takes_old_keys_flat_or_nested():
    base = Config()
    assert apply_overrides(base, {"train": {"ema": True}, "eval_every": 4}) == \
        apply_overrides(base, {"ema.enabled": True, "eval.every": 4})


def test_old_and_new_name_with_different_values_is_an_error_naming_both(tmp_path):
    with pytest.raises(ConfigError, match=r"config keys 'eval_every' and 'eval.every' \(command line\) set the "
                                          r"same key, 'eval.every'.*3.*5"):
        parse_config(Config, ["eval_every=3", "eval.every=5"])
    with pytest.raises(ConfigError, match=r"'train.ema_decay' and 'ema.decay'"):
        parse_config(Config, ["train.ema_decay=0.5", "ema.decay=0.7"])
    both = tmp_path / "both.yaml"
    both.write_text("sampling:\n  eval_seeds: 2\neval:\n  seeds: 3\n")
    with pytest.raises(ConfigError, match=rf"'sampling.eval_seeds' and 'eval.seeds' \(in {both}\)"):
        parse_config(Config, ["--config", str(both)])
    # The same value under both names is one setting; a later source overrides an earlier one as always.
    assert parse_config(Config, ["eval_every=3", "eval.every=3"]).eval.every == 3
    newer = tmp_path / "new.yaml"
    newer.write_text("eval:\n  every: 5\n")
    assert parse_config(Config, ["--config", str(newer), "eval_every=3"]).eval.every == 3


@dataclass
class KeepsItsOwnName(RunConfig):
    """A recipe whose config still has a field under an old key's name: that field is its own."""

    eval_every: int = 1
    """this recipe's own key"""


def test_a_config_that_has_the_old_key_itself_keeps_it(capsys):
    cfg = parse_config(KeepsItsOwnName, ["eval_every=9"])
    assert (cfg.eval_every, cfg.eval.every) == (9, 20)
    assert "warning" not in capsys.readouterr().err


@dataclass
class Bare:
    steps: int = 1
    """no eval section: the alias has nowhere to go"""
    sections: dict = field(default_factory=dict)
    """(unused)"""


def test_an_old_key_with_no_new_key_in_the_class_is_unknown():
    with pytest.raises(ConfigError, match="unknown config key 'eval_every'"):
        parse_config(Bare, ["eval_every=3"])


# ---- one check per section ---------------------------------------------------------------------------------

SECTION_ERRORS = {
    # overrides -> the start of the line that names the key
    "reward.timeout_s": (["reward.timeout_s=0"], "reward.timeout_s=0.0: must be a number of seconds in (0, 604800]"),
    "reward.budget_s": (["reward.budget_s=1e30"], "reward.budget_s=1e+30: must be a number of seconds in (0, 604800]"),
    "reward.max_masked_steps": (["reward.max_masked_steps=0"], "reward.max_masked_steps=0: must be an integer >= 1"),
    "reward.max_flat_steps": (["reward.max_flat_steps=0"], "reward.max_flat_steps=0: must be an integer >= 1"),
    "reward.scorers": (["reward.scorers=nope:1"], "reward.scorers='nope:1': unknown scorer 'nope'"),
    "advantage.clip_max": (["advantage.clip_max=0"], "advantage.clip_max=0.0: must be > 0"),
    "advantage with gdpo": (["reward.aggregation=gdpo", "advantage.global_std=true"],
                            "advantage.global_std=true does nothing with reward.aggregation=gdpo"),
    "ema.decay": (["ema.decay=1"], "ema.decay=1.0: must be in [0, 1)"),
    "ema.update_every": (["ema.update_every=0"], "ema.update_every=0: must be an integer >= 1"),
    "eval.every": (["eval.every=0"], "eval.every=0: must be an integer >= 1"),
    "eval.every (old name)": (["eval_every=0"], "eval.every=0: must be an integer >= 1"),
    "eval.seeds": (["eval.seeds=0"], "eval.seeds=0: must be an integer >= 1"),
    "eval.cache_threshold": (["eval.cache_threshold=2"], "eval.cache_threshold=2.0: must be in [0, 1]"),
    "eval.judges": (["eval.judges=nope"], "eval.judges names 'nope', which is not a registered scorer"),
    "eval.stop_on_hacking": (["eval.stop_on_hacking=-1"], "eval.stop_on_hacking=-1: must be an integer >= 0"),
    "rollout.max_staleness": (["rollout.max_staleness=-1"], "rollout.max_staleness=-1: must be an integer >= 0"),
    "workflow.stage": (["workflow.stage=draw"], "workflow.stage='draw' names a stage of a workflow, but "
                                                "workflow.name is null"),
    "workflow.name": (["workflow.name=toy.nope", "workflow.stage=draw"], "workflow.name='toy.nope': unknown"),
}


@pytest.mark.parametrize("case", list(SECTION_ERRORS))
def test_a_bad_section_key_is_one_line_naming_it_before_anything_is_written(case, tmp_path):
    overrides, line = SECTION_ERRORS[case]
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        grpo_main([f"run_dir={run_dir}", "tracker=none", *overrides])
    lines = [s.strip() for s in str(info.value).splitlines()]
    assert any(s.startswith(line) for s in lines), str(info.value)
    assert not run_dir.exists()


# ---- run directories written before the change -------------------------------------------------------------


@OLD_RUN_CONFIGS
def test_the_saved_config_of_a_run_before_the_sections_moved_loads_as_the_same_settings(old_config, capsys):
    cfg = load_config(Config, old_config)
    assert cfg == parse_config(Config, [*OLD_RUN, "run_dir=runs/written-by-main", "steps=2", "eval.every=500"])
    assert "'eval_every' (in " in capsys.readouterr().err


@OLD_RUN_CONFIGS
def test_a_run_dir_written_before_the_sections_moved_resumes(old_config, tmp_path, capsys):
    """The run's config.yaml has the old keys and a resume_overrides entry of the old names: it resumes, an
    old key given with resume= is a resumable change under its new name, and the history keeps both."""
    run_dir = tmp_path / "run"
    grpo_main([f"run_dir={run_dir}", *OLD_RUN])
    saved = yaml.safe_load(old_config.read_text())
    saved["run_dir"] = str(run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    backup = tmp_path / "config-before.yaml"
    shutil.copy(run_dir / "config.yaml", backup)
    with pytest.raises(ResumeError, match=r"advantage\.global_std \(the run has False, given True\)"):
        grpo_main([f"resume={run_dir}", "steps=3", "train.global_std=true"])
    assert (run_dir / "config.yaml").read_text() == backup.read_text()  # refused before anything is written
    grpo_main([f"resume={run_dir}", "steps=3", "eval_every=1"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in rows) == 3
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["eval"]["every"] == 1 and written["steps"] == 3 and "eval_every" not in written
    history = written[RESUME_HISTORY_KEY]
    assert history[0] == saved[RESUME_HISTORY_KEY][0]  # the old entry, as it was written
    assert history[-1]["set"] == {"eval.every": 1, "steps": 3}
    assert history[-1]["was"] == {"eval.every": 500, "steps": 2}
    assert load_config(Config, run_dir / "config.yaml").eval.every == 1


@OLD_RUN_CONFIGS
def test_runs_compare_diffs_a_run_from_before_the_rename_key_by_key(old_config):
    from flywheel.config.parsing import config_to_dict
    from flywheel.runs.compare import Run, config_diff

    old = yaml.safe_load(old_config.read_text())
    old.pop(RESUME_HISTORY_KEY)  # the record of its resume, which the other run has not
    new = config_to_dict(parse_config(Config, [*OLD_RUN, "run_dir=runs/written-by-main", "steps=2",
                                               "eval.every=7"]))
    runs = [Run(path=Path(n), name=n, recipe="grpo", card="toy-digits", steps_configured=2, rows=[], walls=[],
                config=c) for n, c in (("old", old), ("new", new))]
    diff = config_diff(runs)
    assert ("eval.every", ["500", "7"]) in diff
    # The rest are the keys added after the golden's commit, never a renamed key.
    added = [key for key, (was, _) in diff if was == "(absent)"]
    assert sorted(diff) == sorted([("eval.every", ["500", "7"]), *[(k, v) for k, v in diff if k in added]])
    if old_config == MAIN_RUN_CONFIG:
        assert diff == [("eval.every", ["500", "7"]), ("reward.max_flat_steps", ["(absent)", "10"]),
                        ("rollout.call_timeout_s", ["(absent)", "600.0"]),
                        ("rollout.start_timeout_s", ["(absent)", "600.0"])]
    else:
        assert {"model.experts", "sampling.cache_threshold", "sampling.early_exit"} <= set(added)


def test_an_old_key_on_a_real_command_line_prints_its_new_name(tmp_path):
    """`python trainers/grpo.py ... eval_every=0`: the warning names the new key, the error too (exit 2)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "trainers" / "grpo.py"), f"run_dir={tmp_path / 'r'}",
                           "tracker=none", "eval_every=0"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "warning: config key 'eval_every' (command line) is now 'eval.every'" in proc.stderr
    assert "eval.every=0: must be an integer >= 1" in proc.stderr
    assert not (tmp_path / "r").exists()
