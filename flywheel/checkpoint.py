"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

A checkpoint is a directory `<checkpoints_dir>/step_000123/` holding

    model.safetensors      the model state dict (CPU, contiguous copies)
    optimizer.safetensors  every tensor of optimizer.state, keyed "{param_name}.{state_key}"
    optimizer.json         param_groups (params given by name) and non-tensor state values
    rng.safetensors        torch CPU RNG state (and the current CUDA device's, if any)
    rng.json               Python `random` and numpy global RNG states
    trainer_state.json     the trainer's dict, plus "step"

No pickle anywhere: a checkpoint can be loaded without executing code from it.
Optimizer state is keyed by parameter *name*, not position, so it restores
into a fresh optimizer whatever order the parameters were registered in, and
a mismatch is reported by name.

Atomicity: everything is written into `.step_000123.tmp/`, fsynced, then
renamed to `step_000123/` with os.replace. A killed save leaves only a hidden
temp dir, which `latest_checkpoint` ignores and the next save removes. One
process (rank 0) writes a checkpoints dir; concurrent writers are not supported.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from flywheel.rundir import fsync_dir

MODEL_FILE = "model.safetensors"
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
OPTIMIZER_FILE = "optimizer.json"
RNG_TENSORS_FILE = "rng.safetensors"
RNG_FILE = "rng.json"
TRAINER_STATE_FILE = "trainer_state.json"

_STEP_DIR = re.compile(r"step_(\d+)")
_TENSOR_MARK = "__tensor__"  # marks a JSON value that lives in a .safetensors file


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def _step_of(path: Path) -> int | None:
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------
# Small file helpers (each file is fsynced before the directory rename)
# ---------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    save_file(tensors, str(path), metadata=metadata)
    _fsync_file(path)


def _require(ckpt_dir: Path, filename: str, hint: str = "") -> Path:
    path = ckpt_dir / filename
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {ckpt_dir} has no {filename}{hint}")
    return path


def _read_json(ckpt_dir: Path, filename: str, hint: str = "") -> Any:
    return json.loads(_require(ckpt_dir, filename, hint).read_text(encoding="utf-8"))


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    # A real copy: safetensors refuses tensors that share storage (tied weights),
    # and the caller may keep training while we write.
    return t.detach().to("cpu", copy=True).contiguous()


def _json_checked(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serializable (dict/list/str/int/float/bool/None): {e}") from e
    return value


# ---------------------------------------------------------------------------
# Optimizer state by parameter name
# ---------------------------------------------------------------------------


def _group_param_names(optimizer: torch.optim.Optimizer,
                       named_params: Iterable[tuple[str, nn.Parameter]] | None) -> list[list[str]]:
    """The name of every parameter of every param group, in the optimizer's order."""
    if named_params is not None:
        by_id: dict[int, str] = {}
        seen: set[str] = set()
        for name, p in named_params:
            if name in seen:
                raise ValueError(f"named_params has the name {name!r} twice")
            seen.add(name)
            by_id[id(p)] = name
        groups = []
        for gi, group in enumerate(optimizer.param_groups):
            names = []
            for pi, p in enumerate(group["params"]):
                if id(p) not in by_id:
                    raise ValueError(
                        f"optimizer param_groups[{gi}] parameter {pi} (shape {tuple(p.shape)}) is not in "
                        "named_params; pass model.named_parameters() covering every optimized parameter"
                    )
                names.append(by_id[id(p)])
            groups.append(names)
        return groups
    if all("param_names" in g for g in optimizer.param_groups):
        # torch >= 2.6 records names when the optimizer is built from named_parameters()
        return [list(g["param_names"]) for g in optimizer.param_groups]
    # Positional names: only restore into an optimizer over the same parameters in
    # the same order. Pass named_params to get checks by name.
    groups, i = [], 0
    for group in optimizer.param_groups:
        groups.append([f"param_{j}" for j in range(i, i + len(group["params"]))])
        i += len(group["params"])
    return groups


def _optimizer_files(optimizer: torch.optim.Optimizer,
                     named_params: Iterable[tuple[str, nn.Parameter]] | None) -> tuple[dict, dict]:
    """(tensors for optimizer.safetensors, JSON object for optimizer.json)."""
    names = _group_param_names(optimizer, named_params)
    sd = optimizer.state_dict()
    index_to_name = {}
    for packed, group_names in zip(sd["param_groups"], names):
        index_to_name.update(zip(packed["params"], group_names))

    tensors: dict[str, torch.Tensor] = {}

    def put(key: str, t: torch.Tensor) -> dict:
        if key in tensors:
            raise ValueError(f"optimizer tensor key {key!r} is produced twice; rename the parameter")
        tensors[key] = _cpu_copy(t)
        return {_TENSOR_MARK: key}

    state = {}
    for index, entries in sd["state"].items():
        name = index_to_name[index]
        tensor_keys, values = [], {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                put(f"{name}.{key}", value)
                tensor_keys.append(key)
            else:
                values[key] = _json_checked(value, f"optimizer state {name!r}[{key!r}]")
        state[name] = {"tensors": tensor_keys, "values": values}

    param_groups = []
    for gi, (packed, group_names) in enumerate(zip(sd["param_groups"], names)):
        group: dict[str, Any] = {}
        for key, value in packed.items():
            if key == "params":
                group[key] = group_names
            elif isinstance(value, torch.Tensor):  # e.g. a tensor lr
                group[key] = put(f"param_groups.{gi}.{key}", value)
            else:
                group[key] = _json_checked(value, f"optimizer param_groups[{gi}][{key!r}]")
        param_groups.append(group)
    return tensors, {"param_groups": param_groups, "state": state}


def _from_json(value: Any, tensors: dict[str, torch.Tensor], like: Any) -> Any:
    if isinstance(value, dict) and set(value) == {_TENSOR_MARK}:
        return tensors[value[_TENSOR_MARK]]
    if isinstance(value, list) and isinstance(like, tuple):  # JSON has no tuples (betas)
        return tuple(value)
    return value


def _restore_optimizer(ckpt_dir: Path, optimizer: torch.optim.Optimizer,
                       named_params: Iterable[tuple[str, nn.Parameter]] | None) -> None:
    hint = " (was it saved without an optimizer?)"
    meta = _read_json(ckpt_dir, OPTIMIZER_FILE, hint)
    tensors = load_file(str(_require(ckpt_dir, OPTIMIZER_TENSORS_FILE, hint)))
    current = _group_param_names(optimizer, named_params)
    saved = [g["params"] for g in meta["param_groups"]]

    cur_names = {n for g in current for n in g}
    saved_names = {n for g in saved for n in g}
    if cur_names != saved_names:
        missing = sorted(cur_names - saved_names)
        unexpected = sorted(saved_names - cur_names)
        raise ValueError(
            f"optimizer parameters do not match checkpoint {ckpt_dir}: "
            f"missing from the checkpoint: {missing or 'none'}; "
            f"in the checkpoint but not in the optimizer: {unexpected or 'none'}"
        )
    if len(current) != len(saved) or any(set(c) != set(s) for c, s in zip(current, saved)):
        raise ValueError(
            f"optimizer param groups do not match checkpoint {ckpt_dir}: "
            f"the optimizer has groups {current}, the checkpoint {saved}"
        )

    # Rebuild a torch state dict whose indices follow the *current* optimizer's
    # order: load_state_dict pairs saved and current params by position.
    index = {name: i for i, name in enumerate(n for g in current for n in g)}
    param_groups = []
    for gi, (group_meta, names) in enumerate(zip(meta["param_groups"], current)):
        like = optimizer.param_groups[gi]
        # "param_names" (torch's own, in saved order) is dropped: the optimizer keeps its own.
        group = {k: _from_json(v, tensors, like.get(k)) for k, v in group_meta.items()
                 if k not in ("params", "param_names")}
        group["params"] = [index[n] for n in names]
        param_groups.append(group)
    state = {}
    for name, entry in meta["state"].items():
        s = {key: tensors[f"{name}.{key}"] for key in entry["tensors"]}
        s.update(entry["values"])
        state[index[name]] = s
    # load_state_dict casts state to each parameter's device and dtype (keeping `step` as saved).
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


# ---------------------------------------------------------------------------
# RNG states
# ---------------------------------------------------------------------------


def _rng_files() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    cuda_device = None
    if torch.cuda.is_available():
        # Only the current device: under accelerate each rank owns one GPU, and
        # get_rng_state_all() would create a context on every GPU of the node.
        cuda_device = torch.cuda.current_device()
        tensors["torch_cuda"] = torch.cuda.get_rng_state(cuda_device)
    version, mt_state, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    meta = {
        "python": {"version": version, "state": list(mt_state), "gauss_next": gauss_next},
        "numpy": {"bit_generator": name, "keys": keys.tolist(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "cuda_device": cuda_device,
    }
    return tensors, meta


def _restore_rng(ckpt_dir: Path) -> None:
    tensors = load_file(str(_require(ckpt_dir, RNG_TENSORS_FILE)))
    meta = _read_json(ckpt_dir, RNG_FILE)
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["torch_cuda"], torch.cuda.current_device())
        else:
            warnings.warn(f"checkpoint {ckpt_dir} has a CUDA RNG state but CUDA is not available; not restored")
    py = meta["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = meta["numpy"]
    np.random.set_state((npy["bit_generator"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def list_checkpoints(path: str | os.PathLike) -> list[Path]:
    """Complete checkpoint dirs under a run dir or checkpoints dir, by increasing step."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not path.is_dir():
        return []
    found = [d for d in path.iterdir()
             if _step_of(d) is not None and d.is_dir() and (d / TRAINER_STATE_FILE).is_file()]
    return sorted(found, key=_step_of)


def latest_checkpoint(path: str | os.PathLike) -> Path | None:
    """The highest-step checkpoint: `path` is a run dir, a checkpoints dir or a checkpoint dir.

    Temp dirs of interrupted saves (`.step_*.tmp`) are ignored. None if there is none.
    """
    path = Path(path)
    if _step_of(path) is not None and (path / TRAINER_STATE_FILE).is_file():
        return path
    found = list_checkpoints(path)
    return found[-1] if found else None


def save_checkpoint(checkpoints_dir: str | os.PathLike, step: int, model_state: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer | None = None,
                    named_params: Iterable[tuple[str, nn.Parameter]] | None = None,
                    trainer_state: dict | None = None, keep_last: int | None = 3) -> Path:
    """Write `checkpoints_dir/step_{step:06d}/` atomically and prune old checkpoints.

    `named_params` (e.g. `list(model.named_parameters())`) names the optimizer's
    parameters; without it, names come from the optimizer's `param_names` (torch
    >= 2.6, when built from named parameters) or from positions. `trainer_state`
    must be JSON-serializable; "step" is added. A checkpoint of the same step is
    replaced. Afterwards only the `keep_last` highest-step checkpoints are kept
    (the new one always; None keeps all). Returns the checkpoint dir.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
    trainer_state = dict(trainer_state or {})
    if trainer_state.get("step", step) != step:
        raise ValueError(f"trainer_state['step'] is {trainer_state['step']!r} but the checkpoint step is {step}")
    trainer_state["step"] = step
    _json_checked(trainer_state, "trainer_state")
    for key, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"model_state[{key!r}] is a {type(value).__name__}; only tensors can be saved")

    checkpoints_dir = Path(checkpoints_dir)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    final = checkpoints_dir / name
    tmp = checkpoints_dir / f".{name}.tmp"
    old = checkpoints_dir / f".{name}.old"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_tensors(tmp / MODEL_FILE, {k: _cpu_copy(v) for k, v in model_state.items()},
                       metadata={"step": str(step)})
        if optimizer is not None:
            opt_tensors, opt_meta = _optimizer_files(optimizer, named_params)
            _write_tensors(tmp / OPTIMIZER_TENSORS_FILE, opt_tensors)
            _write_json(tmp / OPTIMIZER_FILE, opt_meta)
        rng_tensors, rng_meta = _rng_files()
        _write_tensors(tmp / RNG_TENSORS_FILE, rng_tensors)
        _write_json(tmp / RNG_FILE, rng_meta)
        _write_json(tmp / TRAINER_STATE_FILE, trainer_state)
        fsync_dir(tmp)
        # os.replace cannot overwrite a non-empty dir: move the old one aside first.
        # A crash between the two renames loses only this step; older ones stay.
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(checkpoints_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    _prune(checkpoints_dir, keep_last, final)
    return final


def _prune(checkpoints_dir: Path, keep_last: int | None, newest: Path) -> None:
    # Leftovers of saves killed mid-write: never complete, only taking disk space.
    for d in checkpoints_dir.iterdir():
        if d.name.startswith(".step_") and d.name.endswith((".tmp", ".old")) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
    if keep_last is None:
        return
    others = [d for d in list_checkpoints(checkpoints_dir) if d != newest]
    others.sort(key=_step_of, reverse=True)
    for d in others[keep_last - 1:]:
        shutil.rmtree(d)


def load_checkpoint(ckpt_dir: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                    named_params: Iterable[tuple[str, nn.Parameter]] | None = None,
                    restore_rng: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Load a checkpoint dir: returns (model_state on CPU, trainer_state).

    If `optimizer` is given its state and param_group hyperparameters are
    restored by parameter name (pass the same kind of `named_params` as when
    saving). With `restore_rng`, the torch / CUDA / numpy / Python global RNG
    states are restored. The model state is returned, not loaded: call
    `model.load_state_dict(model_state)`.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(
            f"checkpoint dir not found: {ckpt_dir} (use latest_checkpoint(run_dir) to find one)")
    model_state = load_file(str(_require(ckpt_dir, MODEL_FILE)))
    trainer_state = _read_json(ckpt_dir, TRAINER_STATE_FILE)
    if optimizer is not None:
        _restore_optimizer(ckpt_dir, optimizer, named_params)
    if restore_rng:
        _restore_rng(ckpt_dir)
    return model_state, trainer_state
