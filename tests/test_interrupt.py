"""A run stopped by Ctrl-C or SIGTERM ends on one line (what is kept, how to go on), not a traceback, with the
shell's exit status (130, 143); the resume line it prints works."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel import cli
from flywheel.guards import NonFiniteError, NoSignalError
from flywheel.sync.engine_process import EngineProcessError, EngineProcessTimeout
from flywheel.runs.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_the_line_names_the_newest_complete_checkpoint_and_the_resume_command(tmp_path):
    assert cli.interrupted_message("Ctrl-C", None, "trainers/nft.py") == (
        "interrupted (Ctrl-C) before the run directory was created: nothing was written")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert cli.interrupted_message("SIGTERM", str(run), "trainers/nft.py") == (
        f"interrupted (SIGTERM): no checkpoint was written yet in {run}; start again with overwrite=true")
    for name in ("step_000002", "step_000004"):
        (run / "checkpoints" / name).mkdir()
        (run / "checkpoints" / name / "manifest.json").write_text("{}")
    (run / "checkpoints" / ".step_000006.tmp").mkdir()  # a save the interrupt cut short is not named
    assert cli.interrupted_message("Ctrl-C", str(run), "trainers/grpo.py") == (
        f"interrupted (Ctrl-C): the newest checkpoint is {run / 'checkpoints' / 'step_000004'}; continue with "
        f"`python trainers/grpo.py resume={run}`")


def _raise(exc):
    def main():
        raise exc
    return main


@pytest.mark.parametrize("exc, code, how", [(KeyboardInterrupt(), 130, "Ctrl-C"),
                                            (SystemExit(128 + signal.SIGTERM), 143, "SIGTERM")])
def test_run_main_turns_an_interrupt_into_its_line_and_status(exc, code, how, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_opened_run_dir", None)
    with pytest.raises(SystemExit) as stop:
        cli.run_main(_raise(exc))
    assert stop.value.code == code
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"interrupted ({how}) before the run directory was created: nothing was written")


@pytest.mark.parametrize("code", [0, 1, 2, "a message"])
def test_other_exits_pass_through_unchanged(code, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.run_main(_raise(SystemExit(code)))
    assert stop.value.code == code
    assert "interrupted" not in capsys.readouterr().err


class _ExitCalled(Exception):
    pass


@pytest.mark.parametrize("main, code, printed", [(lambda: None, 0, ""),
                                                 (_raise(ValueError("bad step")), 1, "ValueError: bad step"),
                                                 (_raise(NoSignalError("step 4: flat")), 1, "error: step 4: flat"),
                                                 (_raise(KeyboardInterrupt()), 130, "interrupted (Ctrl-C)")])
def test_a_rank_holding_its_process_group_leaves_by_os_exit_without_freeing_it(main, code, printed, capsys,
                                                                              monkeypatch):
    # A multi-process rank must never free the DDP wrapper (its reducer's destructor can deadlock on the GIL):
    # every way out of run_main is os._exit with the status the run earned, the holder still alive.
    import weakref

    class Holder:
        pass

    holder = Holder()
    alive = weakref.ref(holder)
    exits = []

    def fake_exit(status):
        exits.append(status)
        raise _ExitCalled

    monkeypatch.setattr(cli, "_kept_until_exit", [])
    monkeypatch.setattr(cli, "_opened_run_dir", None)
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    handlers = []
    monkeypatch.setattr(cli.atexit, "_run_exitfuncs", lambda: handlers.append("ran"))
    cli.keep_until_exit(holder)
    del holder
    with pytest.raises(_ExitCalled):
        cli.run_main(main)
    assert exits == [code]
    assert handlers == ["ran"]  # logging and trackers flush as at a normal exit
    assert alive() is not None
    assert printed in capsys.readouterr().err


def opened_run_with_checkpoint(tmp_path, step: int, monkeypatch):
    """A run dir holding a checkpoint of `step`, noted as the one the recipe opened (what run_main reports)."""
    run = tmp_path / "run"
    (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (run / "checkpoints" / f"step_{step:06d}" / "manifest.json").write_text("{}")
    monkeypatch.setattr(cli, "_kept_until_exit", [])
    monkeypatch.setattr(cli, "_opened_run_dir", str(run))
    return run


@pytest.mark.parametrize("exc", [NonFiniteError("step 3: the loss is nan"), NoSignalError("step 3: flat"),
                                 EngineProcessError("engine process (pid 7, card 'toy-digits') was killed by SIGKILL "
                                                    "during 'pause'"),
                                 EngineProcessTimeout("engine process at 127.0.0.1:1 did not answer 'generate'")])
def test_a_run_that_stopped_itself_ends_on_its_message_and_what_it_kept(exc, tmp_path, capsys, monkeypatch):
    run = opened_run_with_checkpoint(tmp_path, 2, monkeypatch)
    with pytest.raises(SystemExit) as stop:
        cli.run_main(_raise(exc))
    assert stop.value.code == cli.RUN_STOPPED_EXIT == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {exc}", f"the newest checkpoint is {run / 'checkpoints' / 'step_000002'}; continue from it after "
        f"the change with `python {sys.argv[0]} resume={run}`"]
    assert cli.kept_message(None, "trainers/nft.py") == "the run directory was not created: nothing was written"
    (run / "checkpoints" / "step_000002" / "manifest.json").unlink()
    assert cli.kept_message(str(run), "trainers/nft.py") == (
        f"no checkpoint was written yet in {run}; start again with overwrite=true after the change")


def test_a_single_process_error_still_raises_as_python_would(monkeypatch):
    monkeypatch.setattr(cli, "_kept_until_exit", [])
    with pytest.raises(ValueError, match="bad step"):
        cli.run_main(_raise(ValueError("bad step")))


# The recipe as a shell starts it, with Python's SIGINT handler (a child inherits an ignored SIGINT, and the test
# process may have come to ignore it).
LAUNCH = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def test_ctrl_c_mid_run_prints_the_resume_line_and_that_line_resumes(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = ["trainers/nft.py", "tracker=none", f"run_dir={run}", "steps=200", "save_every=1", "eval.every=100",
            "data.prompts_per_step=2", "data.group_size=4"]
    trainer = subprocess.Popen([sys.executable, "-c", LAUNCH, *args], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while latest_checkpoint(run) is None and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trainer.poll() is None, trainer.communicate()[1][-2000:]
        trainer.send_signal(signal.SIGINT)
        _, err = trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    latest = latest_checkpoint(run)
    line = err.strip().splitlines()[-1]
    assert line == (f"interrupted (Ctrl-C): the newest checkpoint is {latest}; continue with "
                    f"`python trainers/nft.py resume={run}`")
    # The printed command goes on from that checkpoint (one step further, to keep the test short).
    command = line.split("`")[1].split()[1:] + [f"steps={int(latest.name.split('_')[1]) + 1}"]
    resumed = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


@pytest.mark.parametrize("processes, kept", [(2, True), (1, False)])
def test_a_multi_process_session_keeps_its_wrapped_transformer_until_exit(processes, kept, monkeypatch):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from flywheel.recipe.session import RecipeRun

    wrapped = object()
    accelerator = SimpleNamespace(num_processes=processes, distributed_type=DistributedType.MULTI_CPU,
                                  prepare=lambda model, optimizer: (wrapped, optimizer))
    run = RecipeRun.__new__(RecipeRun)
    run.accelerator, run._optimizer_state_to_shard = accelerator, None
    monkeypatch.setattr(cli, "_kept_until_exit", [])
    run.prepare(SimpleNamespace(transformer=object(), ref_velocity=None), "optimizer")
    assert (cli._kept_until_exit == [wrapped]) is kept


def _disk_full_safetensors():
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _wrapped_enospc():
    try:
        raise OSError(28, "No space left on device", "metrics.jsonl")
    except OSError as e:
        try:
            raise RuntimeError("could not append the row") from e
        except RuntimeError as outer:
            return outer


@pytest.mark.parametrize("make", [lambda: OSError(28, "No space left on device", "best/weights.safetensors"),
                                  _disk_full_safetensors, _wrapped_enospc])
def test_a_full_disk_ends_on_one_line_with_what_was_kept(make, tmp_path, capsys, monkeypatch):
    run = opened_run_with_checkpoint(tmp_path, 4, monkeypatch)
    exc = make()
    with pytest.raises(SystemExit) as stop:
        cli.run_main(_raise(exc))
    assert stop.value.code == cli.RUN_STOPPED_EXIT
    first, second = capsys.readouterr().err.strip().splitlines()
    assert first.startswith(f"error: no space left on the device of the run directory ({run}): ")
    assert first.endswith("free space there or give another run_dir")
    assert second.startswith(f"the newest checkpoint is {run / 'checkpoints' / 'step_000004'}")


@pytest.mark.parametrize("exc", [OSError(13, "Permission denied"), ValueError("os error 28"),
                                 RuntimeError("No space left on device (os error 28)")])
def test_other_errors_are_not_taken_for_a_full_disk(exc, monkeypatch):
    monkeypatch.setattr(cli, "_kept_until_exit", [])
    assert not cli.disk_full(exc)
    with pytest.raises(type(exc)):
        cli.run_main(_raise(exc))


def test_a_full_disk_before_the_run_dir_exists_says_so(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_kept_until_exit", [])
    monkeypatch.setattr(cli, "_opened_run_dir", None)
    with pytest.raises(SystemExit):
        cli.run_main(_raise(OSError(28, "No space left on device")))
    first, second = capsys.readouterr().err.strip().splitlines()
    assert first.startswith("error: no space left on a device this run writes to: ")
    assert second == "the run directory was not created: nothing was written"


@pytest.mark.parametrize("code, name", [(13, "EACCES"), (1, "EPERM"), (30, "EROFS"), (122, "EDQUOT")])
def test_a_refused_write_into_the_run_dir_ends_on_one_line_with_what_was_kept(code, name, tmp_path, capsys,
                                                                              monkeypatch):
    import os as os_

    run = opened_run_with_checkpoint(tmp_path, 4, monkeypatch)
    target = run / "checkpoints" / ".step_000005.tmp"
    try:  # as a write deep in a writer raises it: chained under another error
        raise OSError(code, os_.strerror(code), str(target))
    except OSError as e:
        exc = RuntimeError("could not save")
        exc.__cause__ = e
    with pytest.raises(SystemExit) as stop:
        cli.run_main(_raise(exc))
    assert stop.value.code == cli.RUN_STOPPED_EXIT
    first, second = capsys.readouterr().err.strip().splitlines()
    assert first == (f"error: cannot write {target} in the run directory: {os_.strerror(code)} ({name}); make "
                     f"{run} writable again and resume, or give another run_dir")
    assert second.startswith(f"the newest checkpoint is {run / 'checkpoints' / 'step_000004'}")


@pytest.mark.parametrize("exc", [OSError(13, "Permission denied", "/etc/model/weights.safetensors"),
                                 OSError(13, "Permission denied"), OSError(2, "No such file", "{run}/x")])
def test_a_refused_path_outside_the_run_dir_or_another_error_keeps_its_traceback(exc, tmp_path, monkeypatch):
    run = opened_run_with_checkpoint(tmp_path, 4, monkeypatch)
    if exc.filename:
        exc.filename = exc.filename.replace("{run}", str(run))
    assert cli.run_dir_unwritable(exc, str(run)) is None
    with pytest.raises(OSError):
        cli.run_main(_raise(exc))


def test_a_run_whose_checkpoints_dir_turns_immutable_mid_run_stops_on_one_line_and_resumes(tmp_path):
    # chattr +i refuses even root's writes (EPERM): the next checkpoint cannot be made.
    probe = tmp_path / "probe"
    probe.mkdir()
    if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = ["trainers/nft.py", "tracker=none", f"run_dir={run}", "steps=30", "save_every=1", "eval.every=100",
            "data.prompts_per_step=2", "data.group_size=4"]
    trainer = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while latest_checkpoint(run) is None and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        subprocess.run(["chattr", "+i", str(run / "checkpoints")], check=True)
        _, err = trainer.communicate(timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(run / "checkpoints")], capture_output=True)
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == cli.RUN_STOPPED_EXIT, err[-2000:]
    assert "Traceback" not in err
    first, second = err.strip().splitlines()[-2:]
    assert first.startswith(f"error: cannot write {run / 'checkpoints'}")
    assert first.endswith(f"in the run directory: Operation not permitted (EPERM); make {run} writable again and "
                          "resume, or give another run_dir")
    latest = latest_checkpoint(run)
    assert second == (f"the newest checkpoint is {latest}; continue from it after the change with "
                      f"`python trainers/nft.py resume={run}`")
    resumed = subprocess.run([sys.executable, "trainers/nft.py", f"resume={run}",
                              f"steps={int(latest.name.split('_')[1]) + 1}"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def _maps_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc to know torch is loading")
def test_ctrl_c_while_the_recipe_still_imports_is_one_line_not_a_traceback(tmp_path):
    # The first seconds of a run are imports (torch, diffusers' families): the usual moment to stop a run started
    # with the wrong config. The interrupt lands once torch's library is mapped, long before the run dir exists.
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    trainer = subprocess.Popen([sys.executable, "-c", LAUNCH, "trainers/grpo.py", "tracker=none", f"run_dir={run}"],
                               cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not _maps_torch(trainer.pid) and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        trainer.send_signal(signal.SIGINT)
        _, err = trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines() == [
        "interrupted (Ctrl-C) before the run directory was created: nothing was written"]
    assert trainer.returncode in (130, -signal.SIGINT)  # run_main's exit, or Python's own end by SIGINT
    assert not run.exists()


def test_the_import_time_hook_is_only_installed_for_a_script():
    from flywheel import quiet_interrupt

    assert not quiet_interrupt.install("trainers.grpo")  # imported (tests, a notebook): a REPL keeps its Ctrl-C
