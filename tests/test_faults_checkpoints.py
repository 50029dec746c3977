"""Fault injection on checkpoints: a save killed with SIGKILL at each stage, corrupt or edited files,
diverged weights, missing tensors. Each case ends in a clear error or a correct continuation, and
nothing good on disk is lost."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import flywheel.runs.checkpoint as checkpoint_module
from flywheel.runs.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    load_checkpoint,
    load_trainable,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from flywheel.guards import NonFiniteError

# The child saves steps 1 and 2, then a third save that blocks at the named stage (after printing
# BLOCKED) until the parent kills it with SIGKILL. Weights of step k are all k, so what survives
# can be checked by value. 1 MiB of weights: big enough that a write takes real time.
CHILD = r'''
import os, shutil, sys, time
import torch
import flywheel.runs.checkpoint as ck

ckpts, stage = sys.argv[1], sys.argv[2]

def state(step):
    return {"w": torch.full((256, 1024), float(step)), "b": torch.full((8,), float(step))}

def block():
    print("BLOCKED", flush=True)
    time.sleep(300)

for step in (1, 2):
    ck.save_checkpoint(ckpts, step, state(step), trainer_state={"step": step}, keep_last=2)
step = 3
if stage == "model_write":  # model.safetensors half on disk
    real_save = ck.save_file
    def save_file(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        block()
    ck.save_file = save_file
elif stage == "before_manifest":  # every file but the manifest
    ck._write_manifest = lambda *args: block()
elif stage == "between_renames":  # step 2 saved again (after a resume): its old copy moved aside
    step = 2
    real_replace = os.replace
    def replace(src, dst):
        real_replace(src, dst)
        if str(dst).endswith(".old"):
            block()
    os.replace = replace
elif stage == "prune":  # step 3 in place, step 1 being deleted
    real_rmtree = shutil.rmtree
    def rmtree(path, *args, **kwargs):
        if "step_000001" in str(path):
            block()
        real_rmtree(path, *args, **kwargs)
    shutil.rmtree = rmtree
elif stage == "loop":  # keep saving until killed at some point
    for step in range(3, 10**6):
        ck.save_checkpoint(ckpts, step, state(step), trainer_state={"step": step}, keep_last=2)
        print(f"SAVED {step}", flush=True)
ck.save_checkpoint(ckpts, step, state(100 + step), trainer_state={"step": step}, keep_last=2)
print("DONE", flush=True)
'''


def make_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    return run


@pytest.fixture
def start_child(tmp_path):
    """Start the child script for a stage; it is killed at the end of the test whatever happened."""
    procs = []

    def start(run: Path, stage: str) -> subprocess.Popen:
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        proc = subprocess.Popen([sys.executable, str(script), str(run / "checkpoints"), stage],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        # A functional bound, not a timing: a child that never reaches its stage must not hang the suite.
        timer = threading.Timer(120, proc.kill)
        timer.daemon = True
        timer.start()
        procs.append((proc, timer))
        return proc

    yield start
    for proc, timer in procs:
        timer.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def kill_at_stage(start_child, run: Path, stage: str) -> None:
    proc = start_child(run, stage)
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == "BLOCKED":
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lines[-1:] == ["BLOCKED"], f"the child never reached {stage}: {lines} {proc.stderr.read()[-2000:]}"
    assert proc.returncode == -signal.SIGKILL


def value_of(ckpt: Path) -> float:
    state, trainer_state = load_checkpoint(ckpt, restore_rng=False)
    assert trainer_state["step"] == checkpoint_module._step_of(ckpt)
    values = torch.cat([v.flatten() for v in state.values()]).unique()
    assert values.numel() == 1, values
    return float(values)


@pytest.mark.parametrize("stage, expected", [
    ("model_write", "step_000002"),
    ("before_manifest", "step_000002"),
    ("between_renames", ".step_000002.old"),
    ("prune", "step_000003"),
])
def test_save_killed_at_each_stage_keeps_every_good_checkpoint(tmp_path, start_child, stage, expected):
    run = make_run(tmp_path)
    ckpts = run / "checkpoints"
    kill_at_stage(start_child, run, stage)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kill left nothing that looks like a checkpoint and fails
        run_dir, ckpt = resolve_resume(run)
    assert (run_dir, ckpt) == (run, ckpts / expected)
    assert value_of(ckpt) == (103.0 if stage == "prune" else 2.0)
    if stage != "prune":  # step 1 is intact too (prune was deleting it, as asked)
        assert value_of(ckpts / "step_000001") == 1.0

    # The run continues: the next save cleans the leftovers, restores a moved-aside copy, keeps the good ones.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)  # "restored step_000002" after between_renames
        save_checkpoint(ckpts, 4, {"w": torch.full((2,), 4.0)}, trainer_state={}, keep_last=3)
    kept = sorted(p.name for p in ckpts.iterdir())
    assert kept == (["step_000002", "step_000003", "step_000004"] if stage == "prune"
                    else ["step_000001", "step_000002", "step_000004"])
    for name in kept:
        verify_checkpoint(ckpts / name)
    assert resolve_resume(run) == (run, ckpts / "step_000004")


def test_save_loop_killed_at_a_random_point(tmp_path, start_child, seed=0):
    run = make_run(tmp_path)
    ckpts = run / "checkpoints"
    proc = start_child(run, "loop")
    saved = []
    wanted = random.Random(seed).randint(1, 4)  # a few saves in, then at a random byte of the next ones
    for line in proc.stdout:
        if line.startswith("SAVED"):
            saved.append(int(line.split()[1]))
            if len(saved) == wanted:
                break
    threading.Event().wait(random.Random(seed).uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(saved) == wanted, proc.stderr.read()[-2000:]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, ckpt = resolve_resume(run)
    step = checkpoint_module._step_of(ckpt)
    assert step >= saved[-1] and value_of(ckpt) == float(step)
    for d in ckpts.iterdir():  # whatever is visible as a checkpoint is whole
        if not d.name.startswith("."):
            assert value_of(d) == float(checkpoint_module._step_of(d))


# ---------------------------------------------------------------------------
# Corrupt, edited, diverged, incomplete: on the files a real training loop wrote
# ---------------------------------------------------------------------------

X = torch.linspace(-1, 1, 32).reshape(8, 4)
Y = torch.linspace(1, -1, 24).reshape(8, 3)


def new_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = ((model(X) - (Y + 0.01 * torch.randn_like(Y))) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def trained_run(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Checkpoints at steps 2 and 4 of a run; returns the run dir and the weights after step 6."""
    run = make_run(tmp_path)
    torch.manual_seed(1)
    model, opt = new_model()
    for step in (2, 4):
        train(model, opt, 2)
        save_checkpoint(run / "checkpoints", step, model.state_dict(), opt, list(model.named_parameters()),
                        {"weight_version": step})
    train(model, opt, 2)
    return run, {k: v.clone() for k, v in model.state_dict().items()}


def resume_and_train(run: Path, to_step: int) -> tuple[Path, dict[str, torch.Tensor]]:
    _, ckpt = resolve_resume(run)
    model, opt = new_model()
    named = list(model.named_parameters())
    state, trainer_state = load_checkpoint(ckpt, opt, named)
    load_trainable(named, state, ckpt)
    train(model, opt, to_step - trainer_state["step"])
    return ckpt, model.state_dict()


def file_hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_file", "garbage_manifest"])
def test_corrupt_newest_falls_back_with_a_warning_and_continues_correctly(tmp_path, damage):
    run, after_6 = trained_run(tmp_path)
    newest = run / "checkpoints" / "step_000004"
    model_file = newest / "model.safetensors"
    if damage == "truncate":
        model_file.write_bytes(model_file.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(model_file.read_bytes())
        data[len(data) // 2] ^= 0x01
        model_file.write_bytes(bytes(data))
    elif damage == "delete_file":
        (newest / "optimizer.safetensors").unlink()
    else:
        (newest / "manifest.json").write_bytes(b"\x00\xff garbage")
    with pytest.warns(CheckpointWarning, match=r"step_000004.*resuming from .*step_000002") as record:
        ckpt, weights = resume_and_train(run, 6)
    assert str(newest) in str(record[0].message)
    assert ckpt.name == "step_000002"
    # From step 2 with the restored optimizer and RNG, steps 3-6 are the same as the original run's.
    for k, v in weights.items():
        assert torch.equal(v, after_6[k]), k
    # Named checkpoint, no fallback: a clear error naming the file.
    with pytest.raises(CheckpointError, match=str(newest)):
        resolve_resume(newest)


def test_diverged_weights_are_never_saved_and_the_good_checkpoints_stay(tmp_path):
    run, _ = trained_run(tmp_path)
    before = file_hashes(run)
    model, opt = new_model()
    with torch.no_grad():
        model[0].weight.mul_(float("inf"))  # what a blown-up update leaves (inf * 0 = nan too)
    with pytest.raises(NonFiniteError, match=r"step 6: model_state '0\.weight' holds NaN or inf"):
        save_checkpoint(run / "checkpoints", 6, model.state_dict(), opt, list(model.named_parameters()),
                        {}, keep_last=1)
    assert file_hashes(run) == before  # keep_last=1 would have pruned both good ones
    assert resolve_resume(run)[1].name == "step_000004"


def test_edited_step_is_refused(tmp_path):
    run, _ = trained_run(tmp_path)
    newest = run / "checkpoints" / "step_000004"
    state_file = newest / "trainer_state.json"
    edited = json.loads(state_file.read_text()) | {"step": 40}
    state_file.write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        load_checkpoint(newest, restore_rng=False)
    # Also when the tamperer fixed up the checksums: the manifest's step disagrees.
    manifest = json.loads((newest / "manifest.json").read_text())
    checkpoint_module._write_manifest(newest, 4, manifest["model_tensors"])
    with pytest.raises(CheckpointError, match=r"says step 40 but manifest\.json says 4"):
        load_checkpoint(newest, restore_rng=False)
    with pytest.warns(CheckpointWarning, match="says step 40"):
        assert resolve_resume(run)[1].name == "step_000002"


def test_missing_tensor_is_refused_naming_it(tmp_path):
    run, _ = trained_run(tmp_path)
    newest = run / "checkpoints" / "step_000004"
    state, _ = load_checkpoint(newest, restore_rng=False)
    del state["2.bias"]
    checkpoint_module.save_file(state, str(newest / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors has \d+ bytes, the manifest says"):
        load_checkpoint(newest, restore_rng=False)
    # A checkpoint that was written without the tensor (consistent manifest): the strict load names it.
    checkpoint_module._write_manifest(newest, 4, sorted(state))
    state, _ = load_checkpoint(newest, restore_rng=False)
    model, _ = new_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: '2\.bias'"):
        load_trainable(list(model.named_parameters()), state, newest)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing half-loaded
