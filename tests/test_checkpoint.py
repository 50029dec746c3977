"""flywheel.checkpoint: bitwise resume, RNG restore, atomicity, pruning, no pickle."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import flywheel.checkpoint as checkpoint_module
from flywheel.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint

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
    assert names == ["model.safetensors", "optimizer.json", "optimizer.safetensors",
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
    with pytest.raises(FileNotFoundError, match="rng.safetensors"):
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
