"""Issue 22, item 6: one run per run directory. The main process holds an flock on <run>/.flywheel.lock for the
whole run; a second run there is refused with one `error:` line and exit 2; a run killed -9 leaves no lock."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel.runs.rundir import LOCK_FILENAME, RunDir, RunDirInUseError, RunDirLock
from launched import run_process_group

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
HOLD = ("import sys, time; from flywheel.runs.rundir import RunDirLock; RunDirLock(sys.argv[1]).acquire(); "
        "print('locked', flush=True); time.sleep(600)")


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process holding the run dir's lock, as a running recipe does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def kill_9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_second_process_is_refused_while_the_lock_is_held_and_not_after_a_kill_9(tmp_path):
    holder = hold_lock(tmp_path / "run")
    try:
        with pytest.raises(RunDirInUseError, match=rf"run_dir {tmp_path / 'run'} is in use: another run "
                                                   rf"\(pid {holder.pid}\) is running in it"):
            RunDir(tmp_path / "run", lock=True)
        assert not (tmp_path / "run" / "checkpoints").exists()  # refused before anything was made
    finally:
        kill_9(holder)
    assert (tmp_path / "run" / LOCK_FILENAME).is_file()  # the file stays; its flock died with the process
    run = RunDir(tmp_path / "run", lock=True)
    assert run.lock.held and (tmp_path / "run" / LOCK_FILENAME).read_text() == f"{os.getpid()}\n"
    run.release()
    assert not run.lock.held


def test_within_one_process_a_later_run_takes_the_lock_over(tmp_path):
    first = RunDir(tmp_path / "run", lock=True)
    second = RunDir(tmp_path / "run", mode="overwrite", lock=True)  # e.g. an earlier run ended by an exception
    assert second.lock.held and not first.lock.held
    first.release()  # the earlier one's release leaves the later one's lock alone
    assert second.lock.held
    second.release()
    # The lock file is not a run file: a fresh run still counts the directory as empty, overwrite keeps it.
    RunDir(tmp_path / "run", lock=True).release()
    assert (tmp_path / "run" / LOCK_FILENAME).is_file()


def test_a_run_started_in_a_directory_another_run_holds_exits_2_with_one_line(tmp_path):
    holder = hold_lock(tmp_path / "run")
    try:
        out = subprocess.run([sys.executable, str(ROOT / "trainers" / "grpo.py"), f"run_dir={tmp_path / 'run'}",
                              "tracker=none", "steps=1"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                             timeout=300)
    finally:
        kill_9(holder)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (f"error: run_dir {tmp_path / 'run'} is in use: another run (pid "
                                                   f"{holder.pid}) is running in it; wait for it to end, or choose "
                                                   "another run_dir")
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_FILENAME]  # nothing of a run written


@pytest.mark.slow
def test_a_running_recipe_holds_its_lock_until_it_ends(tmp_path):
    """A real run: while it trains, a second run into its directory is refused (the duplicated metrics.jsonl of
    issue 22 cannot happen); once it has ended, its lock is free."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, str(ROOT / "trainers" / "grpo.py"), f"run_dir={run_dir}",
                              "tracker=none", "steps=40", "eval.seeds=1", "data.prompts_per_step=2",
                              "data.group_size=4", "sampling.steps=4", "eval.every=1000", "sample_every=1000"],
                             cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "config.yaml").exists() and time.monotonic() < deadline:
            assert first.poll() is None
            time.sleep(0.05)
        with pytest.raises(RunDirInUseError, match=rf"pid {first.pid}"):
            RunDirLock(run_dir).acquire()
    finally:
        kill_9(first)
    RunDirLock(run_dir).acquire().release()  # killed -9: the kernel let go of it


@pytest.mark.slow
def test_under_two_ranks_a_held_run_dir_stops_both_without_a_hang(tmp_path):
    """Only the main rank takes the lock; its refusal reaches the other rank, which would otherwise wait for it
    at the next collective."""
    holder = hold_lock(tmp_path / "run")
    try:
        out = run_process_group([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                              "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                              str(ROOT / "trainers" / "grpo.py"), f"run_dir={tmp_path / 'run'}", "tracker=none",
                              "steps=1"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        kill_9(holder)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: run_dir {tmp_path / 'run'} is in use")
    assert "exitcode  : 2" in out.stderr  # the ranks' own exit, under the launcher's table


def stopped_run(path: Path, last_step: int) -> Path:
    """What a recipe run leaves when stopped before its first checkpoint, after `last_step` steps."""
    run = RunDir(path)
    run.write_config({"seed": 1})
    (run.path / "run.json").write_text('{"recipe": "grpo", "card": "toy-digits"}\n')
    for step in range(last_step + 1):
        run.metrics.append({"step": step, "eval/reward/mean": 0.5})
    (run.samples_dir / "samples_000000.png").write_bytes(b"png")
    (run.path / "flywheel").mkdir()  # a tracker's folder
    return run.path


def test_a_run_stopped_before_its_first_step_counts_as_fresh_and_one_after_says_to_overwrite(tmp_path, capfd):
    fresh = RunDir(stopped_run(tmp_path / "unstarted", 0), tracker_dirs=("flywheel",))
    assert sorted(p.name for p in fresh.path.iterdir()) == ["checkpoints", "samples"]  # its files replaced
    assert "holds a run that stopped before its first training step" in capfd.readouterr().err
    with pytest.raises(RunDirInUseError, match=r"stopped after step 2, before its first checkpoint, so there is "
                                               r"nothing to resume from\. Pass overwrite=true"):
        RunDir(stopped_run(tmp_path / "started", 2))
    # A checkpoint (even one a killed save left half-written) makes it a run to resume, not to redo.
    path = stopped_run(tmp_path / "saving", 0)
    (path / "checkpoints" / ".step_000001.tmp").mkdir()
    with pytest.raises(RunDirInUseError, match=f"Pass resume={path} to continue"):
        RunDir(path)
    # Without run.json (not a recipe's run) nothing is deleted.
    path = stopped_run(tmp_path / "bare", 0)
    (path / "run.json").unlink()
    with pytest.raises(RunDirInUseError, match="is already used"):
        RunDir(path)
