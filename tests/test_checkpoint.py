"""flywheel.runs.checkpoint: bitwise resume, RNG restore, atomicity, pruning, no pickle, manifest checks,
non-finite refusal, strict names, resume resolution. (Kills and corruption end to end: test_faults_checkpoints.py.)"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import flywheel.runs.checkpoint as checkpoint_module
from flywheel.runs.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_trainable,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from flywheel.guards import NonFiniteError

X = torch.linspace(-1, 1, 32).reshape(8, 4)
Y = torch.linspace(1, -1, 24).reshape(8, 3)


def make_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    # Noise drawn from the global RNG, so the run depends on the restored RNG state.
    noise = 0.01 * torch.randn_like(Y)
    loss = ((model(X) - (Y + noise)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_resume_is_bitwise_identical(tmp_path):
    torch.manual_seed(123)
    model, opt = make_model(0)
    for _ in range(5):
        train_step(model, opt)
    ckpt = save_checkpoint(tmp_path, 5, model.state_dict(), opt, list(model.named_parameters()),
                           {"weight_version": 5})
    for _ in range(3):
        train_step(model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(999)  # a different RNG state, restored from the checkpoint
    fresh, fresh_opt = make_model(1)  # different init, overwritten by the checkpoint
    model_state, trainer_state = load_checkpoint(ckpt, fresh_opt, list(fresh.named_parameters()))
    fresh.load_state_dict(model_state)
    assert trainer_state == {"weight_version": 5, "step": 5}
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.9)
    for _ in range(3):
        train_step(fresh, fresh_opt)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_optimizer_hyperparameters_restored(tmp_path):
    model, opt = make_model(0)
    train_step(model, opt)
    opt.param_groups[0]["lr"] = 0.123  # e.g. set by a schedule
    ckpt = save_checkpoint(tmp_path, 1, model.state_dict(), opt, list(model.named_parameters()), {})
    fresh, fresh_opt = make_model(0)
    load_checkpoint(ckpt, fresh_opt, list(fresh.named_parameters()), restore_rng=False)
    assert fresh_opt.param_groups[0]["lr"] == 0.123
    state = fresh_opt.state[fresh[0].weight]
    assert torch.equal(state["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    assert state["step"].dim() == 0 and state["step"].item() == 1.0


def test_optimizer_restore_by_name_not_position(tmp_path):
    model, opt = make_model(0)
    train_step(model, opt)
    named = list(model.named_parameters())
    ckpt = save_checkpoint(tmp_path, 1, model.state_dict(), opt, named, {})
    # the fresh optimizer registers the parameters in reverse order
    fresh, _ = make_model(0)
    fresh_named = list(fresh.named_parameters())[::-1]
    fresh_opt = torch.optim.AdamW([p for _, p in fresh_named], lr=1e-2)
    load_checkpoint(ckpt, fresh_opt, fresh_named, restore_rng=False)
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"]), name


def test_optimizer_name_mismatch_is_a_clear_error(tmp_path):
    model, opt = make_model(0)
    train_step(model, opt)
    ckpt = save_checkpoint(tmp_path, 1, model.state_dict(), opt, list(model.named_parameters()), {})
    other = nn.Linear(4, 3)
    other_opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(ValueError) as info:
        load_checkpoint(ckpt, other_opt, list(other.named_parameters()), restore_rng=False)
    msg = str(info.value)
    assert "'weight'" in msg and "'bias'" in msg  # missing from the checkpoint
    assert "'0.weight'" in msg and "'2.bias'" in msg  # in the checkpoint, not the optimizer


def test_unnamed_optimizer_parameter_is_an_error(tmp_path):
    model, opt = make_model(0)
    with pytest.raises(ValueError, match="named_params"):
        save_checkpoint(tmp_path, 1, model.state_dict(), opt, list(model.named_parameters())[:2], {})
    assert list_checkpoints(tmp_path) == [] and not any(tmp_path.iterdir())


def test_rng_restored(tmp_path):
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    torch.rand(3)  # advance a bit
    ckpt = save_checkpoint(tmp_path, 0, {}, trainer_state={})
    after_save = (torch.rand(4), random.random(), np.random.rand(2))
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    load_checkpoint(ckpt)
    assert torch.equal(torch.rand(4), after_save[0])
    assert random.random() == after_save[1]
    assert np.array_equal(np.random.rand(2), after_save[2])


def test_restore_rng_false_leaves_rng_alone(tmp_path):
    ckpt = save_checkpoint(tmp_path, 0, {}, trainer_state={})
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    load_checkpoint(ckpt, restore_rng=False)
    assert torch.equal(torch.rand(2), expected)


def test_files_are_safetensors_and_json_only(tmp_path):
    model, opt = make_model(0)
    train_step(model, opt)
    ckpt = save_checkpoint(tmp_path, 3, model.state_dict(), opt, list(model.named_parameters()), {"a": [1]})
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["manifest.json", "model.safetensors", "optimizer.json", "optimizer.safetensors",
                     "rng.json", "rng.safetensors", "trainer_state.json"]
    for p in ckpt.iterdir():
        head = p.read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK", f"{p.name} looks like a pickle / torch zip"
        if p.suffix == ".json":
            json.loads(p.read_text())
    assert json.loads((ckpt / "trainer_state.json").read_text()) == {"a": [1], "step": 3}
    opt_meta = json.loads((ckpt / "optimizer.json").read_text())
    assert opt_meta["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    source = Path(checkpoint_module.__file__).read_text()
    assert "pickle" not in source.replace("No pickle", "") and "torch.save" not in source


def test_model_state_copied_to_contiguous_cpu(tmp_path):
    weight = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
    tied = {"a": weight, "b": weight}  # shared storage (tied weights)
    ckpt = save_checkpoint(tmp_path, 1, tied, trainer_state={})
    state, _ = load_checkpoint(ckpt, restore_rng=False)
    assert torch.equal(state["a"], weight) and torch.equal(state["b"], weight)


def test_latest_checkpoint_ignores_temp_dirs(tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    assert latest_checkpoint(run) is None
    save_checkpoint(ckpts, 3, {"w": torch.ones(2)}, trainer_state={})
    save_checkpoint(ckpts, 4, {"w": torch.ones(2)}, trainer_state={})
    # a save of step 5 that was killed before its rename
    (ckpts / ".step_000005.tmp").mkdir()
    (ckpts / ".step_000005.tmp" / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(run) == ckpts / "step_000004"
    assert latest_checkpoint(ckpts) == ckpts / "step_000004"
    assert latest_checkpoint(ckpts / "step_000003") == ckpts / "step_000003"
    # the next save cleans the leftover
    save_checkpoint(ckpts, 6, {"w": torch.ones(2)}, trainer_state={})
    assert not (ckpts / ".step_000005.tmp").exists()
    assert latest_checkpoint(run) == ckpts / "step_000006"


def test_same_step_is_replaced(tmp_path):
    save_checkpoint(tmp_path, 2, {"w": torch.zeros(2)}, trainer_state={"v": 1})
    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, trainer_state={"v": 2})
    state, trainer_state = load_checkpoint(tmp_path / "step_000002", restore_rng=False)
    assert torch.equal(state["w"], torch.ones(2)) and trainer_state["v"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]


def test_keep_last_pruning(tmp_path):
    for step in range(1, 7):
        save_checkpoint(tmp_path, step, {"w": torch.full((1,), float(step))}, trainer_state={}, keep_last=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000005", "step_000006"]
    # the new checkpoint is never pruned, even when it is not the highest step
    save_checkpoint(tmp_path, 2, {"w": torch.zeros(1)}, trainer_state={}, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]
    for step in (3, 4):
        save_checkpoint(tmp_path, step, {}, trainer_state={}, keep_last=None)
    assert len(list_checkpoints(tmp_path)) == 3


def test_missing_file_errors_name_file_and_dir(tmp_path):
    model, _ = make_model(0)
    ckpt = save_checkpoint(tmp_path, 1, model.state_dict(), trainer_state={})
    _, opt = make_model(0)
    with pytest.raises(FileNotFoundError) as info:
        load_checkpoint(ckpt, opt, restore_rng=False)
    assert "optimizer.json" in str(info.value) and str(ckpt) in str(info.value)
    (ckpt / "rng.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rng.safetensors is missing"):
        load_checkpoint(ckpt)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint(tmp_path / "step_000099")


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path, 1, {}, trainer_state={"x": object()})
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 1, {}, trainer_state={}, keep_last=0)
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, 1, {}, trainer_state={"step": 2})
    with pytest.raises(TypeError, match="'x'"):
        save_checkpoint(tmp_path, 1, {"x": 3}, trainer_state={})
    assert list_checkpoints(tmp_path) == []


def test_optimizer_built_from_named_parameters(tmp_path):
    # torch records param_names itself when given named_parameters(); no named_params needed
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    train_step(model, opt)
    ckpt = save_checkpoint(tmp_path, 1, model.state_dict(), opt, trainer_state={})
    assert json.loads((ckpt / "optimizer.json").read_text())["param_groups"][0]["params"] == ["weight", "bias"]
    fresh = nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.named_parameters(), lr=1e-2)
    state, _ = load_checkpoint(ckpt, fresh_opt, restore_rng=False)
    fresh.load_state_dict(state)
    assert fresh_opt.param_groups[0]["param_names"] == ["weight", "bias"]
    torch.manual_seed(1)
    train_step(model, opt)
    torch.manual_seed(1)
    train_step(fresh, fresh_opt)
    assert torch.equal(model.weight, fresh.weight) and torch.equal(model.bias, fresh.bias)


# ---------------------------------------------------------------------------
# Trust: non-finite state, manifest, strict names, resume resolution
# ---------------------------------------------------------------------------


def file_hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def rewrite_manifest(ckpt: Path) -> None:
    """Make the manifest agree with the files again: the tamperer who also fixes the checksums."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    checkpoint_module._write_manifest(ckpt, manifest["step"], manifest["model_tensors"])


def make_run(tmp_path: Path, steps=(1, 2, 3)) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    for step in steps:
        save_checkpoint(run / "checkpoints", step, {"w": torch.full((3,), float(step))}, trainer_state={},
                        keep_last=None)
    return run


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_save_refuses_non_finite_weights_and_keeps_the_good_checkpoints(tmp_path, bad):
    model, opt = make_model(0)
    named = list(model.named_parameters())
    for step in (1, 2):
        train_step(model, opt)
        save_checkpoint(tmp_path, step, model.state_dict(), opt, named, {}, keep_last=2)
    before = file_hashes(tmp_path)
    with torch.no_grad():
        model[2].bias[1] = bad
    with pytest.raises(NonFiniteError) as info:
        save_checkpoint(tmp_path, 3, model.state_dict(), opt, named, {}, keep_last=2)
    assert "step 3" in str(info.value) and "'2.bias'" in str(info.value)
    # Nothing written, nothing pruned: the two good checkpoints are byte for byte what they were.
    assert file_hashes(tmp_path) == before
    assert [p.name for p in tmp_path.iterdir()] and not list(tmp_path.glob(".*"))


def test_save_refuses_non_finite_optimizer_state(tmp_path):
    model, opt = make_model(0)
    train_step(model, opt)
    save_checkpoint(tmp_path, 1, model.state_dict(), opt, list(model.named_parameters()), {})
    opt.state[model[0].weight]["exp_avg_sq"][0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 2.*optimizer state '0.weight.exp_avg_sq'"):
        save_checkpoint(tmp_path, 2, model.state_dict(), opt, list(model.named_parameters()), {}, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001"]
    with pytest.raises(ValueError, match="finite"):  # nor NaN in the trainer's JSON
        save_checkpoint(tmp_path, 2, {}, trainer_state={"best": float("nan")})


def test_manifest_records_step_sizes_checksums_and_tensor_names(tmp_path):
    model, opt = make_model(0)
    train_step(model, opt)
    ckpt = save_checkpoint(tmp_path, 3, model.state_dict(), opt, list(model.named_parameters()), {})
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["format"] == "flywheel-checkpoint/1"
    assert manifest["model_tensors"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert sorted(manifest["files"]) == sorted(p.name for p in ckpt.iterdir() if p.name != "manifest.json")
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert verify_checkpoint(ckpt) == manifest


def flip_byte(path: Path, offset: int = -9) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_load_verifies_the_manifest(tmp_path):
    def fresh(step=1):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        return save_checkpoint(d, step, {"w": torch.ones(4), "b": torch.zeros(2)}, trainer_state={"v": 1})

    ckpt = fresh()
    flip_byte(ckpt / "model.safetensors")  # same size, different bytes
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match its sha256"):
        load_checkpoint(ckpt, restore_rng=False)

    ckpt = fresh()
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{len(data) // 2} bytes, the manifest says {len(data)}"):
        load_checkpoint(ckpt, restore_rng=False)

    ckpt = fresh()
    (ckpt / "manifest.json").unlink()  # e.g. a checkpoint of an older flywheel
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing.*not loaded unverified"):
        load_checkpoint(ckpt, restore_rng=False)

    ckpt = fresh()
    (ckpt / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json is not valid JSON"):
        load_checkpoint(ckpt, restore_rng=False)

    # A step edited in trainer_state.json: refused even when the checksums were fixed up too.
    ckpt = fresh(5)
    state_file = ckpt / "trainer_state.json"
    state_file.write_text(state_file.read_text().replace('"step": 5', '"step": 9'))
    with pytest.raises(CheckpointError, match="trainer_state.json does not match its sha256"):
        load_checkpoint(ckpt, restore_rng=False)
    rewrite_manifest(ckpt)
    with pytest.raises(CheckpointError, match=r"trainer_state\.json says step 9 but manifest\.json says 5"):
        load_checkpoint(ckpt, restore_rng=False)

    # A checkpoint dir renamed to another step.
    ckpt = fresh(5)
    moved = ckpt.rename(ckpt.parent / "step_000007")
    with pytest.raises(CheckpointError, match=r"says step 5 but the directory is step_000007"):
        load_checkpoint(moved, restore_rng=False)


def test_load_wraps_unreadable_safetensors_with_the_path(tmp_path):
    ckpt = save_checkpoint(tmp_path, 1, {"w": torch.ones(4)}, trainer_state={})
    (ckpt / "rng.safetensors").write_bytes(b"\x00" * 64)  # garbage with a consistent manifest
    rewrite_manifest(ckpt)
    with pytest.raises(CheckpointError, match=r"rng\.safetensors is not a readable safetensors file"):
        load_checkpoint(ckpt)


def test_load_refuses_non_finite_weights(tmp_path):
    ckpt = save_checkpoint(tmp_path, 1, {"w": torch.ones(4), "b": torch.zeros(2)}, trainer_state={})
    checkpoint_module.save_file({"w": torch.tensor([1.0, float("nan"), 1.0, 1.0]), "b": torch.zeros(2)},
                                str(ckpt / "model.safetensors"))
    rewrite_manifest(ckpt)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'w' holds NaN or inf"):
        load_checkpoint(ckpt, restore_rng=False)


def test_manifest_tensor_names_must_match_the_file(tmp_path):
    ckpt = save_checkpoint(tmp_path, 1, {"w": torch.ones(4), "b": torch.zeros(2)}, trainer_state={})
    checkpoint_module.save_file({"w": torch.ones(4)}, str(ckpt / "model.safetensors"))  # 'b' dropped
    manifest = json.loads((ckpt / "manifest.json").read_text())
    checkpoint_module._write_manifest(ckpt, 1, manifest["model_tensors"])  # checksums fixed, names kept
    with pytest.raises(CheckpointError, match=r"does not hold the tensors its manifest lists: missing 'b'"):
        load_checkpoint(ckpt, restore_rng=False)


def test_load_trainable_is_strict_by_name_and_shape():
    model, _ = make_model(0)
    source, _ = make_model(1)
    named = list(model.named_parameters())
    state = {k: v.clone() for k, v in source.state_dict().items()}
    load_trainable(named, state, "ckpt")
    assert all(torch.equal(p, state[n]) for n, p in named)

    missing = {k: v for k, v in state.items() if k != "2.bias"}
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: '2\.bias'; .*not trainable here: none"):
        load_trainable(named, missing, "ckpt")
    extra = {**state, "lora_A.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: none; .*'lora_A\.weight'"):
        load_trainable(named, extra, "ckpt")
    wrong = {**state, "0.bias": torch.zeros(7)}
    with pytest.raises(CheckpointError, match=r"'0\.bias' \(7,\) vs \(5,\)"):
        load_trainable(named, wrong, "ckpt")
    # Only the trainable subset (LoRA saves only its adapter): exactly those names load.
    model[0].requires_grad_(False)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    load_trainable(trainable, {n: state[n] for n, _ in trainable})
    with pytest.raises(CheckpointError, match=r"not trainable here: '0\.bias', '0\.weight'"):
        load_trainable(trainable, state)


def test_resolve_resume_picks_the_newest_checkpoint_that_verifies(tmp_path):
    run = make_run(tmp_path)
    ckpts = run / "checkpoints"
    for given in (run, ckpts):
        assert resolve_resume(given) == (run, ckpts / "step_000003")
    assert resolve_resume(ckpts / "step_000002") == (run, ckpts / "step_000002")

    flip_byte(ckpts / "step_000003" / "model.safetensors")
    (ckpts / "step_000002" / "manifest.json").unlink()
    with pytest.warns(CheckpointWarning) as record:
        assert resolve_resume(run) == (run, ckpts / "step_000001")
    message = str(record[0].message)
    assert "step_000003" in message and "sha256" in message
    assert "step_000002" in message and "manifest.json is missing" in message
    assert str(ckpts / "step_000001") in message
    # Asked for one checkpoint by name: no silent substitute.
    with pytest.raises(CheckpointError, match=r"step_000003.*sha256.*give the run directory"):
        resolve_resume(ckpts / "step_000003")

    (ckpts / "step_000001" / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError) as info:
        resolve_resume(run)
    lines = str(info.value).splitlines()
    assert "no checkpoint" in lines[0] and "verifies" in lines[0]
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        str(ckpts / f"step_00000{s}") for s in (3, 2, 1)]


def test_resolve_resume_refuses_a_run_without_its_config(tmp_path):
    run = make_run(tmp_path, steps=(1,))
    (run / "config.yaml").unlink()
    for given in (run, run / "checkpoints" / "step_000001"):
        with pytest.raises(FileNotFoundError, match=rf"{run / 'config.yaml'} is missing"):
            resolve_resume(given)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        resolve_resume(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        resolve_resume(empty)


def test_pruning_never_drops_a_good_checkpoint_for_a_bad_one(tmp_path):
    run = make_run(tmp_path, steps=(1, 2, 3))
    ckpts = run / "checkpoints"
    (ckpts / "step_000003" / "model.safetensors").write_bytes(b"torn")
    with pytest.warns(CheckpointWarning, match=r"step_000003.*4 bytes"):
        save_checkpoint(ckpts, 4, {"w": torch.full((3,), 4.0)}, trainer_state={}, keep_last=2)
    # keep_last=2 keeps the two newest checkpoints that verify (4 and 2); the bad one is neither
    # counted nor deleted, and the older good one goes.
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000003", "step_000004"]
    assert resolve_resume(run) == (run, ckpts / "step_000004")


def test_a_same_step_save_killed_between_its_renames_loses_nothing(tmp_path):
    run = make_run(tmp_path, steps=(1, 2))
    ckpts = run / "checkpoints"
    # What a save of step 2 killed between its two os.replace calls leaves behind.
    (ckpts / "step_000002").rename(ckpts / ".step_000002.old")
    (ckpts / ".step_000002.tmp").mkdir()
    assert resolve_resume(run) == (run, ckpts / ".step_000002.old")
    state, trainer_state = load_checkpoint(ckpts / ".step_000002.old", restore_rng=False)
    assert trainer_state["step"] == 2 and torch.equal(state["w"], torch.full((3,), 2.0))
    # The next save puts it back instead of cleaning it away as a leftover.
    with pytest.warns(CheckpointWarning, match="restored"):
        save_checkpoint(ckpts, 3, {"w": torch.full((3,), 3.0)}, trainer_state={}, keep_last=3)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000002", "step_000003"]
    state, _ = load_checkpoint(ckpts / "step_000002", restore_rng=False)
    assert torch.equal(state["w"], torch.full((3,), 2.0))
