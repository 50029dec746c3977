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
            "data.prompts_per_step": 8, "data.group_size": 16, "seed": 0, "eval.every": 5,
            "eval.guidance_scale": 1.0, "eval.seeds": 4, "eval.steps": 10,
            "sampling.height": None, "sampling.width": None}


def test_configs_that_agree_pass():
    ttt.check_agreement({"grpo": dict(SETTINGS), "nft": dict(SETTINGS), "awm": dict(SETTINGS)})


def test_configs_that_disagree_name_every_key_and_value():
    nft = {**SETTINGS, "data.group_size": 8, "eval.seeds": 2}
    with pytest.raises(ttt.BenchmarkError) as e:
        ttt.check_agreement({"grpo": dict(SETTINGS), "nft": nft})
    message = str(e.value)
    assert "data.group_size: grpo=16, nft=8" in message
    assert "eval.seeds: grpo=4, nft=2" in message
    assert "prompts_per_step" not in message  # keys that agree are not listed


def test_comparable_settings_of_a_real_config():
    cfg = ttt.resolve_recipe_config("grpo", ROOT / "configs" / "toy_grpo.yaml",
                                    ["seed=3", "eval.every=7", "sampling.steps=6", "data.group_size=4"])
    settings = ttt.comparable_settings(cfg)
    assert set(settings) == set(ttt.COMPARABLE_KEYS)
    assert settings["seed"] == 3 and settings["eval.every"] == 7 and settings["data.group_size"] == 4
    assert settings["eval.steps"] == 6  # unset: the evaluation uses sampling.steps
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
    assert settings["grpo"]["model.card"] == "toy-numbers" and settings["grpo"]["reward.scorers"] == "number_alignment:1.0"
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


def test_dppo_is_a_grpo_option_in_the_default_ranking():
    assert "dppo" in ttt.DEFAULT_RECIPES and ttt.trainer_of("dppo") == "grpo"
    cfg = ttt.resolve_recipe_config("dppo", ttt.config_path_for(ttt.DEFAULT_CONFIGS, "dppo"), [])
    assert cfg.train.policy_loss == "dppo"


def test_cached_entries_run_their_recipes_config_with_the_cache(tmp_path, capsys):
    args = ttt.parse_args(["--recipes", "grpo,nft,dpo", "--cached"])
    chosen = ttt.choose_recipes(args)
    assert [r for r, _ in chosen] == ["grpo", "nft", "dpo", "nft+cache", "dpo+cache"]
    assert dict(chosen)["nft+cache"] == dict(chosen)["nft"] == ROOT / "configs" / "toy_numbers_nft.yaml"
    assert ttt.trainer_of("nft+cache") == "nft" and ttt.base_recipe("awm+cache") == "awm"
    assert ttt.recipe_overrides("awm+cache", 0.2) == ["sampling.cache_threshold=0.2"]
    assert ttt.recipe_overrides("awm", 0.2) == []
    cfg = ttt.resolve_recipe_config("dpo+cache", dict(chosen)["dpo"], ttt.recipe_overrides("dpo+cache", 0.15))
    assert cfg.sampling.cache_threshold == 0.15 and cfg.sampling.sampler == "ode"
    # Named directly, without --cached; GRPO's rollouts are refused (every step stochastic).
    assert [r for r, _ in ttt.choose_recipes(ttt.parse_args(["--recipes", "awm+cache"]))] == ["awm+cache"]
    with pytest.raises(ttt.BenchmarkError, match="grpo\\+cache: cached rollouts are for the recipes that train"):
        ttt.choose_recipes(ttt.parse_args(["--recipes", "grpo+cache"]))
    with pytest.raises(SystemExit):
        ttt.parse_args(["--cached", "--cache-threshold", "0"])
    assert ttt.main(["--recipes", "grpo,awm", "--cached", "--check-only", "--out-dir", str(tmp_path / "runs")]) == 0
    assert "awm+cache: 50 steps, sampling.cache_threshold=0.15" in capsys.readouterr().out


def test_a_target_the_eval_reward_cannot_take_and_a_cached_flag_that_adds_nothing_are_refused_before_a_run(
        tmp_path):
    out = ["--configs", "configs/toy_numbers_{recipe}.yaml", "--out-dir", str(tmp_path / "runs")]
    with pytest.raises(ttt.BenchmarkError, match=r"--target 1.01: the eval reward \(number_alignment:1.0\) lies in "
                                                 r"\[0, 1\], so no recipe can reach it; choose a target of at most 1"):
        ttt.run_benchmark(ttt.parse_args(["--recipes", "grpo", "--target", "1.01", *out]), tmp_path / "runs")
    ttt.check_target_reachable(1.0, "number_alignment:1.0")  # the top is reachable
    ttt.check_target_reachable(0.0, "number_alignment:1.0")  # the floor: the base evaluation is there
    with pytest.raises(ttt.BenchmarkError, match=r"lies in \[-1.5, 0.5\]"):  # a negative weight's ends swap
        ttt.check_target_reachable(0.6, "digit_alignment:0.5,number_alignment:-1.5")
    ttt.check_target_reachable(5.0, "jpeg_compressibility:1.0")  # no declared range: no bound to check
    with pytest.raises(ttt.BenchmarkError, match=r"--cached adds <recipe>\+cache for each of nft, awm, dpo that "
                                                 r"runs, and none of them is in --recipes grpo"):
        ttt.choose_recipes(ttt.parse_args(["--recipes", "grpo", "--cached"]))
    assert not (tmp_path / "runs").exists()


def test_output_paths_that_cannot_be_written_are_refused_when_parsed(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for flag, value, why in (("--json", a_file / "out.json", f"{a_file} is a file, so no folder can be made there"),
                             ("--json", tmp_path, f"{tmp_path} is a folder; give a file path"),
                             ("--plot", a_file / "p.png", f"{a_file} is a file")):
        with pytest.raises(SystemExit):
            ttt.parse_args([flag, str(value)])
        assert why in capsys.readouterr().err
    # The plot's default goes beside --json: a --json in a folder still to be made is fine.
    args = ttt.parse_args(["--json", str(tmp_path / "new" / "out.json")])
    assert args.plot == tmp_path / "new" / "time_to_target.png" and not (tmp_path / "new").exists()


def test_an_asked_recipe_that_does_not_exist_is_an_error():
    args = ttt.parse_args(["--recipes", "grpo,nosuch", "--configs", "configs/toy_{recipe}.yaml"])
    with pytest.raises(ttt.BenchmarkError, match=r"nosuch.*trainers/nosuch.py does not exist \(the recipes: grpo, nft, .*draft; each of "
                                                 r"nft, awm, dpo also as <recipe>\+cache\)"):
        ttt.choose_recipes(args)
    args = ttt.parse_args(["--recipes", "grpo", "--configs", "configs/missing_{recipe}.yaml"])
    with pytest.raises(ttt.BenchmarkError, match="missing_grpo.yaml does not exist"):
        ttt.choose_recipes(args)


def test_quick_defaults_and_what_the_flags_override():
    quick = ttt.parse_args(["--quick"])
    assert (quick.target, quick.eval_every, quick.stop_after_target, quick.min_judge) == (
        ttt.QUICK.target, ttt.QUICK.eval_every, ttt.QUICK.stop_after_target, ttt.QUICK.min_judge)
    assert f"steps={ttt.QUICK.steps}" in ttt.harness_overrides(0, 3, quick=True, overwrite=False)
    assert quick.seeds == [0]  # --quick keeps one seed
    full = ttt.parse_args([])
    assert (full.target, full.eval_every, full.stop_after_target, full.min_judge) == (0.8, 5, 2, 0.8)
    assert full.seeds == [0, 1, 2]  # the full run: three seeds, each run ended 2 evaluations after its target
    assert not any(o.startswith("steps=") for o in ttt.harness_overrides(0, 5, quick=False, overwrite=False))
    given = ttt.parse_args(["--quick", "--target", "0.5", "--stop-after-target", "2", "--min-judge", "0.4"])
    assert (given.target, given.stop_after_target, given.min_judge) == (0.5, 2, 0.4)
    assert ttt.parse_args(["--no-stop"]).stop_after_target is None
    assert ttt.parse_args(["--seeds", "3,1"]).seeds == [3, 1] and ttt.parse_args(["--seed", "4"]).seeds == [4]
    for bad in (["--seeds", "1,1"], ["--seeds", "a"], ["--seeds", "1", "--seed", "2"],
                ["--no-stop", "--stop-after-target", "1"]):
        with pytest.raises(SystemExit):
            ttt.parse_args(bad)


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
         "--stop-after-target", "1", "--seed", "0", "--", "steps=1000", "data.prompts_per_step=2", "data.group_size=2",
         "sampling.steps=2", "eval.seeds=1"],
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
    rows = read_metrics(tmp_path / "runs" / "seed_0" / "grpo")  # a process ended mid-write may leave a partial line
    assert 2 <= len(rows) < 1000 and rows[-1]["step"] < 1000  # ended early, after the step-1 evaluation
    assert all("eval/reward/mean" in r for r in rows)
    assert out["grpo_final_reward"] == pytest.approx(rows[-1]["eval/reward/mean"])
    # A second run into the same folder is refused before anything runs.
    again = subprocess.run([sys.executable, str(SCRIPT), "--recipes", "grpo", "--configs", "configs/toy_{recipe}.yaml",
                            "--out-dir", str(tmp_path / "runs")], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 2 and "holds an earlier run" in again.stderr


# ---- over seeds: median, spread, and the worst seed's judge ------------------------------------------------

TYP = "eval/judge/number_typicality/mean"


def seed_rows(cross_step, cross_wall, judge, typicality, diversity_key="eval/diversity"):
    """Evaluations at steps 0, 5, 10, 15; the reward first reaches 0.8 at `cross_step` (5 or 10) at `cross_wall`.

    The base diversity is 0.2 (in the step-0 evaluation for eval/diversity; for the training rollouts'
    `diversity`, in the step-1 row: the base weights' rollouts); at the crossing it is 0.1 (half the base)."""
    base = {"step": 0, "time/wall_s": 0.0, "eval/reward/mean": 0.2, SVC: 0.25, TYP: 0.3}
    rows = [base]
    if diversity_key == "eval/diversity":
        base["eval/diversity"] = 0.2
    else:
        rows.append({"step": 1, "time/wall_s": 1.0, "diversity": 0.2})
    for step in (5, 10, 15):
        reward = 0.85 if step >= cross_step else 0.6
        row = {"step": step, "time/wall_s": cross_wall * step / cross_step, "eval/reward/mean": reward,
               SVC: judge if step == cross_step else 0.5, TYP: typicality if step == cross_step else 0.05,
               diversity_key: 0.1 if step == cross_step else 0.15}
        rows.append(row)
    return rows


# recipe -> per seed (crossing step, wall time at the crossing, judge there, typicality there)
FABRICATED = {
    "grpo": [(10, 120.0, 0.85, 0.4), (10, 100.0, 0.9, 0.5), (10, 140.0, 0.82, 0.45)],
    # nft is the fastest, but its judge at the target is 0.723 on seed 1: not eligible (the case).
    "nft": [(5, 10.0, 0.85, 0.3), (5, 12.0, 0.723, 0.2), (5, 8.0, 0.9, 0.35)],
    "awm": [(5, 20.0, 0.81, 0.5), (10, 40.0, 0.88, 0.6), (5, 25.0, 0.86, 0.55)],
}


@pytest.fixture
def fabricated(tmp_path):
    """{seed: [TargetResult per recipe]} read back from fabricated run directories, as the benchmark reads them."""
    results = {}
    for seed in (0, 1, 2):
        results[seed] = []
        for recipe, per_seed in FABRICATED.items():
            step, wall, judge, typ = per_seed[seed]
            key = "diversity" if recipe == "awm" else "eval/diversity"  # awm logs only the rollouts' diversity
            run = write_run(tmp_path / f"seed_{seed}" / recipe, seed_rows(step, wall, judge, typ, key), recipe=recipe)
            results[seed].append(ttt.time_to_target(run, 0.8, samples_per_step=128, recipe=recipe, seed=seed))
    return results


def test_values_at_target_include_typicality_and_diversity_relative_to_the_base(fabricated):
    nft1 = fabricated[1][1]
    assert (nft1.recipe, nft1.seed, nft1.steps_to_target, nft1.time_to_target_s) == ("nft", 1, 5, 12.0)
    assert nft1.judge_at_target == 0.723 and nft1.typicality_at_target == 0.2  # the crossing row's, not later ones
    assert nft1.diversity_base == 0.2 and nft1.diversity_rel_at_target == pytest.approx(0.5)
    awm1 = fabricated[1][2]  # the training rollouts' diversity: its base is step 1's (the base weights' rollouts)
    assert awm1.diversity_base == 0.2 and awm1.diversity_rel_at_target == pytest.approx(0.5)


def test_the_ranking_counts_a_recipe_only_if_its_judge_holds_on_every_seed(fabricated):
    per_recipe = ttt.by_recipe(fabricated)
    assert ttt.eligible(per_recipe["grpo"], 0.8) and ttt.eligible(per_recipe["awm"], 0.8)
    assert not ttt.eligible(per_recipe["nft"], 0.8)  # seed 1: 0.723 < 0.8
    best, speedup, worst = ttt.rank_over_seeds(per_recipe, 0.8)
    # awm's times 20, 40, 25 -> median 25; grpo's 120, 100, 140 -> median 120: 4.8x.
    # Per seed: 120/20 = 6, 100/40 = 2.5, 140/25 = 5.6 -> the worst seed's 2.5.
    assert best == "awm" and speedup == pytest.approx(4.8) and worst == pytest.approx(2.5)
    # With a bar nft clears on every seed, it wins: median 10 -> 12x, worst seed 100/12.
    assert ttt.rank_over_seeds(per_recipe, 0.7) == ("nft", pytest.approx(12.0), pytest.approx(100 / 12))


def test_seed_json_has_the_median_spread_and_worst_seed_keys(fabricated):
    out = ttt.results_json(fabricated, target=0.8, min_judge=0.8)
    assert (out["awm_time_to_target_s_median"], out["awm_time_to_target_s_min"], out["awm_time_to_target_s_max"]) \
        == (25.0, 20.0, 40.0)
    assert out["awm_time_to_target_s"] == 25.0  # the plain key is the median
    assert (out["awm_steps_to_target_median"], out["awm_steps_to_target_min"], out["awm_steps_to_target_max"]) \
        == (5, 5, 10)
    assert out["nft_judge_at_target_seeds"] == [0.85, 0.723, 0.9] and out["nft_judge_at_target_min"] == 0.723
    assert out["nft_typicality_at_target_seeds"] == [0.3, 0.2, 0.35] and out["nft_typicality_at_target_min"] == 0.2
    assert out["grpo_typicality_at_target_min"] == 0.4
    assert out["awm_diversity_rel_at_target_min"] == pytest.approx(0.5)
    assert out["nft_judge_ok"] is False and out["awm_judge_ok"] is True
    assert out["eligible_recipes"] == ["grpo", "awm"] and out["best_recipe"] == "awm"
    assert out["best_speedup_over_grpo"] == pytest.approx(4.8)
    assert out["best_speedup_over_grpo_worst_seed"] == pytest.approx(2.5)
    assert out["best_judge_at_target"] == 0.81  # the best recipe's worst seed
    assert out["seeds"] == [0, 1, 2] and out["best_speedup_over_grpo_at_least"] is None
    json.loads(json.dumps(out, allow_nan=False))


def test_a_seed_that_never_reaches_the_target_makes_a_recipe_ineligible_and_its_median_can_stay_finite(tmp_path):
    results = {}
    for seed, (grpo_step, nft_step) in enumerate([(10, 5), (10, None), (10, 5)]):
        results[seed] = []
        for recipe, step in (("grpo", grpo_step), ("nft", nft_step)):
            rows = (seed_rows(step, 10.0 * step, 0.9, 0.5) if step is not None
                    else [{"step": s, "time/wall_s": float(s), "eval/reward/mean": 0.5, SVC: 0.9} for s in (0, 5, 10)])
            run = write_run(tmp_path / f"{seed}" / recipe, rows, recipe=recipe)
            results[seed].append(ttt.time_to_target(run, 0.8, 4, recipe=recipe, seed=seed))
    out = ttt.results_json(results, 0.8, 0.8)
    assert out["nft_time_to_target_s_seeds"] == [50.0, "inf", 50.0]
    assert out["nft_time_to_target_s_median"] == 50.0 and out["nft_time_to_target_s_max"] == "inf"
    assert out["nft_judge_at_target_min"] is None and out["nft_judge_ok"] is False  # the missing seed counts
    assert out["best_recipe"] == "grpo" and out["best_speedup_over_grpo"] == 1.0


def test_spread_and_lowest():
    assert ttt.spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert ttt.spread([1.0, 3.0]) == (2.0, 1.0, 3.0)
    assert ttt.spread([10.0, math.inf, 20.0]) == (20.0, 10.0, math.inf)
    assert ttt.spread([None, 4.0]) == (4.0, 4.0, 4.0) and ttt.spread([None]) == (None, None, None)
    assert ttt.lowest([0.9, 0.7]) == 0.7 and ttt.lowest([0.9, None]) is None and ttt.lowest([]) is None


def test_the_seed_table_and_the_banded_plot(fabricated, tmp_path):
    table = ttt.results_table(fabricated, 0.8)
    awm = next(line for line in table.splitlines() if line.startswith("awm "))
    assert "25.0s [20.0s-40.0s]" in awm and "0.81/0.88/0.86" in awm and awm.rstrip().endswith("yes")
    nft = next(line for line in table.splitlines() if line.startswith("nft "))
    assert "0.85/0.72/0.90" in nft and nft.rstrip().endswith("no")
    runs = {recipe: [Run.load(tmp_path / f"seed_{seed}" / recipe) for seed in (0, 1, 2)] for recipe in FABRICATED}
    curve = ttt.seed_curves(runs["awm"], "eval/reward/mean")
    # step 10: rewards 0.85 (seeds 0, 2) and 0.85 (seed 1 crosses there); step 5: 0.85, 0.6, 0.85
    assert curve[1][0] == 5 and curve[1][2:] == (0.85, 0.6, 0.85)
    out = ttt.plot_time_to_target(runs, fabricated, 0.8, 0.8, tmp_path / "plot.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_configs_own_used_run_dir_does_not_stop_the_benchmark(tmp_path, monkeypatch, capsys):
    """A user who ran configs/toy_numbers_grpo.yaml has runs/grpo-toy-numbers; the benchmark writes under
    --out-dir, yet its check refused with that config's run_dir and advice (resume=) that does not apply."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "grpo-toy-numbers").mkdir(parents=True)
    (tmp_path / "runs" / "grpo-toy-numbers" / "metrics.jsonl").write_text('{"step": 0}\n')
    assert ttt.main(["--recipes", "grpo", "--check-only", "--out-dir", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    (tmp_path / "out" / "seed_0" / "grpo").mkdir(parents=True)  # the benchmark's own earlier run
    (tmp_path / "out" / "seed_0" / "grpo" / "metrics.jsonl").write_text('{"step": 0}\n')
    assert ttt.main(["--recipes", "grpo", "--check-only", "--out-dir", str(tmp_path / "out")]) == 2
    assert "holds an earlier run: give another --out-dir, or --overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("argv, why", [
    (["--target", "nan"], "argument --target: nan must be a finite number"),
    (["--min-judge", "inf"], "argument --min-judge: inf must be a finite number"),
    (["--seeds", "1,,2"], "--seeds must be comma-separated integers (no empty entry)"),
    (["--cache-threshold", "0.2"], "--cache-threshold 0.2 sets the +cache entries' sampling.cache_threshold, and "
                                   "none runs"),
    (["--overwrite"], "--overwrite reuses run dirs under --out-dir"),
    # The harness's own keys: a run_dir= trained elsewhere and crashed at the end; seed= made every "seed" one run.
    (["--", "run_dir=/tmp/elsewhere"], "run_dir=/tmp/elsewhere after --: the benchmark sets it for every run and "
                                       "reports it (use --out-dir to keep the runs)"),
    (["--", "seed=5", "eval.every=7"], "seed=5, eval.every=7 after --: the benchmark sets it"),
])
def test_flags_and_overrides_that_would_be_ignored_or_misreported_are_refused_when_parsed(argv, why, capsys):
    with pytest.raises(SystemExit) as stop:
        ttt.parse_args(argv)
    assert stop.value.code == 2 and why in capsys.readouterr().err


def test_a_configs_pattern_with_another_field_is_a_benchmark_error():
    for pattern in ("configs/x{foo}.yaml", "configs/x{.yaml"):
        with pytest.raises(ttt.BenchmarkError, match=r"is not a pattern with \{recipe\} as its one field"):
            ttt.config_path_for(pattern, "grpo")
    assert ttt.parse_args(["--", "steps=40", "tracker=none"]).overrides == ["steps=40", "tracker=none"]  # allowed


def test_a_run_that_cannot_be_read_ends_on_one_line(monkeypatch, capsys, tmp_path):
    def unreadable(args, out_dir):
        raise ttt.RunDirError(f"{out_dir}/seed_0/grpo: no such directory")

    monkeypatch.setattr(ttt, "run_benchmark", unreadable)
    assert ttt.main(["--recipes", "grpo", "--quick"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: reading a run: ") and "no such directory" in err[0]
