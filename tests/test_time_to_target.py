"""benchmarks/time_to_target.py: time to target on hand-written metric rows, the speedup, the config check, a run."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.runs.compare import Run
from flywheel.runs.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "time_to_target.py"


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("time_to_target", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ttt = _load_benchmark()


def write_run(path: Path, rows: list[dict], recipe: str = "grpo") -> Run:
    """A run directory with these metric rows (and run.json), read back as compare.py reads it."""
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"recipe": recipe, "card": "toy-numbers"}))
    (path / "config.yaml").write_text("steps: 20\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Run.load(path)


SVC = "eval/judge/number_svc/mean"


def eval_row(step, wall, reward, judge, **more):
    return {"step": step, "time/wall_s": wall, "eval/reward/mean": reward, SVC: judge, **more}


# Evaluations every 5 steps, training rows between them. The reward crosses 0.8 at step 10, dips below at 15,
# ends at 0.9; the judge and diversity at step 10 differ from their final (and neighbouring) values.
# time/step_s leaves the evaluation out (the base evaluation has none).
CROSSING_ROWS = [
    eval_row(0, 0.0, 0.50, 0.40),
    {"step": 1, "time/wall_s": 1.5, "time/step_s": 1.0, "diversity": 0.30},
    eval_row(5, 7.0, 0.70, 0.55, diversity=0.25, **{"time/step_s": 2.0}),
    {"step": 9, "time/wall_s": 13.0, "time/step_s": 4.0, "diversity": 0.21},
    eval_row(10, 14.5, 0.82, 0.86, diversity=0.20, **{"time/step_s": 0.5}),
    {"step": 11, "time/wall_s": 16.0, "time/step_s": 8.0, "diversity": 0.19},
    eval_row(15, 21.0, 0.79, 0.60, diversity=0.15),
    eval_row(20, 28.0, 0.90, 0.70, diversity=0.10),
]


def test_first_crossing_with_the_values_of_its_own_row(tmp_path):
    run = write_run(tmp_path / "run", CROSSING_ROWS)
    r = ttt.time_to_target(run, target=0.8, samples_per_step=8 * 16)
    assert r.reached and r.judge == "number_svc"
    assert r.steps_to_target == 10
    assert r.samples_to_target == 10 * 128  # step x prompts_per_step x group_size
    assert r.time_to_target_s == 14.5  # the wall time of the step-10 row, not of the step-9 or 11 rows
    assert r.train_time_to_target_s == 1.0 + 2.0 + 4.0 + 0.5  # steps 1..10, not step 11's 8.0
    assert r.reward_at_target == 0.82
    assert r.judge_at_target == 0.86  # at the crossing, not the final 0.70
    assert r.diversity_at_target == 0.20
    assert (r.final_reward, r.final_judge, r.best_reward, r.best_reward_step) == (0.90, 0.70, 0.90, 20)
    assert r.wall_s == 28.0 and r.steps_done == 20


def test_a_reward_equal_to_the_target_reaches_it(tmp_path):
    run = write_run(tmp_path / "run", CROSSING_ROWS)
    r = ttt.time_to_target(run, target=0.7, samples_per_step=4)
    assert (r.steps_to_target, r.time_to_target_s, r.judge_at_target) == (5, 7.0, 0.55)
    assert r.train_time_to_target_s == 3.0


def test_a_base_already_at_the_target_takes_no_time(tmp_path):
    run = write_run(tmp_path / "run", CROSSING_ROWS)
    r = ttt.time_to_target(run, target=0.5, samples_per_step=4)
    assert (r.steps_to_target, r.samples_to_target, r.time_to_target_s, r.train_time_to_target_s) == (0, 0, 0.0, 0)
    assert r.diversity_at_target is None  # the base evaluation has no training rollouts


def test_never_reached_is_inf_with_the_best_reward(tmp_path):
    run = write_run(tmp_path / "run", CROSSING_ROWS)
    r = ttt.time_to_target(run, target=0.95, samples_per_step=128)
    assert not r.reached
    assert math.isinf(r.time_to_target_s) and math.isinf(r.samples_to_target) and math.isinf(r.steps_to_target)
    assert math.isinf(r.train_time_to_target_s)
    assert r.judge_at_target is None and r.diversity_at_target is None and r.reward_at_target is None
    assert r.best_reward == 0.90 and r.final_reward == 0.90
    out = ttt.results_json([r], target=0.95, min_judge=0.8)
    assert out["grpo_time_to_target_s"] == "inf" and out["grpo_samples_to_target"] == "inf"
    assert out["grpo_steps_to_target"] == "inf" and out["grpo_judge_at_target"] is None
    assert out["grpo_best_reward"] == 0.90
    assert float(out["grpo_time_to_target_s"]) == math.inf  # how a reader gets the number back
    json.loads(json.dumps(out, allow_nan=False))  # strict JSON


def test_judge_choice_prefers_number_svc_else_the_first_logged(tmp_path):
    both = write_run(tmp_path / "both", [{"step": 0, "eval/reward/mean": 0.5, "eval/judge/typicality/mean": 0.1,
                                          SVC: 0.3}])
    assert ttt.pick_judge(both) == "number_svc"
    digits = write_run(tmp_path / "digits", [{"step": 0, "eval/reward/mean": 0.5,
                                              "eval/judge/digit_svc/mean": 0.3,
                                              "eval/judge/digit_typicality/mean": 0.1}])
    assert ttt.pick_judge(digits) == "digit_svc"
    r = ttt.time_to_target(digits, target=0.5, samples_per_step=4)
    assert r.judge_at_target == 0.3


def test_evaluations_since_target_counts_the_evaluations_after_the_first_crossing(tmp_path):
    run = write_run(tmp_path / "run", CROSSING_ROWS)  # evaluations at steps 0, 5, 10, 15, 20
    assert ttt.evaluations_since_target(run.path, 0.8) == 2  # first >= 0.8 at step 10; then 15 and 20
    assert ttt.evaluations_since_target(run.path, 0.9) == 0
    assert ttt.evaluations_since_target(run.path, 0.95) is None
    assert ttt.evaluations_since_target(tmp_path / "not-yet", 0.8) is None  # the recipe has not written yet


def result(recipe, time_s, judge=0.9):
    reached = math.isfinite(time_s)
    return ttt.TargetResult(recipe=recipe, judge="number_svc", reached=reached,
                            steps_to_target=10 if reached else math.inf,
                            samples_to_target=1280 if reached else math.inf, time_to_target_s=time_s,
                            train_time_to_target_s=time_s / 2,
                            reward_at_target=0.8 if reached else None, judge_at_target=judge if reached else None,
                            diversity_at_target=None, final_reward=0.9, final_judge=0.9, best_reward=0.9,
                            best_reward_step=20, wall_s=200.0, steps_done=20)


def test_speedup_is_grpo_time_over_the_fastest_counted_recipe():
    results = [result("grpo", 120.0), result("nft", 20.0), result("awm", 30.0)]
    assert ttt.best_and_speedup(results, min_judge=0.8) == ("nft", 6.0)
    out = ttt.results_json(results, target=0.8, min_judge=0.8)
    assert out["best_recipe"] == "nft" and out["best_speedup_over_grpo"] == 6.0
    assert out["best_judge_at_target"] == 0.9 and out["nft_judge_ok"] is True


def test_a_recipe_whose_judge_disagrees_does_not_count():
    results = [result("grpo", 120.0), result("nft", 20.0, judge=0.79), result("awm", 30.0)]
    assert ttt.best_and_speedup(results, min_judge=0.8) == ("awm", 4.0)
    assert ttt.results_json(results, target=0.8, min_judge=0.8)["nft_judge_ok"] is False


def test_speedup_edge_cases():
    assert ttt.best_and_speedup([result("grpo", math.inf), result("nft", 20.0)], 0.8) == ("nft", math.inf)
    assert ttt.best_and_speedup([result("grpo", 50.0)], 0.8) == ("grpo", 1.0)  # GRPO alone is its own best
    assert ttt.best_and_speedup([result("nft", 20.0), result("awm", 10.0)], 0.8) == ("awm", None)  # no GRPO run
    assert ttt.best_and_speedup([result("grpo", math.inf), result("nft", math.inf)], 0.8) == (None, None)
    assert ttt.best_and_speedup([result("grpo", 9.0), result("nft", 0.0)], 0.8) == ("nft", math.inf)
    out = ttt.results_json([result("grpo", math.inf), result("nft", 20.0)], 0.8, 0.8)
    assert out["best_speedup_over_grpo"] == "inf"
    assert out["best_speedup_over_grpo_at_least"] == 200.0 / 20.0  # GRPO's whole run (wall_s 200) / nft's time
    exact = ttt.results_json([result("grpo", 120.0), result("nft", 20.0)], 0.8, 0.8)
    assert exact["best_speedup_over_grpo_at_least"] is None  # GRPO reached it: the speedup itself is exact


SETTINGS = {"model.card": "toy-numbers", "data.prompts": "toy-numbers", "data.eval_prompts": "toy-numbers-heldout",
            "data.prompts_per_step": 8, "data.group_size": 16, "seed": 0, "eval_every": 5,
            "sampling.eval_guidance_scale": 1.0, "sampling.eval_seeds": 4, "sampling.eval_steps": 10,
            "sampling.height": None, "sampling.width": None}


def test_configs_that_agree_pass():
    ttt.check_agreement({"grpo": dict(SETTINGS), "nft": dict(SETTINGS), "awm": dict(SETTINGS)})


def test_configs_that_disagree_name_every_key_and_value():
    nft = {**SETTINGS, "data.group_size": 8, "sampling.eval_seeds": 2}
    with pytest.raises(ttt.BenchmarkError) as e:
        ttt.check_agreement({"grpo": dict(SETTINGS), "nft": nft})
    message = str(e.value)
    assert "data.group_size: grpo=16, nft=8" in message
    assert "sampling.eval_seeds: grpo=4, nft=2" in message
    assert "prompts_per_step" not in message  # keys that agree are not listed


def test_comparable_settings_of_a_real_config():
    cfg = ttt.resolve_recipe_config("grpo", ROOT / "configs" / "toy_grpo.yaml",
                                    ["seed=3", "eval_every=7", "sampling.steps=6", "data.group_size=4"])
    settings = ttt.comparable_settings(cfg)
    assert set(settings) == set(ttt.COMPARABLE_KEYS)
    assert settings["seed"] == 3 and settings["eval_every"] == 7 and settings["data.group_size"] == 4
    assert settings["sampling.eval_steps"] == 6  # unset: the evaluation uses sampling.steps
    with pytest.raises(ttt.BenchmarkError, match="grpo.*no_such_key"):
        ttt.resolve_recipe_config("grpo", ROOT / "configs" / "toy_grpo.yaml", ["no_such_key=1"])
    with pytest.raises(ttt.BenchmarkError, match="(?s)grpo.*sampling.sampler=ode"):  # the recipe's own checks
        ttt.resolve_recipe_config("grpo", ROOT / "configs" / "toy_grpo.yaml", ["sampling.sampler=ode"])


def test_check_only_resolves_and_compares_the_configs_without_running(tmp_path, capsys):
    code = ttt.main(["--recipes", "grpo", "--configs", "configs/toy_{recipe}.yaml", "--check-only",
                     "--out-dir", str(tmp_path / "runs"), "--", "data.group_size=4"])
    assert code == 0
    assert "data.group_size=4" in capsys.readouterr().out
    assert not (tmp_path / "runs" / "grpo").exists()  # nothing ran
    assert ttt.main(["--recipes", "grpo", "--configs", "configs/toy_{recipe}.yaml", "--check-only", "--",
                     "data.group_size=1"]) == 2  # the recipe's own check: group_size >= 2
    assert "data.group_size" in capsys.readouterr().err


def test_every_shipped_toy_numbers_config_agrees_with_grpos():
    """The benchmark's default recipes, as shipped: the same card, reward, prompts, samples per step and evaluation
    as configs/toy_numbers_grpo.yaml (check_agreement raises naming any key that differs)."""
    configs = {r: ttt.resolve_recipe_config(r, ttt.config_path_for(ttt.DEFAULT_CONFIGS, r), [])
               for r in ttt.DEFAULT_RECIPES}
    settings = {r: ttt.comparable_settings(cfg) for r, cfg in configs.items()}
    ttt.check_agreement(settings)
    assert settings["grpo"]["model.card"] == "toy-numbers" and settings["grpo"]["rewards"] == "number_alignment:1.0"
    assert {cfg.sampling.steps for cfg in configs.values()} == {10}  # the same denoising steps a rollout
    assert {cfg.sampling.sampler for r, cfg in configs.items() if ttt.trainer_of(r) != "grpo"} == {"ode"}


def test_grpo_options_run_grpo_with_their_own_config(tmp_path, capsys):
    assert ttt.trainer_of("grpo_fast") == "grpo" and ttt.trainer_of("mixgrpo") == "grpo"
    assert ttt.trainer_of("nft") == "nft"  # a recipe of its own
    assert ttt.recipe_missing("grpo_fast", ROOT / "configs" / "toy_grpo_fast.yaml") is None
    code = ttt.main(["--recipes", "grpo,grpo_fast,mixgrpo,grpo_guard", "--configs", "configs/toy_{recipe}.yaml",
                     "--check-only", "--out-dir", str(tmp_path / "runs")])
    assert code == 0
    out = capsys.readouterr().out
    assert "grpo_fast:" in out and "mixgrpo:" in out and "grpo_guard:" in out
    # Each option's config is read with GRPO's Config and checked by GRPO's validate_config.
    cfg = ttt.resolve_recipe_config("grpo_fast", ROOT / "configs" / "toy_grpo_fast.yaml", [])
    assert cfg.train.variant == "fast"
    with pytest.raises(ttt.BenchmarkError, match="grpo_fast.*train.variant"):
        ttt.resolve_recipe_config("grpo_fast", ROOT / "configs" / "toy_grpo_fast.yaml", ["train.variant=nosuch"])


def test_an_asked_recipe_that_does_not_exist_is_an_error():
    args = ttt.parse_args(["--recipes", "grpo,nosuch", "--configs", "configs/toy_{recipe}.yaml"])
    with pytest.raises(ttt.BenchmarkError, match="nosuch.*trainers/nosuch.py does not exist"):
        ttt.choose_recipes(args)
    args = ttt.parse_args(["--recipes", "grpo", "--configs", "configs/missing_{recipe}.yaml"])
    with pytest.raises(ttt.BenchmarkError, match="missing_grpo.yaml does not exist"):
        ttt.choose_recipes(args)


def test_quick_defaults_and_what_the_flags_override():
    quick = ttt.parse_args(["--quick"])
    assert (quick.target, quick.eval_every, quick.stop_after_target, quick.min_judge) == (
        ttt.QUICK.target, ttt.QUICK.eval_every, ttt.QUICK.stop_after_target, ttt.QUICK.min_judge)
    assert f"steps={ttt.QUICK.steps}" in ttt.harness_overrides(0, 3, quick=True, overwrite=False)
    full = ttt.parse_args([])
    assert (full.target, full.eval_every, full.stop_after_target, full.min_judge) == (0.8, 5, None, 0.8)
    assert not any(o.startswith("steps=") for o in ttt.harness_overrides(0, 5, quick=False, overwrite=False))
    given = ttt.parse_args(["--quick", "--target", "0.5", "--stop-after-target", "2", "--min-judge", "0.4"])
    assert (given.target, given.stop_after_target, given.min_judge) == (0.5, 2, 0.4)


def test_the_plot_is_written(tmp_path):
    grpo = write_run(tmp_path / "grpo", CROSSING_ROWS)
    nft = write_run(tmp_path / "nft", CROSSING_ROWS[:3], recipe="nft")
    results = [ttt.time_to_target(run, 0.8, 128) for run in (grpo, nft)]
    out = ttt.plot_time_to_target([grpo, nft], results, 0.8, 0.8, tmp_path / "plot.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_end_to_end_on_a_tiny_grpo_run(tmp_path):
    """The script itself on toy-digits: the JSON's keys, the PNG, the kept run dir, --stop-after-target.

    Target 0 is reached by the base evaluation; with --stop-after-target 1 the
    run of 1000 tiny steps is ended soon after its next evaluation.
    """
    out_json = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--recipes", "grpo", "--configs", "configs/toy_{recipe}.yaml",
         "--out-dir", str(tmp_path / "runs"), "--json", str(out_json), "--eval-every", "1", "--target", "0.0",
         "--stop-after-target", "1", "--", "steps=1000", "data.prompts_per_step=2", "data.group_size=2",
         "sampling.steps=2", "sampling.eval_seeds=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(out_json.read_text())
    for name in ("time_to_target_s", "train_time_to_target_s", "samples_to_target", "steps_to_target",
                 "judge_at_target", "diversity_at_target", "final_reward", "final_judge", "best_reward", "wall_s"):
        assert f"grpo_{name}" in out
    for key in ("best_recipe", "best_speedup_over_grpo", "target", "quick"):
        assert key in out
    assert (out["grpo_steps_to_target"], out["grpo_samples_to_target"], out["grpo_time_to_target_s"]) == (0, 0, 0.0)
    assert out["samples_per_step"] == 4 and out["quick"] is False and out["card"] == "toy-digits"
    assert out["grpo_stopped_early"] is True
    assert (tmp_path / "time_to_target.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = read_metrics(tmp_path / "runs" / "grpo")  # a process ended mid-write may leave a partial last line
    assert 2 <= len(rows) < 1000 and rows[-1]["step"] < 1000  # ended early, after the step-1 evaluation
    assert all("eval/reward/mean" in r for r in rows)
    assert out["grpo_final_reward"] == pytest.approx(rows[-1]["eval/reward/mean"])
    # A second run into the same folder is refused before anything runs.
    again = subprocess.run([sys.executable, str(SCRIPT), "--recipes", "grpo", "--configs", "configs/toy_{recipe}.yaml",
                            "--out-dir", str(tmp_path / "runs")], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 2 and "holds an earlier run" in again.stderr
