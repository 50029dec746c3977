"""benchmarks/defaults_check.py: issue 23's bars for a default that does not game its reward, on fabricated runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from flywheel.runs.compare import Run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "defaults_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("defaults_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


dc = _load()


def _eval(step, reward, typ, div, warning=0.0, cls_reward=None, cls_typ=None):
    """An eval row with one class "3" (its reward/typicality default to the overall ones)."""
    return {"step": step, "eval/reward/mean": reward, "eval/reward/3": reward if cls_reward is None else cls_reward,
            "eval/judge/digit_typicality/mean": typ, "eval/judge/digit_typicality/3": typ if cls_typ is None else cls_typ,
            "eval/diversity": div, "eval/hacking_warning": warning, "eval/hacking_signals": warning,
            "time/wall_s": float(step)}


def _run_dir(tmp_path, rows, card="toy-digits", name="run"):
    path = tmp_path / name
    path.mkdir()
    (path / "config.yaml").write_text(f"steps: {rows[-1]['step']}\nmodel:\n  card: {card}\n")
    (path / "run.json").write_text(json.dumps({"recipe": "nft", "card": card}))
    train_rows = [{"step": s, "loss": 0.1} for s in range(1, rows[-1]["step"] + 1)]
    all_rows = sorted(rows + train_rows, key=lambda r: (r["step"], "eval/reward/mean" not in r))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in all_rows))
    return path


GOOD = [_eval(0, 0.48, 0.14, 0.131), _eval(20, 0.90, 0.30, 0.10), _eval(40, 0.96, 0.28, 0.07)]


def test_a_run_that_meets_every_bar(tmp_path):
    check = dc.check_run(Run.load(_run_dir(tmp_path, GOOD)))
    assert check.passes == {"watch_final": True, "watch_anywhere": True, "typicality": True, "diversity": True,
                            "reward": True}
    assert check.ok
    assert (check.final_step, check.reward_final, check.reward_bar) == (40, 0.96, 0.95)
    assert (check.typicality_best_earlier, check.typicality_best_step, check.typicality_final) == (0.30, 20, 0.28)
    assert check.diversity_ratio == pytest.approx(0.07 / 0.131)


@pytest.mark.parametrize("change, failed", [
    ({"reward": 0.949}, "reward"),                       # toy-digits bar 0.95
    ({"typ": 0.249}, "typicality"),                      # best earlier 0.30 - 0.05 = 0.25
    ({"div": 0.0654}, "diversity"),                      # half the base's 0.131 is 0.0655
])
def test_each_bar_fails_alone(tmp_path, change, failed):
    final = dict(reward=0.96, typ=0.28, div=0.07)
    final.update(change)
    check = dc.check_run(Run.load(_run_dir(tmp_path, GOOD[:2] + [_eval(40, **final)])))
    assert [k for k, v in check.passes.items() if not v] == [failed]
    assert not check.ok


def test_bars_at_the_edge_pass(tmp_path):
    rows = GOOD[:2] + [_eval(40, 0.95, 0.25 + 1e-9, 0.0656)]
    assert dc.check_run(Run.load(_run_dir(tmp_path, rows))).ok


def test_toy_numbers_reward_bar_is_085(tmp_path):
    rows = [_eval(0, 0.2, 0.1, 0.1), _eval(10, 0.86, 0.3, 0.08)]
    check = dc.check_run(Run.load(_run_dir(tmp_path, rows, card="toy-numbers")))
    assert check.reward_bar == 0.85 and check.passes["reward"]
    check = dc.check_run(Run.load(_run_dir(tmp_path, [rows[0], _eval(10, 0.84, 0.3, 0.08)], card="toy-numbers",
                                           name="low")))
    assert not check.passes["reward"]


def test_a_signal_before_the_end_fails_anywhere_not_final(tmp_path):
    rows = [GOOD[0], _eval(20, 0.90, 0.30, 0.10, warning=1.0), GOOD[2]]
    check = dc.check_run(Run.load(_run_dir(tmp_path, rows)))
    assert check.watch_steps == [20]
    assert check.passes["watch_final"] and not check.passes["watch_anywhere"]
    rows = GOOD[:2] + [_eval(40, 0.96, 0.28, 0.07, warning=2.0)]
    check = dc.check_run(Run.load(_run_dir(tmp_path, rows, name="final")))
    assert check.watch_final_signals == 2.0 and not check.passes["watch_final"]


def test_missing_judge_or_watch_fails_rather_than_passes(tmp_path):
    rows = [{k: v for k, v in r.items() if "typicality" not in k and "hacking" not in k} for r in GOOD]
    check = dc.check_run(Run.load(_run_dir(tmp_path, rows)))
    assert not check.passes["typicality"] and not check.passes["watch_final"] and not check.passes["watch_anywhere"]


def _class_dip_rows():
    """Class 3's typicality dips 0.54 -> 0.40 at step 10 while its reward rises, and is back at 20."""
    return [_eval(0, 0.48, 0.14, 0.131, cls_reward=0.90, cls_typ=0.54),
            _eval(10, 0.80, 0.20, 0.11, warning=1.0, cls_reward=0.95, cls_typ=0.40),
            _eval(20, 0.90, 0.30, 0.10, cls_reward=0.96, cls_typ=0.50),
            _eval(30, 0.96, 0.31, 0.08, cls_reward=0.97, cls_typ=0.38)]


def test_replay_every_n_sees_only_those_evaluations(tmp_path):
    run = Run.load(_run_dir(tmp_path, _class_dip_rows()))
    logged = dc.check_run(run)
    assert logged.watch_steps == [10]  # the flags as logged (the final row's flag says 0)
    replayed = dc.check_run(run, watch_every=20)
    # Evaluations 0, 20 and 30 (the last): 20 is within 0.1 of the base's 0.54; 30 fell 0.54 -> 0.38 since step 0.
    assert replayed.watch_steps == [30]
    assert replayed.watch_final_signals == 1.0 and not replayed.passes["watch_final"]
    every10 = dc.check_run(run, watch_every=10)  # the watch recomputed on every row: fires at 10 and 30
    assert every10.watch_steps == [10, 30]


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    good, bad = _run_dir(tmp_path, GOOD, name="good"), _run_dir(tmp_path, _class_dip_rows(), name="bad")
    out = tmp_path / "out.json"
    checks = dc.main([str(good), str(bad), "--json", str(out), "--watch-every", "20"])
    text = capsys.readouterr().out
    assert "good" in text and "bad" in text and "watch_final" in text
    data = json.loads(out.read_text())
    assert (data["good_ok"], data["bad_ok"], data["all_ok"]) == (True, False, False)
    assert data["bad_watch_steps"] == [30] and data["good_pass_watch_final"] is True and checks[0].ok
    with pytest.raises(SystemExit):
        dc.main([str(good), "--watch-every", "0"])


def test_until_reads_the_run_as_if_it_ended_there(tmp_path):
    rows = GOOD + [_eval(60, 0.99, 0.10, 0.05, warning=1.0)]  # a last stretch that fails three bars
    path = _run_dir(tmp_path, rows)
    assert not dc.check_run(Run.load(path)).ok
    check = dc.check_run(dc.truncated(Run.load(path), 40))
    assert check.ok and (check.final_step, check.reward_final, check.wall_s) == (40, 0.96, 40.0)
    checks = dc.main([str(path), "--until", "40", "--watch-every", "20"])
    assert checks[0].ok and checks[0].watch_steps == []
    with pytest.raises(SystemExit):
        dc.main([str(path), "--until", "0"])
