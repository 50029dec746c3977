"""Issue 22, item 5 and item 4's resume parts: a key given with resume= takes effect and is recorded in
config.yaml, or is refused naming it; another recipe's run is refused naming both; a resume refusal is one
`error:` line with exit 2; a run stopped before its first checkpoint starts again in its own directory."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flywheel.runs.config import load_config
from flywheel.runs.resume import RESUMABLE_KEYS, ResumeError, config_changes
from flywheel.runs.rundir import read_metrics

from recipe_kill import kill_after_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = ["tracker=none", "eval.seeds=1", "data.prompts_per_step=2", "data.group_size=4", "sampling.steps=4",
        "sample_every=1000", "eval.every=1000"]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A 3-step grpo run killed -9 once its step-1 checkpoint is on disk (its lock file left behind)."""
    root = tmp_path_factory.mktemp("killed")
    prompts = root / "eval_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"the number {d}", "digit": d}) + "\n" for d in (3, 7)))
    run_dir = root / "run"
    kill_after_checkpoint("grpo", run_dir, [*TINY, f"data.eval_prompts={prompts}", "steps=3", "save_every=1"], step=1)
    return run_dir


@pytest.fixture
def run(killed_run, tmp_path):
    """A copy of the killed run for one test."""
    return Path(shutil.copytree(killed_run, tmp_path / "run"))


def tree_hashes(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def grpo(argv):
    from trainers.grpo import main

    return main(argv)


def test_a_key_that_may_not_change_is_refused_by_name_before_anything_is_written(run, tmp_path):
    before = tree_hashes(run)
    with pytest.raises(ResumeError, match=r"train\.clip_range \(the run has 0\.0001, given 0\.2\): this key cannot "
                                          r"change on resume\. The keys that may: steps, eval\.every"):
        grpo([f"resume={run}", "train.clip_range=0.2"])
    # A --config file given with resume= is read too: a key it changes is refused the same way.
    changed = tmp_path / "changed.yaml"
    changed.write_text("sampling:\n  steps: 6\ndata:\n  group_size: 4\n")  # group_size as the run has it
    with pytest.raises(ResumeError, match=r"resume=.*: sampling\.steps \(the run has 4, given 6\): this key"):
        grpo([f"resume={run}", "--config", str(changed)])
    assert tree_hashes(run) == before


def test_another_recipes_run_is_refused_naming_both_recipes(run):
    from trainers.nft import main as nft

    with pytest.raises(ResumeError, match=r"that run was trained by the grpo recipe \(its run\.json\) and this is "
                                          r"the nft recipe; resume it with trainers/grpo\.py"):
        nft([f"resume={run}"])


def test_steps_before_the_checkpoint_are_refused(run):
    with pytest.raises(ResumeError, match=r"steps=0 is before the checkpoint's step 1 .*give steps >= 1"):
        grpo([f"resume={run}", "steps=0"])


def test_resuming_a_finished_run_says_it_trained_nothing_and_reports_the_runs_final_evaluation(tmp_path, capsys):
    run_dir = tmp_path / "done"
    first = grpo([f"run_dir={run_dir}", *TINY, "steps=2", "eval.every=2", "save_every=1"])
    capsys.readouterr()
    again = grpo([f"resume={run_dir}", "steps=2"])
    captured = capsys.readouterr()
    out = captured.out
    # The checkpoint it continues is named (resume= gave the run dir: its newest complete checkpoint).
    assert (f"resume: continuing from {run_dir / 'checkpoints' / 'step_000002'} (step 2, weight version 2) to "
            f"step 2") in captured.err
    assert "resume at step 2: the run already has its 2 steps, so this session trained nothing; give steps > 2" in out
    assert again["final"]["eval/reward/mean"] == first["final"]["eval/reward/mean"]  # not NaN
    assert f"final {first['final']['eval/reward/mean']:.3f}" in out
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]  # nothing appended


def test_config_changes_name_each_dotted_key_with_both_values():
    before = {"steps": 3, "run_dir": "a", "train": {"learning_rate": 3e-4, "betas": [0.9, 0.99]}, "x": {}}
    after = {"steps": 5, "run_dir": "b", "train": {"learning_rate": 3e-4, "betas": [0.9, 0.9]}, "x": {}}
    assert config_changes(before, after) == {"steps": (3, 5), "train.betas": ([0.9, 0.99], [0.9, 0.9])}
    assert {"steps", "train.learning_rate", "eval.every"} <= RESUMABLE_KEYS.keys()
    assert not {"seed", "reward.scorers", "data.prompts_per_step", "train.clip_range"} & RESUMABLE_KEYS.keys()
    # A run whose video rollouts timed out resumes with a longer wait.
    assert {"rollout.call_timeout_s", "rollout.start_timeout_s"} <= RESUMABLE_KEYS.keys()


def test_the_getting_started_page_lists_every_key_a_resume_may_change():
    page = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    table = page[page.index("| key | why it may change |"):].split("\n\n")[0]
    listed = {key for line in table.splitlines()[2:] for key in re.findall(r"`([\w.]+)`", line.split("|")[1])}
    assert listed == set(RESUMABLE_KEYS)


@pytest.mark.slow
def test_allowed_keys_take_effect_and_are_recorded_and_a_killed_runs_lock_does_not_block(run, capfd):
    from trainers.grpo import Config

    assert (run / ".flywheel.lock").is_file()  # left by the killed run; the kernel let go of its flock
    # The original command's values (unchanged keys) ride along without counting as changes.
    result = grpo([f"resume={run}", *TINY, "steps=2", "train.learning_rate=0.1"])
    assert result["run_dir"] == str(run) and result["trained_steps"] == 2
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["steps"] == 2 and saved["train"]["learning_rate"] == 0.1 and saved["resume"] is None
    assert saved["resume_overrides"] == [{"at_step": 1, "set": {"steps": 2, "train.learning_rate": 0.1},
                                          "was": {"steps": 3, "train.learning_rate": 0.0006}}]
    assert load_config(Config, run / "config.yaml").train.learning_rate == 0.1  # the record is skipped on read
    assert ("resume at step 1: steps=2 (was 3), train.learning_rate=0.1 (was 0.0006); recorded in "
            f"{run / 'config.yaml'} under resume_overrides") in capfd.readouterr().err
    # The optimizer stepped at the new rate: AdamW's param group in the step-2 checkpoint (step 1's kept the default 6e-4).
    groups = lambda step: json.loads((run / "checkpoints" / f"step_{step:06d}" / "optimizer.json").read_text())
    assert [g["lr"] for g in groups(2)["param_groups"]] == [0.1]
    assert [g["lr"] for g in groups(1)["param_groups"]] == [0.0006]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]


def test_a_refused_resume_is_one_error_line_with_exit_2(run):
    out = subprocess.run([sys.executable, str(ROOT / "trainers" / "grpo.py"), f"resume={run}", "seed=5"],
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: resume={run}: seed (the run has 0, given 5): this key cannot change")
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_starts_again_in_its_own_dir(tmp_path, monkeypatch, capfd):
    import trainers.grpo

    prompts = tmp_path / "eval_prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the number 3", "digit": 3}) + "\n")
    command = [f"run_dir={tmp_path / 'r'}", *TINY, f"data.eval_prompts={prompts}", "steps=1"]
    original = trainers.grpo.GRPO.update

    def dies(*args, **kwargs):
        raise KeyboardInterrupt  # a Ctrl-C in the first update: config, run.json, step 0's row are written

    monkeypatch.setattr(trainers.grpo.GRPO, "update", dies)
    with pytest.raises(KeyboardInterrupt):
        grpo(command)
    assert [r["step"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [0]
    with pytest.raises(ResumeError, match=r"no checkpoint in .*Start it again with the same command without resume="):
        grpo([f"resume={tmp_path / 'r'}"])
    monkeypatch.setattr(trainers.grpo.GRPO, "update", original)
    grpo(command)  # no overwrite=true needed
    assert "holds a run that stopped before its first training step" in capfd.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [0, 1]  # not [0, 0, 1]


def test_a_refused_resume_after_the_checkpoint_loaded_has_written_nothing(run):
    """A metrics file with a garbage line is found only once the checkpoint is loaded; config.yaml used to be
    rewritten (resume_overrides) and metrics.jsonl truncated before that refusal."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[0] = "GARBAGE"
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    before = {k: v for k, v in tree_hashes(run).items() if k != ".flywheel.lock"}
    with pytest.raises(ResumeError, match=r"metrics.jsonl: line 1 is not valid JSON .*fix or remove that line"):
        grpo([f"resume={run}", *TINY, "steps=2"])
    assert {k: v for k, v in tree_hashes(run).items() if k != ".flywheel.lock"} == before


def test_a_learning_rate_recorded_by_a_resume_killed_before_its_checkpoint_is_the_one_trained_with(run):
    """A resume records train.learning_rate in config.yaml at once; killed before its first checkpoint, the
    next plain resume compared against config.yaml, saw no change, and kept the checkpoint's old rate."""
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["train"]["learning_rate"] = 0.1  # what the killed resume left: the record, and no checkpoint of it
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    grpo([f"resume={run}", *TINY, "steps=2"])
    optimizer = json.loads((run / "checkpoints" / "step_000002" / "optimizer.json").read_text())
    assert [g["lr"] for g in optimizer["param_groups"]] == [0.1]


def test_resuming_an_older_checkpoint_sets_the_later_timeline_aside(tmp_path, capfd):
    """Resume from step 1 of a run that reached step 3: its step-2/3 checkpoints and a best/ evaluated after
    step 1 move to abandoned/, so the next resume of the run dir continues the new timeline, not the old."""
    run = tmp_path / "run"
    grpo([f"run_dir={run}", *TINY, "steps=3", "save_every=1", "keep_checkpoints=3"])
    best = run / "best" / "best.json"
    best.write_text(json.dumps({**json.loads(best.read_text()), "step": 3, "reward": 1e9}) + "\n")  # unbeatable
    grpo([f"resume={run}/checkpoints/step_000001", *TINY, "steps=2", "train.learning_rate=0.1"])
    err = capfd.readouterr().err
    assert "resume at step 1: set aside what the run wrote after it (step_000002, step_000003, best/ (step 3))" in err
    [aside] = list((run / "abandoned").iterdir())
    held = sum(p.stat().st_size for p in (run / "abandoned").rglob("*") if p.is_file())
    assert f"({run / 'abandoned'} now holds {held / 2**20:.1f} MiB; delete what you no longer need)" in err
    assert sorted(p.name for p in aside.iterdir()) == ["best", "step_000002", "step_000003"]
    assert json.loads((aside / "best" / "best.json").read_text())["reward"] == 1e9
    assert not best.exists() or json.loads(best.read_text())["reward"] != 1e9
    grpo([f"resume={run}", *TINY, "steps=3"])  # continues from the new step 2, at the new rate
    optimizer = json.loads((run / "checkpoints" / "step_000003" / "optimizer.json").read_text())
    assert [g["lr"] for g in optimizer["param_groups"]] == [0.1]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2, 3]


def test_sample_grids_are_written_under_a_temporary_name(tmp_path, monkeypatch):
    """A kill during PIL's save left a torn samples_N.png; the grid now goes through the atomic writer."""
    import flywheel.recipe.session as session

    written = []
    real = session.atomic_write_bytes
    monkeypatch.setattr(session, "atomic_write_bytes", lambda path, data: written.append(Path(path).name)
                        or real(path, data))
    grpo([f"run_dir={tmp_path / 'run'}", *TINY, "steps=1"])
    assert written == sorted(p.name for p in (tmp_path / "run" / "samples").glob("samples_*.png")) != []


def test_a_prompts_file_whose_text_changed_at_the_same_count_is_refused_on_resume(tmp_path):
    """The data-position check compares counts only: an edited line resumed silently on other prompts."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"a handwritten {d}\n" for d in (1, 2, 3, 4)))
    run = tmp_path / "run"
    grpo([f"run_dir={run}", *TINY, f"data.prompts={prompts}", "steps=2", "save_every=1"])
    state = json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert len(state["data_sha256"]) == 64
    prompts.write_text(prompts.read_text().replace("a handwritten 3", "a handwritten 8"))
    before = {k: v for k, v in tree_hashes(run).items() if k != ".flywheel.lock"}
    with pytest.raises(ResumeError, match=r"the prompts of data.prompts .* changed since the checkpoint was saved "
                                          r"\(the same number, other text or metadata\)"):
        grpo([f"resume={run}", *TINY, "steps=3"])
    assert {k: v for k, v in tree_hashes(run).items() if k != ".flywheel.lock"} == before
    prompts.write_text(prompts.read_text().replace("a handwritten 8", "a handwritten 3"))  # put back: resumes
    grpo([f"resume={run}", *TINY, "steps=3"])
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.parametrize("file, edit, message", [
    ("trainer_state.json", lambda s: {**s, "weight_version": -5},
     r"trainer_state\.json has weight_version=-5; valid: a whole number from 0 to 2 \(the checkpoint.s step 1 \+ 1\)"),
    ("trainer_state.json", lambda s: {**s, "weight_version": 3}, r"has weight_version=3; valid: a whole number "
                                                                  r"from 0 to 2"),
    ("trainer_state.json", lambda s: {**s, "skipped_steps": "2"}, r"has skipped_steps='2'; valid"),
    ("trainer_state.json", lambda s: {**s, "masked_run": 2}, r"has masked_run=2; valid: a whole number from 0 to 1 "
                                                             r"\(the checkpoint's step 1\)"),
    ("trainer_state.json", lambda s: {k: v for k, v in s.items() if k != "weight_version"},
     r"has no 'weight_version'"),
    ("rng.json", lambda s: {**s, "python": {**s["python"], "state": s["python"]["state"][:5]}},
     r"rng\.safetensors / rng\.json hold no valid RNG state \(ValueError: state vector is the wrong size\)"),
    ("rng.json", lambda s: {**s, "numpy": {**s["numpy"], "keys": [-1]}}, r"hold no valid RNG state \(OverflowError"),
])
def test_a_hand_edited_checkpoint_whose_checksums_were_fixed_is_refused_naming_the_value(run, file, edit, message):
    """A tamperer who also re-hashes the manifest gets past verify_checkpoint: the values themselves are checked
    (a weight version of -5 used to be taken and stamped on every output; a bad rng.json was a TypeError)."""
    from test_checkpoint import rewrite_manifest

    ckpt = run / "checkpoints" / "step_000001"
    path = ckpt / file
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    rewrite_manifest(ckpt)
    before = {k: v for k, v in tree_hashes(run).items() if k != ".flywheel.lock"}
    with pytest.raises(ResumeError, match=message):
        grpo([f"resume={run}", "steps=2"])
    assert {k: v for k, v in tree_hashes(run).items() if k != ".flywheel.lock"} == before
