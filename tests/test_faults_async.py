"""Faults around async rollouts: the trainer dies, the engine process dies, a run is resumed.

The engine process must never outlive its trainer (whatever signal ended it),
no shared-memory segment of a dead run may stay in /dev/shm, a trainer whose
engine process died gets an error saying so, and a resumed async run differs
from an uninterrupted one exactly as docs/getting-started.md states.
"""

import gc
import glob
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import GenerationRequest, load_model
from flywheel.cli import sigterm_as_exit
from flywheel.sync.engine_process import EXIT_ORPHANED, EngineProcess, EngineProcessError, EngineProcessTimeout
from flywheel.runs.rundir import read_metrics
from flywheel.sync.controller import SharedMemoryTransport, WeightSyncController

ROOT = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/dev/shm").is_dir(),
                                reason="checks processes in /proc and segments in /dev/shm")
GONE_WITHIN_S = 10.0  # the engine polls its parent every 0.2 s; the rest is slack for a loaded machine

# A trainer as the async recipe runs one, minus everything that is not the engine process: it
# starts the engine, syncs the weights through shared memory (mapped into the engine's weights, or
# staged in buckets as for an engine on an accelerator), then keeps syncing and rolling out until a
# signal ends it. It has no cleanup of its own: whatever the signal, the engine must go.
TRAINER = r"""
import json, signal, sys
# A trainer started from a shell has Python's SIGINT handler; an ignored SIGINT is inherited across exec, and
# the test process may have come to ignore it (a library earlier in the suite): this child must not.
signal.signal(signal.SIGINT, signal.default_int_handler)
from engine import GenerationRequest, load_model
from flywheel.sync.engine_process import EngineProcess
from flywheel.sync.controller import SharedMemoryTransport, WeightSyncController

engine = EngineProcess.start("toy-digits", threads=1)
controller = WeightSyncController(engine, transport=SharedMemoryTransport(mapped=sys.argv[1] == "mapped"))
params = {n: p.detach() for n, p in load_model("toy-digits").transformer.named_parameters()}
controller.sync(params)
print(json.dumps({"engine_pid": engine.proc.pid}), flush=True)
request = GenerationRequest(prompt="3", seed=0, steps=2)
while True:
    controller.sync(params)
    engine.generate([request])
"""
KILL_CASES = [("mapped", signal.SIGKILL), ("mapped", signal.SIGTERM), ("mapped", signal.SIGINT),
              ("buckets", signal.SIGKILL)]


def running(pid: int) -> bool:
    """Whether `pid` is a live process (an exited one that nobody reaped is a zombie: not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def segments_of(*pids: int) -> list[str]:
    return sorted(s for pid in pids for s in glob.glob(f"/dev/shm/flywheel_{pid}_*"))


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def trainers():
    """One trainer per kill case, all started at once so that their imports overlap."""
    procs = {case: subprocess.Popen([sys.executable, "-c", TRAINER, case[0]], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True) for case in KILL_CASES}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def ready(proc: subprocess.Popen) -> dict:
    """The trainer's first line, once it has an engine process and has synced into it."""
    if not select.select([proc.stdout], [], [], 180)[0]:
        raise TimeoutError("the trainer did not start its engine process within 180 s")
    line = proc.stdout.readline()
    assert line, f"the trainer exited with code {proc.wait()} before it was ready"
    return json.loads(line)


@linux_only
@pytest.mark.parametrize("case", KILL_CASES, ids=lambda c: f"{c[0]}-{c[1].name}")
def test_a_dead_trainer_takes_its_engine_process_and_segments_with_it(trainers, case):
    mode, sig = case
    trainer = trainers[case]
    engine_pid = ready(trainer)["engine_pid"]
    try:
        # The run's segments, before: the engine's weights block (mapped), or the trainer's two buckets.
        assert len(segments_of(engine_pid if mode == "mapped" else trainer.pid)) == (1 if mode == "mapped" else 2)
        time.sleep(0.2)  # into the sync-and-generate loop
        trainer.send_signal(sig)
        trainer.wait(timeout=30)
        assert wait_until(lambda: not running(engine_pid), GONE_WITHIN_S), \
            f"the engine process {engine_pid} outlived its trainer (killed by {sig.name}) by {GONE_WITHIN_S} s"
        assert wait_until(lambda: not segments_of(trainer.pid, engine_pid), GONE_WITHIN_S), \
            f"segments left in /dev/shm: {segments_of(trainer.pid, engine_pid)}"
    finally:
        if running(engine_pid):  # what the code before the fix left behind
            os.kill(engine_pid, signal.SIGKILL)


def test_an_engine_process_whose_parent_is_already_gone_exits_before_loading_anything():
    """The race any parent-death watch has: the parent died before the child began to watch."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    result = subprocess.run([sys.executable, "-m", "flywheel.sync.engine_process", "--parent-pid", str(dead.pid)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "FLYWHEEL_ENGINE_AUTHKEY": "00"})
    assert result.returncode == EXIT_ORPHANED, result.stderr[-2000:]
    assert f"(pid {dead.pid}) is gone" in result.stderr
    assert result.stdout == ""  # it never got as far as serving (the port line)


def toy_params() -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in load_model("toy-digits").transformer.named_parameters()}


@linux_only
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_an_engine_process_that_dies_under_the_trainer_ends_in_an_error_saying_so(sig):
    # Started from a thread that then ends: the engine lives on (a parent-death signal would kill it here).
    box = {}
    starter = threading.Thread(target=lambda: box.update(engine=EngineProcess.start("toy-digits", threads=1)))
    starter.start()
    starter.join()
    engine = box["engine"]
    controller = WeightSyncController(engine, transport=SharedMemoryTransport())
    params = toy_params()
    in_flight: dict = {"rollouts": 0}
    rolling = threading.Event()

    def rollouts_until_the_engine_dies() -> None:
        # Rollouts back to back on the engine's weights mapped in shared memory, so that the signal lands
        # during one however fast the machine is (a single rollout could end before the signal came).
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline:
                engine.generate([GenerationRequest(prompt="3", seed=i, steps=50) for i in range(8)])
                in_flight["rollouts"] += 1
                rolling.set()
        except RuntimeError as exc:
            in_flight["error"] = str(exc)
        finally:
            rolling.set()

    try:
        controller.sync(params)
        assert engine.generate([GenerationRequest(prompt="3", seed=0, steps=2)]).weight_version == 1
        assert segments_of(engine.proc.pid)
        rollout = threading.Thread(target=rollouts_until_the_engine_dies)
        rollout.start()
        assert rolling.wait(timeout=60) and "error" not in in_flight, in_flight  # one done, the next in flight
        engine.proc.send_signal(sig)
        rollout.join(timeout=60)
        assert not rollout.is_alive(), "the rollouts went on after the engine process was signalled"
        # SIGTERM: a clean stop even with a rollout running on the mapped weights (not a crash).
        how = "exited with code 143 \\(stopped by SIGTERM\\)" if sig == signal.SIGTERM else "was killed by SIGKILL"
        assert re.fullmatch(f"engine process \\(pid {engine.proc.pid}, card 'toy-digits'\\) {how} during 'generate'"
                            ".*start a new one.*", in_flight.get("error", "no error")), in_flight
        with pytest.raises(EngineProcessError, match=f"{how} during 'pause'"):
            controller.sync(params)
        # SIGTERM: the engine unlinks its block as it stops; SIGKILL: its resource tracker does.
        assert wait_until(lambda: not segments_of(engine.proc.pid), GONE_WITHIN_S), segments_of(engine.proc.pid)
    finally:
        controller.close()
        engine.close()


def test_sigterm_inside_sigterm_as_exit_unwinds_so_finally_clauses_close_the_engine():
    closed = []
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        with sigterm_as_exit():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises in this thread at the next bytecode
            finally:
                closed.append(True)
    assert stop.value.code == 128 + signal.SIGTERM and closed == [True]
    assert signal.getsignal(signal.SIGTERM) is previous  # restored after the block


@linux_only
def test_an_engine_process_handle_dropped_without_close_stops_its_process():
    """A main() that raised leaves no engine behind in the calling process (a test session, a notebook)."""
    engine = EngineProcess.start("toy-digits", threads=1)
    controller = WeightSyncController(engine, transport=SharedMemoryTransport())
    controller.sync(toy_params())
    pid = engine.proc.pid
    assert segments_of(pid)
    controller.close()
    del engine, controller
    gc.collect()
    assert not running(pid) and not segments_of(pid)  # SIGTERM: the engine unlinked its block as it stopped


# ---- resume ---------------------------------------------------------------------------------

ASYNC_RUN = ["tracker=none", "rollout.asynchronous=true", "data.prompts_per_step=2", "data.group_size=4",
             "eval.seeds=1", "train.timestep_fraction=0.5", "eval.every=1000", "sample_every=1000",
             "save_every=2"]


def comparable(row: dict) -> dict:
    """A metrics row without timings and evaluations (a run evaluates at its own last step)."""
    return {k: v for k, v in row.items() if not (k.startswith(("time/", "eval/")) or k.endswith("_s"))}


def async_run_and_resumed_copy(tmp_path: Path, *overrides: str) -> tuple[list[dict], list[dict], dict]:
    """Rows of a 3-step async run, rows of the same run stopped after its step-2 checkpoint and resumed,
    and that checkpoint's trainer state."""
    from trainers.grpo import main

    main([f"run_dir={tmp_path / 'straight'}", "steps=3", *ASYNC_RUN, *overrides])
    main([f"run_dir={tmp_path / 'resumed'}", "steps=2", *ASYNC_RUN, *overrides])
    main([f"resume={tmp_path / 'resumed'}", "steps=3"])
    checkpoint = tmp_path / "resumed" / "checkpoints" / "step_000002" / "trainer_state.json"
    return (read_metrics(tmp_path / "straight" / "metrics.jsonl"), read_metrics(tmp_path / "resumed" / "metrics.jsonl"),
            json.loads(checkpoint.read_text()))


def test_a_resumed_async_run_differs_from_an_uninterrupted_one_exactly_as_documented(tmp_path):
    """docs/getting-started.md, resuming async rollouts: up to the checkpoint the rows are the uninterrupted
    run's; the first step after resume is rolled out with the checkpoint's weights (staleness 0) where the
    uninterrupted run used the batch it prefetched with the previous weights (staleness 1), so from there the runs differ.
    Weight versions name the same weights in both, and the staleness counts continue."""
    straight, resumed, checkpoint = async_run_and_resumed_copy(tmp_path)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert [comparable(r) for r in resumed[:3]] == [comparable(r) for r in straight[:3]]
    after, uninterrupted = resumed[3], straight[3]
    assert uninterrupted["staleness"] == 1 and uninterrupted["weight_version"] == checkpoint["weight_version"] - 1
    assert after["staleness"] == 0 and after["weight_version"] == checkpoint["weight_version"]
    assert after["logprob_gap/max"] == 0.0 < uninterrupted["logprob_gap/max"]  # rolled out with the trainer's weights
    assert after["reward/mean"] != uninterrupted["reward/mean"]  # other weights, so other samples
    assert (uninterrupted["staleness/count_0"], uninterrupted["staleness/count_1"]) == (1.0, 2.0)
    assert (after["staleness/count_0"], after["staleness/count_1"]) == (2.0, 1.0)  # counted on from the checkpoint


def test_a_resumed_async_run_with_max_staleness_0_is_the_uninterrupted_run(tmp_path):
    """docs/getting-started.md: where every lagging batch is regenerated anyway, losing the prefetch at the stop changes
    nothing but the count of regenerated batches (the resumed run had no stale prefetch to throw away)."""
    straight, resumed, _ = async_run_and_resumed_copy(tmp_path, "rollout.max_staleness=0")

    def same_part(row: dict) -> dict:
        return {k: v for k, v in comparable(row).items() if k != "staleness/regenerated"}

    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert [same_part(r) for r in resumed] == [same_part(r) for r in straight]
    assert [r.get("staleness/regenerated") for r in straight] == [None, 0.0, 1.0, 2.0]
    assert [r.get("staleness/regenerated") for r in resumed] == [None, 0.0, 1.0, 1.0]


def test_a_call_that_timed_out_does_not_hand_its_late_answer_to_the_next_call():
    from dataclasses import asdict

    with EngineProcess.start("toy-digits", threads=1) as engine:
        slow = [GenerationRequest(prompt="a seven", seed=i, steps=50) for i in range(64)]
        with pytest.raises(TimeoutError, match=r"did not answer 'generate' within 0.05s"):
            engine.call("generate", timeout_s=0.05, requests=[asdict(r) for r in slow])
        # The 64-row answer still arrives, on the timed-out call's connection, which was closed.
        traj = engine.generate([GenerationRequest(prompt="a three", seed=1234, steps=2)])
        assert traj.prompts == ["a three"] and traj.seeds == [1234] and traj.latents.shape[0] == 1


def fake_engine(tmp_path: Path, script: str) -> str:
    """An executable standing in for the interpreter that runs the engine process."""
    path = tmp_path / "fake_python"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return str(path)


def test_an_engine_process_that_never_starts_serving_is_stopped_within_start_timeout_s(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", fake_engine(tmp_path, "echo 'loading: 3 of 40 shards'\nexec sleep 60\n"))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"engine process \(pid \d+\) for card 'toy-digits' did not start serving "
                                           r"within 1.5s \(start_timeout_s"):
        EngineProcess.start("toy-digits", start_timeout_s=1.5)
    assert time.monotonic() - start < 15


def test_lines_an_engine_process_prints_before_its_port_are_passed_to_stderr(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(sys, "executable", fake_engine(
        tmp_path, "echo 'FutureWarning: a library speaks on stdout'\necho '{\"port\": 40321}'\nexec sleep 60\n"))
    engine = EngineProcess.start("toy-digits", start_timeout_s=30)
    try:
        assert engine.address == ("127.0.0.1", 40321)
        assert "FutureWarning: a library speaks on stdout" in capfd.readouterr().err
    finally:
        engine.close()
    assert engine.proc.poll() is not None


def test_the_engine_process_of_an_async_run_takes_the_rollout_timeouts(monkeypatch):
    """rollout.call_timeout_s / start_timeout_s reach the engine process (its per-call 120 s default once cut off
    a video model's chunk of rollouts); Ray's pools are given the same two (flywheel/scale/config.py)."""
    from types import SimpleNamespace

    import flywheel.sync.engine_process as engine_process
    from flywheel.recipe.rollouts import EngineProcess as Layout
    from flywheel.runs.config import parse_config
    from trainers.grpo import Config

    started = {}

    def start(card, **kwargs):
        started.update(kwargs, card=card)
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_process.EngineProcess, "start", staticmethod(start))
    cfg = parse_config(Config, ["rollout.asynchronous=true", "rollout.call_timeout_s=900",
                                "rollout.start_timeout_s=45"])
    with pytest.raises(RuntimeError, match="stop here"):
        Layout().build(cfg, SimpleNamespace(num_processes=1, device="cpu"), policy=None, version=0)
    assert (started["card"], started["timeout_s"], started["start_timeout_s"]) == ("toy-digits", 900.0, 45.0)


def test_the_drain_before_a_sync_waits_rollout_call_timeout_s_not_the_controllers_600s(monkeypatch):
    from types import SimpleNamespace

    import flywheel.recipe.rollouts as rollouts
    import flywheel.sync.engine_process as engine_process
    from flywheel.runs.config import parse_config
    from trainers.grpo import Config

    made = {}

    def controller(engine, **kwargs):
        made.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_process.EngineProcess, "start", staticmethod(lambda card, **kwargs: object()))
    monkeypatch.setattr(rollouts, "WeightSyncController", controller)
    cfg = parse_config(Config, ["rollout.asynchronous=true", "rollout.call_timeout_s=7"])
    with pytest.raises(RuntimeError, match="stop here"):
        rollouts.EngineProcess().build(cfg, SimpleNamespace(num_processes=1, device="cpu"), policy=None, version=0)
    assert made["timeout_s"] == 7.0


def test_a_stopped_engine_process_times_out_and_close_still_stops_it():
    """SIGSTOP (or a hang) in the engine process: the call's timeout says so as an error that stops the run in
    one line (a RunStoppedError), and close() does not hang in a new connection's handshake, which has no
    timeout: it stops the process instead of asking it to shut down."""
    from flywheel.guards import RunStoppedError

    engine = EngineProcess.start("toy-digits", threads=1)
    try:
        assert engine.weight_version == 0
        engine.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(EngineProcessTimeout, match=r"did not answer 'version' within 0.5s") as timed_out:
            engine.call("version", timeout_s=0.5)
        assert isinstance(timed_out.value, RunStoppedError) and isinstance(timed_out.value, TimeoutError)
        closing = threading.Thread(target=engine.close, daemon=True)
        closing.start()
        closing.join(timeout=30)
        assert not closing.is_alive(), "close() hung on the stopped engine process"
        assert engine.proc.poll() is not None
    finally:
        if engine.proc.poll() is None:
            engine.proc.kill()
            engine.proc.wait()


@pytest.mark.parametrize("argv, key, said", [
    (["--card", "nope"], "00ff", "--card 'nope' is not a card; valid: flux,"),
    (["--threads", "0", "--lora-rank", "-1"], "00ff", "--threads 0: must be >= 1; --lora-rank -1: must be >= 0"),
    (["--port", "70000"], "00ff", "--port 70000: must be <= 65535"),
    ([], None, "FLYWHEEL_ENGINE_AUTHKEY is not set to a hex key: the trainer that starts this process sets it"),
    ([], "not-hex", "FLYWHEEL_ENGINE_AUTHKEY is not set to a hex key"),
])
def test_the_engine_process_started_by_hand_with_bad_arguments_says_what_is_wrong(argv, key, said, capsys,
                                                                                monkeypatch):
    """Run by hand, a bad flag or a missing key used to be a KeyError traceback after the imports (the card) or
    once serving began (the key)."""
    from flywheel.sync.engine_process import main

    if key is None:
        monkeypatch.delenv("FLYWHEEL_ENGINE_AUTHKEY", raising=False)
    else:
        monkeypatch.setenv("FLYWHEEL_ENGINE_AUTHKEY", key)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: " in last and said in last, last
