"""A Ctrl-C or SIGTERM during a checkpoint write waits for the write (flywheel.runs.deferred_signals): it used to
discard the checkpoint half-written, and the resume went back one checkpoint."""

import os
import signal

import pytest

from flywheel.runs.checkpoint import verify_checkpoint
from flywheel.runs.deferred_signals import signals_deferred

TINY = ["tracker=none", "eval.seeds=1", "data.prompts_per_step=2", "data.group_size=4", "sampling.steps=4",
        "sample_every=1000", "eval.every=1000"]


def test_a_ctrl_c_inside_the_block_is_said_and_raised_once_the_block_ends(capsys):
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred("the checkpoint of step 3"):
            os.kill(os.getpid(), signal.SIGINT)
            finished.append("the write")
    assert finished == ["the write"]
    assert capsys.readouterr().err == "Ctrl-C: finishing the checkpoint of step 3 first (again to stop at once)\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_second_ctrl_c_stops_at_once():
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred("the checkpoint"):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            finished.append("the write")
    assert finished == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_reaches_the_handler_installed_before_the_block(capsys):
    from flywheel.cli import sigterm_as_exit

    finished = []
    with sigterm_as_exit(), pytest.raises(SystemExit) as info:
        with signals_deferred("the checkpoint"):
            os.kill(os.getpid(), signal.SIGTERM)
            finished.append("the write")
    assert info.value.code == 128 + signal.SIGTERM and finished == ["the write"]
    assert "SIGTERM: finishing the checkpoint first" in capsys.readouterr().err


def test_no_signal_no_change():
    with signals_deferred("the checkpoint"):
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_as_a_checkpoint_is_written_keeps_that_checkpoint(tmp_path, monkeypatch):
    import flywheel.recipe.session as session
    from trainers.grpo import main

    real = session.save_checkpoint

    def interrupted_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # lands inside the write, as a user's Ctrl-C at that moment would
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "save_checkpoint", interrupted_save)
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        main([f"run_dir={run_dir}", *TINY, "steps=3", "save_every=1"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]
    verify_checkpoint(run_dir / "checkpoints" / "step_000001")  # complete: every file and checksum
