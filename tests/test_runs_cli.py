"""`python -m flywheel.runs compare` and `list`: summaries, the table, its JSON, the PNG, and clear errors.

The hand-written runs below have final, best and wall-time values chosen by
hand (the numbers in the assertions are worked out from the rows, not read
back from the code). Two short real GRPO runs check the whole path end to end.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from flywheel.runs import compare as cmp
from flywheel.runs.__main__ import main
from flywheel.runs.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[1]
PNG_SIZE = (1600, 700)  # FIGURE_INCHES (16 x 7) at FIGURE_DPI 100


def write_run(path: Path, rows: list[dict] | None, steps: int | None = None, card: str = "toy-digits",
              info: dict | None = None, train: dict | None = None) -> Path:
    """A run directory as a recipe leaves it: config.yaml, metrics.jsonl, and run.json when `info` is given."""
    path.mkdir(parents=True)
    config = {"run_dir": str(path), "steps": steps, "model": {"card": card}}
    if train is not None:
        config["train"] = train
    (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if rows is not None:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if info is not None:
        (path / "run.json").write_text(json.dumps(info))
    return path


def svc(value):
    return {"eval/judge/digit_svc/mean": value, "eval/judge/digit_svc/3": 0.0}


# A newer run, still in progress (4 of 10 steps): run.json and time/wall_s. Its best eval reward (0.9 at
# step 2) is not its last (0.8 at step 4): a summary that took the last row as the best would say 0.8.
NEW_ROWS = [
    {"step": 0, "weight_version": 0, "eval/reward/mean": 0.4, **svc(0.5), "eval/judge/digit_typicality/mean": 0.125,
     "time/wall_s": 1.0},
    {"step": 1, "reward/mean": 0.5, "kl": 0.01, "diversity": 0.2, "time/step_s": 2.0, "time/wall_s": 3.0},
    {"step": 2, "reward/mean": 0.6, "kl": 0.02, "diversity": 0.18, "eval/reward/mean": 0.9, **svc(0.7),
     "time/step_s": 2.5, "time/wall_s": 5.5},
    {"step": 3, "reward/mean": 0.7, "kl": 0.03, "diversity": 0.15, "time/step_s": 1.5, "time/wall_s": 7.0},
    {"step": 4, "reward/mean": 0.8, "kl": 0.05, "diversity": 0.12, "eval/reward/mean": 0.8, **svc(0.6),
     "time/step_s": 2.25, "time/wall_s": 75.5},  # a resume: wall time went on while it was stopped
]
# An older, finished run: no run.json, no time/wall_s (wall = running sum of time/step_s), eval/diversity
# logged (preferred over the train rollouts' diversity), and a last evaluation that went NaN (null in the
# file): its final reward must show as nan, not as the evaluation before it. Its best is a tie (0.5 at steps
# 0 and 2): the earliest step is reported.
OLD_ROWS = [
    {"step": 0, "eval/reward/mean": 0.5, **svc(0.25), "eval/diversity": 0.3},
    {"step": 1, "kl": 0.5, "diversity": 0.9, "time/step_s": 1.5},
    {"step": 2, "kl": 0.25, "diversity": 0.9, "eval/reward/mean": 0.5, **svc(0.375), "eval/diversity": 0.25,
     "time/step_s": 2.25},
    {"step": 3, "kl": 0.125, "diversity": 0.9, "eval/reward/mean": None, **svc(0.0625), "eval/diversity": None,
     "time/step_s": 0.25},
]

NEW_SUMMARY = {"name": "new", "recipe": "nft", "card": "toy-digits", "steps_done": 4, "steps_configured": 10,
               "reward_final": 0.8, "reward_final_step": 4, "reward_best": 0.9, "reward_best_step": 2,
               "judge": "digit_svc", "judge_final": 0.6, "judge_at_best_reward": 0.7,
               "diversity_key": "diversity", "diversity_final": 0.12, "wall_s": 75.5, "best_checkpoint_step": 2,
               # An NFT run of before ref_mse had its name: its "kl" is the velocity MSE, read as ref_mse.
               "kl_final": None, "ref_mse_final": 0.05}
OLD_SUMMARY = {"name": "old", "recipe": "?", "card": "number-card", "steps_done": 3, "steps_configured": 3,
               "reward_final": None, "reward_final_step": 3, "reward_best": 0.5, "reward_best_step": 0,
               "judge": "digit_svc", "judge_final": 0.0625, "judge_at_best_reward": 0.25,
               "diversity_key": "eval/diversity", "diversity_final": None, "kl_final": 0.125,
               "wall_s": 4.0, "best_checkpoint_step": None,  # 1.5 + 2.25 + 0.25; no best/ (an older run)
               "ref_mse_final": None}  # recipe unknown: its kl stays a KL


@pytest.fixture
def two_runs(tmp_path):
    new = write_run(tmp_path / "runs" / "new", NEW_ROWS, steps=10, info={"recipe": "nft", "card": "toy-digits"})
    (new / "best").mkdir()  # best/ holds step 2, the best eval reward without a watch signal
    (new / "best" / "best.json").write_text(json.dumps({"step": 2, "reward": 0.9, "ema": False, "lora": False}))
    old = write_run(tmp_path / "runs" / "old", OLD_ROWS, steps=3, card="number-card")
    return new, old


def table_line(text: str, name: str) -> list[str]:
    """The cells of the table line of run `name` (cells are two or more spaces apart)."""
    import re

    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return re.split(r"\s{2,}", line.strip())


def test_summaries_hold_the_final_and_best_values_worked_out_by_hand(two_runs, tmp_path, capsys):
    new, old = two_runs
    out = tmp_path / "table.json"
    assert main(["compare", str(new), str(old), "--json", str(out), "--no-plot"]) == 0
    table = json.loads(out.read_text())
    for got, want, path in zip(table, (NEW_SUMMARY, OLD_SUMMARY), (new, old)):
        assert got == {**want, "path": str(path)}
    printed = capsys.readouterr().out
    assert table_line(printed, "new") == ["new", "nft", "toy-digits", "4/10", "0.800 @4", "0.900 @2", "digit_svc",
                                          "0.600", "0.700", "0.120", "1m15s", "@2"]
    assert table_line(printed, "old") == ["old", "?", "number-card", "3/3", "nan @3", "0.500 @0", "digit_svc",
                                          "0.062", "0.250", "nan", "4.0s", "-"]
    assert not (tmp_path / "compare.png").exists()  # --no-plot


def test_wall_time_uses_the_logged_clock_and_sums_step_times_where_there_is_none():
    rows = [{"step": 0}, {"step": 1, "time/step_s": 1.5}, {"step": 2, "time/wall_s": 10.0, "time/step_s": 9.0},
            {"step": 3, "time/step_s": 2.0}, {"step": 4, "time/step_s": None}]
    assert cmp._wall_times(rows) == [0.0, 1.5, 10.0, 12.0, 12.0]


def test_a_named_judge_is_reported_and_an_unknown_one_names_those_logged(two_runs, tmp_path, capsys):
    new, old = two_runs
    out = tmp_path / "t.json"
    assert main(["compare", str(new), str(old), "--judge", "digit_typicality", "--json", str(out), "--no-plot"]) == 0
    got = {r["name"]: r for r in json.loads(out.read_text())}
    # Only the new run's base evaluation has it; its best reward's step (2) has no typicality score.
    assert (got["new"]["judge"], got["new"]["judge_final"], got["new"]["judge_at_best_reward"]) == \
        ("digit_typicality", 0.125, None)
    assert (got["old"]["judge"], got["old"]["judge_final"]) == (None, None)
    capsys.readouterr()
    assert main(["compare", str(new), "--judge", "number_svc", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "number_svc" in err and "digit_svc, digit_typicality" in err


def test_duration_and_value_formats():
    assert [cmp.format_duration(s) for s in (None, 0.04, 59.94, 60.0, 125.9, 3599.0, 7260.0)] == \
        ["-", "0.0s", "59.9s", "1m00s", "2m05s", "59m59s", "2h01m"]
    assert [cmp.format_value(v) for v in (None, math.nan, 0.12345, 1.0, -math.inf, math.inf)] == [
        "-", "nan", "0.123", "1.000", "-inf", "inf"]  # a -inf reward showed as nan


def test_a_run_just_started_or_with_empty_metrics_shows_dashes(tmp_path, capsys):
    started = write_run(tmp_path / "started", None, steps=5)  # config.yaml only: killed before the base eval
    empty = write_run(tmp_path / "empty", [], steps=5)
    assert main(["compare", str(started), str(empty), "--json", str(tmp_path / "t.json"), "--no-plot"]) == 0
    printed = capsys.readouterr().out
    for name in ("started", "empty"):
        assert table_line(printed, name) == [name, "?", "toy-digits", "0/5", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert json.loads((tmp_path / "t.json").read_text())[0]["reward_final"] is None


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "no such directory"),
    (lambda p: p.write_text("x"), "is not a directory"),
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("x")), "is not a run directory"),
    (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')),
     "metrics.jsonl: cannot read the metrics"),
    # one line of garbage: not a killed writer's partial row, so not a run with no rows (it showed as 0/2)
    (lambda p: (p.mkdir(), (p / "config.yaml").write_text("steps: 2\n"), (p / "metrics.jsonl").write_text("garbage")),
     "line 1 is not valid JSON"),
    (lambda p: (p.mkdir(), (p / "config.yaml").write_text("steps: 2\n"), (p / "run.json").write_text("[1]")),
     "run.json: expected a JSON object"),
])
def test_compare_names_a_path_that_is_not_a_readable_run(tmp_path, capsys, make, message):
    bad = tmp_path / "bad"
    make(bad)
    good = write_run(tmp_path / "good", NEW_ROWS, steps=10)
    assert main(["compare", str(good), str(bad), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(bad) in err and message in err


def test_runs_with_the_same_folder_name_are_told_apart(tmp_path):
    a = write_run(tmp_path / "sweep1" / "run", NEW_ROWS, steps=10)
    b = write_run(tmp_path / "sweep2" / "run", OLD_ROWS, steps=3)
    other = write_run(tmp_path / "other", OLD_ROWS, steps=3)
    assert [r.name for r in cmp.load_runs([a, b, other])] == [str(a), str(b), "other"]


def test_list_sorts_newest_first_and_skips_folders_that_are_not_runs(two_runs, tmp_path, capsys):
    new, old = two_runs
    root = tmp_path / "runs"
    (root / "scratch").mkdir()
    (root / "compare.png").write_bytes(b"")  # plain files are passed over silently
    # The old run was written last (a minute after the new one): it comes first.
    for run, mtime in ((new, 1_700_000_000), (old, 1_700_000_060)):
        for entry in (*run.iterdir(), run):
            os.utime(entry, (mtime, mtime))
    assert main(["list", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "recipe", "card", "steps", "last", "eval", "reward", "judge", "best/",
                                "modified"]
    assert table_line("\n".join(lines), "old")[:7] == ["old", "?", "number-card", "3/3", "nan @3", "digit_svc 0.062",
                                                       "-"]
    assert table_line("\n".join(lines), "new")[:7] == ["new", "nft", "toy-digits", "4/10", "0.800 @4",
                                                       "digit_svc 0.600", "@2"]
    assert [line.split()[0] for line in lines[2:4]] == ["old", "new"]
    assert lines[4].startswith("skipped scratch:") and "not a run directory" in lines[4]
    assert len(lines) == 5

    # Touch the new run's metrics (a step appended): now it is the newest.
    os.utime(new / "metrics.jsonl", (1_700_000_120, 1_700_000_120))
    runs, _ = cmp.list_runs(root)
    assert [r.name for r in runs] == ["new", "old"]


def test_list_of_a_missing_folder_is_an_error(tmp_path, capsys):
    assert main(["list", str(tmp_path / "nope")]) == 2
    assert "nope: no such directory" in capsys.readouterr().err


def test_without_matplotlib_the_table_is_printed_and_the_plot_error_says_what_to_install(two_runs, tmp_path,
                                                                                           capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    new, old = two_runs
    assert main(["compare", str(new), str(old), "--out", str(tmp_path / "c.png")]) == 2
    captured = capsys.readouterr()
    assert table_line(captured.out, "new")[4] == "0.800 @4"
    assert "matplotlib" in captured.err and "--no-plot" in captured.err
    assert not (tmp_path / "c.png").exists()


def assert_png(path: Path) -> None:
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == PNG_SIZE
        image.load()  # decodes the whole file: a truncated PNG fails here
        # Not a blank canvas: the curves and text put many distinct colours in it.
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 50


def test_the_plot_is_a_png_of_the_documented_size(two_runs, tmp_path):
    pytest.importorskip("matplotlib", reason="the compare plot needs matplotlib (not a dependency yet)")
    new, old = two_runs
    out = tmp_path / "plots" / "cmp.png"
    assert main(["compare", str(new), str(old), "--out", str(out)]) == 0
    assert_png(out)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """Two short real GRPO runs (in process, a few seconds): 2 steps, an eval every step."""
    pytest.importorskip("matplotlib", reason="the compare plot needs matplotlib (not a dependency yet)")
    from trainers.grpo import main as grpo_main

    root = tmp_path_factory.mktemp("real_runs")
    common = ["eval.every=1", "save_every=2", "sample_every=2", "data.prompts_per_step=2", "data.group_size=4",
              "eval.seeds=1", "sampling.steps=4", "tracker=none", "train.kl_beta=0", "train.log_kl=false",
              "steps=2"]
    grpo_main([f"run_dir={root / 'a'}", *common])
    grpo_main([f"run_dir={root / 'b'}", *common, "train.learning_rate=1e-3"])
    return root / "a", root / "b"


@pytest.mark.slow  # ~7 s on a quiet 2-core machine (two runs and a subprocess), over a minute on a loaded one
def test_compare_on_two_real_runs_writes_the_table_and_the_png(real_runs, tmp_path):
    """Acceptance: `python -m flywheel.runs compare` on two short runs writes the table and the PNG."""
    a, b = real_runs
    out, table_json = tmp_path / "compare.png", tmp_path / "table.json"
    proc = subprocess.run([sys.executable, "-m", "flywheel.runs", "compare", str(a), str(b), "--json",
                           str(table_json)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert_png(out)  # the default --out: compare.png in the current directory
    summaries = json.loads(table_json.read_text())
    for run, summary in zip((a, b), summaries):
        rows = read_metrics(run)
        evals = [(r["step"], r["eval/reward/mean"]) for r in rows if "eval/reward/mean" in r]
        assert [s for s, _ in evals] == [0, 1, 2]  # eval.every=1, and the base model at step 0
        best_step, best = max(evals, key=lambda e: (e[1], -e[0]))
        assert not any("kl" in r for r in rows)  # train.log_kl=false, kl_beta 0: no reference, so no "kl" logged
        info = run / "run.json"
        assert summary == {
            "name": run.name, "path": str(run),
            "recipe": json.loads(info.read_text())["recipe"] if info.exists() else "?",
            "card": "toy-digits", "steps_done": 2, "steps_configured": 2,
            "reward_final": evals[-1][1], "reward_final_step": 2, "reward_best": best, "reward_best_step": best_step,
            "best_checkpoint_step": best_step,  # best/: the best evaluation, none of them flagged by the watch
            "judge": "digit_svc", "judge_final": rows[-1]["eval/judge/digit_svc/mean"],
            "judge_at_best_reward": rows[best_step]["eval/judge/digit_svc/mean"],
            "diversity_key": "eval/diversity" if "eval/diversity" in rows[-1] else "diversity",
            "diversity_final": rows[-1].get("eval/diversity", rows[-1]["diversity"]), "kl_final": None,
            "ref_mse_final": None,
            "wall_s": rows[-1]["time/wall_s"] if "time/wall_s" in rows[-1]
            else sum(r.get("time/step_s", 0.0) for r in rows),
        }
        assert table_line(proc.stdout, run.name)[3:5] == ["2/2", f"{evals[-1][1]:.3f} @2"]
    assert f"wrote {out.name}" in proc.stdout


# ---- metrics a run did not measure ------------------------------------------------------------

# Three KL-less rows: `kl` absent (a recipe that logs only what it measures), or 0.0 as the older NFT wrote it.
def kl_rows(kl_values):
    rows = [{"step": 0, "eval/reward/mean": 0.4}]
    for step, kl in enumerate(kl_values, start=1):
        rows.append({"step": step, "reward/mean": 0.5, **({} if kl is None else {"kl": kl}),
                     "eval/reward/mean": 0.4 + step / 10})
    return rows


@pytest.fixture
def kl_runs(tmp_path):
    """Runs whose `kl` is measured (grpo, dpo) or not (nft: absent, older nft: a placeholder 0.0)."""
    root = tmp_path / "runs"
    return {
        "nft": write_run(root / "nft", kl_rows([None, None]), 2, info={"recipe": "nft"}, train={"kl_beta": 0.0}),
        "nft-old": write_run(root / "nft-old", kl_rows([0.0, 0.0]), 2, info={"recipe": "nft"},
                             train={"kl_beta": 0.0}),
        "nft-kl": write_run(root / "nft-kl", kl_rows([0.0, 0.25]), 2, info={"recipe": "nft"},
                            train={"kl_beta": 0.01}),
        # kl_beta 0 but log_kl on: measured, and exactly 0 while the policy has not moved from its reference.
        "grpo": write_run(root / "grpo", kl_rows([0.0, 0.0]), 2, info={"recipe": "grpo"},
                          train={"kl_beta": 0.0, "log_kl": True}),
        # No kl_beta in its config (DPO always measures the distance to its reference).
        "dpo": write_run(root / "dpo", kl_rows([0.0, 0.0]), 2, info={"recipe": "dpo"}, train={"beta": 2.0}),
        # A placeholder needs every value to be exactly 0: one non-zero value means it was measured.
        "awm": write_run(root / "awm", kl_rows([0.0, 0.5]), 2, info={"recipe": "awm"}, train={"kl_beta": 0.0}),
    }


def test_a_kl_the_run_did_not_measure_is_left_out_and_a_measured_zero_is_kept(kl_runs):
    runs = {name: cmp.Run.load(path) for name, path in kl_runs.items()}
    kl_final = {name: cmp.summarize(run).kl_final for name, run in runs.items()}
    ref_mse_final = {name: cmp.summarize(run).ref_mse_final for name, run in runs.items()}
    # Only GRPO's kl is a KL; the others' (older runs' "kl") is their velocity MSE, in its own column.
    assert kl_final == {"nft": None, "nft-old": None, "nft-kl": None, "grpo": 0.0, "dpo": None, "awm": None}
    assert ref_mse_final == {"nft": None, "nft-old": None, "nft-kl": 0.25, "grpo": None, "dpo": 0.0, "awm": 0.5}
    assert runs["nft-old"].series("kl") == [] and runs["nft-old"].last("kl") is None
    assert [p[2] for p in runs["grpo"].series("kl")] == [0.0, 0.0]
    assert [cmp.kl_placeholder(r) for r in runs.values()] == [True, True, False, False, False, False]
    # Other keys of the same runs are untouched.
    assert [p[2] for p in runs["nft-old"].series("eval/reward/mean")] == pytest.approx([0.4, 0.5, 0.6])


def test_the_plot_draws_no_kl_line_for_a_run_that_did_not_measure_it(kl_runs, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    drawn = []  # (axes, label) of every line plotted
    real_plot = Axes.plot

    def recording_plot(self, *args, **kwargs):
        drawn.append((self, kwargs.get("label")))
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording_plot)
    new_nft = write_run(tmp_path / "runs" / "nft-new", [{"step": 0, "eval/reward/mean": 0.4},
                                                         {"step": 1, "ref_mse": 0.5, "eval/reward/mean": 0.5}], 1,
                        info={"recipe": "nft"}, train={"kl_beta": 0.01})
    runs = cmp.load_runs([kl_runs[n] for n in ("nft", "nft-old", "grpo", "nft-kl")] + [new_nft])
    out = cmp.plot_runs(runs, cmp.compare(runs), tmp_path / "kl.png")
    assert_png(out)
    kl_axes = {ax for ax, _ in drawn if ax.get_title() == "KL to reference"}
    assert len(kl_axes) == 2  # against step and against wall time
    for ax in kl_axes:  # GRPO's Gaussian KL alone: NFT's distance is a velocity MSE, on its own axes
        assert sorted(label for a, label in drawn if a is ax) == ["grpo (grpo)"]
        assert [t.get_text() for t in ax.texts] == ["not logged: nft, nft-old, nft-kl, nft-new"]
    mse_axes = {ax for ax, _ in drawn if ax.get_title() == "velocity MSE to reference"}
    assert len(mse_axes) == 2 and not mse_axes & kl_axes
    for ax in mse_axes:  # an older run's "kl" and a newer run's "ref_mse" of NFT, side by side
        assert sorted(label for a, label in drawn if a is ax) == ["nft-kl (nft)", "nft-new (nft)"]
        assert [t.get_text() for t in ax.texts] == ["not logged: nft, nft-old, grpo"]
    reward_axes = {ax for ax, _ in drawn if ax.get_title() == "eval reward"}
    for ax in reward_axes:  # every run measured the reward: five lines, no note
        assert len([1 for a, _ in drawn if a is ax]) == 5 and not ax.texts


def test_nft_and_awm_losses_log_no_distance_without_a_reference_and_ref_mse_with_one():
    import torch

    from trainers.awm import awm_loss
    from trainers.nft import nft_loss

    torch.manual_seed(0)
    v, v_old, x0, noise = (torch.randn(2, 3) for _ in range(4))
    t, r = torch.tensor([0.3, 0.7]), torch.tensor([0.2, 0.9])
    _, stats = nft_loss(v, v_old, x0, noise, t, r, beta=1.0)
    assert "kl" not in stats and "ref_mse" not in stats and "loss" in stats
    _, stats = nft_loss(v, v_old, x0, noise, t, r, beta=1.0, v_ref=v_old, kl_beta=0.0)  # measured, not penalised
    assert float(stats["ref_mse"]) == pytest.approx(float(((v - v_old) ** 2).mean()), rel=1e-6)
    assert "kl" not in stats  # a velocity MSE is not logged as a KL
    _, stats = awm_loss(v, x0, noise, t, torch.tensor([1.0, -1.0]))
    assert not {"kl", "ref_mse", "anchor_kl", "anchor_mse"} & set(stats) and "loss" in stats
    _, stats = awm_loss(v, x0, noise, t, torch.tensor([1.0, -1.0]), v_ref=v_old, kl_beta=0.0)
    assert float(stats["ref_mse"]) == pytest.approx(float(((v - v_old) ** 2).mean()), rel=1e-6)
    assert "kl" not in stats


# ---- compare --config-diff --------------------------------------------------------------------


def test_config_diff_shows_the_keys_on_which_the_runs_differ(tmp_path, capsys):
    a = write_run(tmp_path / "a", NEW_ROWS, 10, train={"learning_rate": 0.0003, "clip_range": 0.0001,
                                                         "targets": ["to_q", "to_k"], "ema": False})
    b = write_run(tmp_path / "b", NEW_ROWS, 20, train={"learning_rate": 0.001, "clip_range": 0.0001,
                                                         "targets": ["to_q"], "ema": False, "guard": True})
    c = write_run(tmp_path / "c", NEW_ROWS, 10, card="sd3", train={"learning_rate": 0.0003, "clip_range": 0.0001,
                                                                     "targets": ["to_q", "to_k"], "ema": True})
    assert main(["compare", str(a), str(b), str(c), "--config-diff", "--no-plot"]) == 0
    printed = capsys.readouterr().out
    diff = printed[printed.index("config keys that differ"):].splitlines()
    assert diff[0] == "config keys that differ (6; run_dir left out):"
    assert diff[1].split() == ["key", "a", "b", "c"]
    assert [table_line("\n".join(diff), key) for key in ("steps", "model.card", "train.learning_rate",
                                                           "train.targets", "ema.enabled", "train.guard")] == [
        ["steps", "10", "20", "10"],
        ["model.card", "toy-digits", "toy-digits", "sd3"],
        ["train.learning_rate", "0.0003", "0.001", "0.0003"],
        ["train.targets", '["to_q", "to_k"]', '["to_q"]', '["to_q", "to_k"]'],
        ["ema.enabled", "false", "false", "true"],
        ["train.guard", "(absent)", "true", "(absent)"],
    ]
    assert len(diff) == 2 + 1 + 6  # header, rule, six keys: clip_range and run_dir are not there
    assert "clip_range" not in printed and "run_dir" not in diff[2]


def test_config_diff_of_identical_configs_says_so_and_of_one_run_is_an_error(tmp_path, capsys):
    a = write_run(tmp_path / "x" / "run", NEW_ROWS, 10, train={"learning_rate": 0.001})
    b = write_run(tmp_path / "y" / "run", OLD_ROWS, 10, train={"learning_rate": 0.001})
    assert main(["compare", str(a), str(b), "--config-diff", "--no-plot"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "the runs' configs are the same (apart from run_dir)"
    assert main(["compare", str(a), "--config-diff", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config-diff") and "two runs or more" in err


def test_flatten_config_gives_dotted_keys_with_lists_and_empty_sections_as_leaves():
    assert cmp.flatten_config({"a": 1, "b": {"c": [1, 2], "d": {"e": None}, "f": {}}}) == \
        {"a": 1, "b.c": [1, 2], "b.d.e": None, "b.f": {}}


# ---- list: nested folders ---------------------------------------------------------------------


def test_list_finds_runs_in_nested_folders_and_not_inside_runs(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root / "plain", NEW_ROWS, 10)
    write_run(root / "sweep" / "lr-1e-3" / "seed-0", NEW_ROWS, 10, info={"recipe": "grpo"})
    write_run(root / "sweep" / "lr-1e-3" / "seed-1", OLD_ROWS, 3)
    write_run(root / "a" / "b" / "c" / "d", OLD_ROWS, 3)  # 4 levels below root: found
    write_run(root / "e" / "f" / "g" / "h" / "i", OLD_ROWS, 3)  # 5 levels: past the limit
    started = root / "started"  # config.yaml only: not a run directory
    started.mkdir()
    (started / "config.yaml").write_text("steps: 2\n")
    (root / "scratch" / "notes").mkdir(parents=True)
    # Inside a run: its checkpoints, wandb and any other folder are not searched (a copy of a run's files in
    # checkpoints/ must not show as a run).
    write_run(root / "plain" / "checkpoints" / "step_2", NEW_ROWS, 10)
    write_run(root / "plain" / "extra", NEW_ROWS, 10)
    write_run(root / "wandb" / "offline-run-1", NEW_ROWS, 10)  # a wandb folder anywhere is passed over
    write_run(root / ".hidden" / "run", NEW_ROWS, 10)

    assert main(["list", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = sorted(line.split()[0] for line in lines[2:] if not line.startswith(("skipped", "did not")))
    assert names == ["a/b/c/d", "plain", "sweep/lr-1e-3/seed-0", "sweep/lr-1e-3/seed-1"]
    assert table_line("\n".join(lines), "sweep/lr-1e-3/seed-0")[:3] == ["sweep/lr-1e-3/seed-0", "grpo", "toy-digits"]
    notes = [line for line in lines if line.startswith(("skipped", "did not"))]
    assert notes == [
        "skipped e: not a run directory, and no run directory in it",
        "skipped scratch: not a run directory, and no run directory in it",
        "skipped started: it holds config.yaml but neither metrics.jsonl nor run.json, so it is not a run "
        "directory",
        f"did not look deeper than 4 levels below {root} (folders not searched under: e/f/g/h); run list on a "
        "deeper folder to see runs there",
    ]
    # A deeper limit finds the fifth level; a limit of 1 only the folders directly in root.
    runs, _ = cmp.list_runs(root, max_depth=5)
    assert "e/f/g/h/i" in [r.name for r in runs]
    runs, _ = cmp.list_runs(root, max_depth=1)
    assert [r.name for r in runs] == ["plain"]
    # The run directory itself, given as the root, is listed.
    runs, notes = cmp.list_runs(root / "plain")
    assert [r.name for r in runs] == ["plain"] and notes == []
    assert main(["list", str(root), "--max-depth", "0"]) == 2
    assert "--max-depth 0" in capsys.readouterr().err


def test_list_follows_a_symlinked_folder_once(tmp_path):
    root = tmp_path / "runs"
    write_run(root / "sweep" / "a", NEW_ROWS, 10)
    (root / "sweep" / "loop").symlink_to(root, target_is_directory=True)  # a cycle: runs/sweep/loop -> runs
    runs, _ = cmp.list_runs(root)
    assert [r.name for r in runs] == ["sweep/a"]


def test_output_paths_are_checked_before_the_table_is_printed(two_runs, tmp_path, capsys):
    new, old = two_runs
    a_file = tmp_path / "file"
    a_file.write_text("")
    for argv, why in ([["--json", str(tmp_path)], "is a folder (or empty); give a file path"],
                      [["--out", str(a_file / "c.png")], f"{a_file} is a file, so no folder can be made there"],
                      [["--out", "/proc/flywheel.png"], "cannot write in /proc"],
                      [["--no-plot", "--out", str(tmp_path / "c.png")], "with --no-plot: no plot is written"]):
        assert main(["compare", str(new), str(old), "--json", str(tmp_path / "t.json"), *argv]) == 2
        captured = capsys.readouterr()
        assert why in captured.err and captured.out == "", (argv, captured)  # no half output
        assert not (tmp_path / "t.json").exists()


def test_the_same_run_named_twice_is_refused(two_runs, tmp_path, capsys):
    new, _ = two_runs
    assert main(["compare", str(new), str(new) + "/", "--no-plot"]) == 2
    assert "the same run is named more than once" in capsys.readouterr().err
