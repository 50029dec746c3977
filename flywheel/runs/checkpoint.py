"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically, verified on load.

A checkpoint is a directory `<checkpoints_dir>/step_000123/` holding

    model.safetensors      the model state dict (CPU, contiguous copies)
    optimizer.safetensors  every tensor of optimizer.state, keyed "{param_name}.{state_key}"
    optimizer.json         param_groups (params given by name) and non-tensor state values
    rng.safetensors        torch CPU RNG state (and the current CUDA device's, if any)
    rng.json               Python `random` and numpy global RNG states
    trainer_state.json     the trainer's dict, plus "step"
    manifest.json          the step, every other file's size and sha256, model.safetensors' tensor names

No pickle anywhere: a checkpoint can be loaded without executing code from it.
Optimizer state is keyed by parameter *name*, not position, so it restores
into a fresh optimizer whatever order the parameters were registered in, and
a mismatch is reported by name.

Trust: a save refuses NaN or inf in the model or optimizer state (so a
diverged run never writes a checkpoint, and never prunes a good one for it).
A load verifies the manifest first (sizes, checksums, tensor names, and that
the step in the dir name, the manifest and trainer_state.json agree) and
refuses non-finite weights; every error names the file. `resolve_resume`
picks the newest checkpoint of a run that verifies, with a warning naming
each newer one it skipped and why. Checkpoints without a manifest (written
before flywheel verified its checkpoints) are refused, not guessed at.

Atomicity: everything is written into `.step_000123.tmp/`, fsynced, the
manifest last, checked, then renamed to `step_000123/` with os.replace. A
killed save leaves only a hidden temp dir, which the resolvers ignore and the
next save removes. Old checkpoints are pruned only after the new one is in
place, and only ones that pass the structural check count towards
`keep_last`. One process (rank 0) writes a checkpoints dir; concurrent
writers are not supported.
"""

from __future__ import annotations

import hashlib
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
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from flywheel.guards import NonFiniteError
from flywheel.runs.rundir import CONFIG_FILENAME, fsync_dir

MODEL_FILE = "model.safetensors"
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
OPTIMIZER_FILE = "optimizer.json"
RNG_TENSORS_FILE = "rng.safetensors"
RNG_FILE = "rng.json"
TRAINER_STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "flywheel-checkpoint/1"
# Files every checkpoint has; the optimizer's two come together or not at all.
REQUIRED_FILES = (MODEL_FILE, RNG_TENSORS_FILE, RNG_FILE, TRAINER_STATE_FILE)

_STEP_DIR = re.compile(r"step_(\d+)")
# A same-step checkpoint moved aside by a save that was killed before it put the new one in place.
_ORPHAN_OLD = re.compile(r"\.step_(\d+)\.old")
_LEFTOVER_SUFFIXES = (".tmp", ".old", ".pruned")
_TENSOR_MARK = "__tensor__"  # marks a JSON value that lives in a .safetensors file
_LISTED = 10  # names shown in an error before "... and N more"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or does not fit what loads it; the message names the file."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (resume fell back to an older one) or left alone by pruning."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of a checkpoint dir (`step_000123` -> 123), from its name; None for any other path."""
    return _step_of(Path(path))


def _step_of(path: Path) -> int | None:
    m = _STEP_DIR.fullmatch(path.name) or _ORPHAN_OLD.fullmatch(path.name)
    return int(m.group(1)) if m else None


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    if not names:
        return "none"
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    return shown + (f" ... and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


# ---------------------------------------------------------------------------
# Non-finite numbers
# ---------------------------------------------------------------------------


def first_non_finite(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating tensor holding NaN or inf, or None if all are finite."""
    for name, t in named_tensors:
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            return name
    return None


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
        json.dump(obj, f, indent=1, allow_nan=False)
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
    path = _require(ckpt_dir, filename, hint)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt") from e


def _load_tensors(ckpt_dir: Path, filename: str, hint: str = "") -> dict[str, torch.Tensor]:
    path = _require(ckpt_dir, filename, hint)
    try:
        tensors = load_file(str(path))
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); the checkpoint is corrupt") from e
    bad = first_non_finite(tensors.items())
    if bad is not None:
        raise CheckpointError(f"{path}: tensor {bad!r} holds NaN or inf; a checkpoint of diverged weights "
                              "is not loaded (resume from an earlier checkpoint)")
    return tensors


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:  # file_digest streams: big checkpoints are never read whole into memory
        return hashlib.file_digest(f, "sha256").hexdigest()


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    # A real copy: safetensors refuses tensors that share storage (tied weights),
    # and the caller may keep training while we write.
    return t.detach().to("cpu", copy=True).contiguous()


def _json_checked(value: Any, what: str) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serializable (dict/list/str/int/float/bool/None, "
                         f"finite numbers only): {e}") from e
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


def optimizer_state_by_name(optimizer: torch.optim.Optimizer,
                            named_params: Iterable[tuple[str, nn.Parameter]] | None = None) -> dict:
    """`optimizer.state_dict()` with each parameter named instead of numbered: {"state": {name: {key: value}},
    "param_groups": [{..., "params": [name, ...]}]}, the values not copied. It is the form
    torch.distributed.checkpoint's full optimizer state dict takes (FQN keys), so an FSDP run's gathered state
    is saved as a plain run's is (`save_checkpoint(optimizer_state=...)`)."""
    names = _group_param_names(optimizer, named_params)
    sd = optimizer.state_dict()
    index_to_name = {}
    for packed, group_names in zip(sd["param_groups"], names):
        index_to_name.update(zip(packed["params"], group_names))
    return {"state": {index_to_name[index]: entries for index, entries in sd["state"].items()},
            "param_groups": [{**{k: v for k, v in packed.items() if k != "params"}, "params": group_names}
                             for packed, group_names in zip(sd["param_groups"], names)]}


def _named_state_tensors(optimizer_state: dict) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor of a named optimizer state, named as in optimizer.safetensors (not copied)."""
    for name, entries in optimizer_state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                yield f"{name}.{key}", value


def _optimizer_files(optimizer_state: dict) -> tuple[dict, dict]:
    """(tensors for optimizer.safetensors, JSON object for optimizer.json) of a named optimizer state."""
    tensors: dict[str, torch.Tensor] = {}

    def put(key: str, t: torch.Tensor) -> dict:
        if key in tensors:
            raise ValueError(f"optimizer tensor key {key!r} is produced twice; rename the parameter")
        tensors[key] = _cpu_copy(t)
        return {_TENSOR_MARK: key}

    state = {}
    for name, entries in optimizer_state["state"].items():
        tensor_keys, values = [], {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                put(f"{name}.{key}", value)
                tensor_keys.append(key)
            else:
                values[key] = _json_checked(value, f"optimizer state {name!r}[{key!r}]")
        state[name] = {"tensors": tensor_keys, "values": values}

    param_groups = []
    for gi, packed in enumerate(optimizer_state["param_groups"]):
        group: dict[str, Any] = {}
        for key, value in packed.items():
            if key == "params":
                group[key] = list(value)
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


def read_optimizer_state(ckpt_dir: str | os.PathLike) -> dict:
    """A checkpoint's optimizer state, named (`optimizer_state_by_name`'s form; JSON lists other than the
    parameter names as tuples, as torch's betas are). Verify the checkpoint first (`load_checkpoint` does)."""
    ckpt_dir = Path(ckpt_dir)
    hint = " (was it saved without an optimizer?)"
    meta = _read_json(ckpt_dir, OPTIMIZER_FILE, hint)
    tensors = _load_tensors(ckpt_dir, OPTIMIZER_TENSORS_FILE, hint)
    state = {}
    for name, entry in meta["state"].items():
        state[name] = {key: tensors[f"{name}.{key}"] for key in entry["tensors"]}
        state[name].update(entry["values"])
    groups = [{k: (list(v) if k in ("params", "param_names") else _from_json(v, tensors, ()))
               for k, v in group.items()} for group in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def check_optimizer_names(ckpt_dir: str | os.PathLike, optimizer_state: dict, current: list[list[str]]) -> None:
    """ValueError, naming the parameters, unless the checkpoint's `optimizer_state` covers exactly the
    parameters (and groups) `current` names."""
    saved = [g["params"] for g in optimizer_state["param_groups"]]
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


def _restore_optimizer(ckpt_dir: Path, optimizer: torch.optim.Optimizer,
                       named_params: Iterable[tuple[str, nn.Parameter]] | None) -> None:
    named = read_optimizer_state(ckpt_dir)
    current = _group_param_names(optimizer, named_params)
    check_optimizer_names(ckpt_dir, named, current)
    # Rebuild a torch state dict whose indices follow the *current* optimizer's
    # order: load_state_dict pairs saved and current params by position.
    index = {name: i for i, name in enumerate(n for g in current for n in g)}
    param_groups = []
    for gi, (saved, names) in enumerate(zip(named["param_groups"], current)):
        like = optimizer.param_groups[gi]
        # "param_names" (torch's own, in saved order) is dropped: the optimizer keeps its own.
        group = {k: (tuple(v) if isinstance(like.get(k), tuple) else list(v) if isinstance(v, tuple) else v)
                 for k, v in saved.items() if k not in ("params", "param_names")}
        group["params"] = [index[n] for n in names]
        param_groups.append(group)
    state = {index[name]: entries for name, entries in named["state"].items()}
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
    tensors = _load_tensors(ckpt_dir, RNG_TENSORS_FILE)
    meta = _read_json(ckpt_dir, RNG_FILE)
    # Every state is parsed and tried on a throwaway generator first: a bad value (a hand-edited rng.json) is
    # one CheckpointError naming the file, and no global generator is left half restored.
    try:
        torch.Generator().set_state(tensors["torch_cpu"])
        py = meta["python"]
        python_state = (py["version"], tuple(py["state"]), py["gauss_next"])
        if not (python_state[2] is None or isinstance(python_state[2], float)):  # setstate takes any object
            raise TypeError(f"python gauss_next {python_state[2]!r} is neither null nor a number")
        random.Random().setstate(python_state)
        npy = meta["numpy"]
        numpy_state = (npy["bit_generator"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"],
                       npy["has_gauss"], npy["cached_gaussian"])
        np.random.RandomState().set_state(numpy_state)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise CheckpointError(f"{ckpt_dir}: {RNG_TENSORS_FILE} / {RNG_FILE} hold no valid RNG state "
                              f"({type(err).__name__}: {err}); a checkpoint this library wrote always does: "
                              f"resume from another checkpoint") from None
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["torch_cuda"], torch.cuda.current_device())
        else:
            warnings.warn(f"checkpoint {ckpt_dir} has a CUDA RNG state but CUDA is not available; not restored")
    random.setstate(python_state)
    np.random.set_state(numpy_state)


# ---------------------------------------------------------------------------
# Manifest and verification
# ---------------------------------------------------------------------------


def _write_manifest(ckpt_dir: Path, step: int, model_names: list[str]) -> None:
    """Write manifest.json last: its presence marks every other file as complete."""
    files = {}
    for path in sorted(ckpt_dir.iterdir()):
        if path.name != MANIFEST_FILE:
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    _write_json(ckpt_dir / MANIFEST_FILE, {"format": MANIFEST_FORMAT, "step": step, "files": files,
                                           "model_tensors": model_names})


def _read_manifest(ckpt_dir: Path) -> dict:
    path = ckpt_dir / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the checkpoint was written before flywheel verified its checkpoints, or its "
            "save did not finish; it is not loaded unverified")
    manifest = _read_json(ckpt_dir, MANIFEST_FILE)
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or isinstance(manifest.get("step"), bool) or not isinstance(manifest.get("step"), int)
            or not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("model_tensors"), list)):
        raise CheckpointError(f"{path} is not a {MANIFEST_FORMAT} manifest (format, step, files, model_tensors)")
    return manifest


def _check_files(ckpt_dir: Path, manifest: dict, checksums: bool) -> None:
    files = manifest["files"]
    missing = [f for f in REQUIRED_FILES if f not in files]
    if (OPTIMIZER_FILE in files) != (OPTIMIZER_TENSORS_FILE in files):
        missing += [f for f in (OPTIMIZER_FILE, OPTIMIZER_TENSORS_FILE) if f not in files]
    if missing:
        raise CheckpointError(f"{ckpt_dir / MANIFEST_FILE} does not list {', '.join(missing)}")
    for name, entry in files.items():
        if Path(name).name != name or not isinstance(entry, dict):
            raise CheckpointError(f"{ckpt_dir / MANIFEST_FILE} has a malformed entry {name!r}: {entry!r}")
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (listed in {MANIFEST_FILE})")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(f"{path} has {size} bytes, the manifest says {entry.get('bytes')} "
                                  "(truncated or overwritten)")
        if checksums and _sha256(path) != entry.get("sha256"):
            raise CheckpointError(f"{path} does not match its sha256 in {MANIFEST_FILE} (the file is corrupt)")


def _check_step(ckpt_dir: Path, manifest: dict) -> None:
    step = manifest["step"]
    state_path = ckpt_dir / TRAINER_STATE_FILE
    trainer_state = _read_json(ckpt_dir, TRAINER_STATE_FILE)
    if not isinstance(trainer_state, dict) or trainer_state.get("step") != step:
        saved = trainer_state.get("step") if isinstance(trainer_state, dict) else trainer_state
        raise CheckpointError(f"{state_path} says step {saved!r} but {MANIFEST_FILE} says {step}: "
                              "the step was edited or the files come from different checkpoints")


def _check_tensor_names(ckpt_dir: Path, manifest: dict) -> None:
    path = ckpt_dir / MODEL_FILE
    try:
        with safe_open(str(path), framework="pt") as f:  # reads the header only
            names = set(f.keys())
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from e
    listed = set(manifest["model_tensors"])
    if names != listed:
        raise CheckpointError(f"{path} does not hold the tensors its manifest lists: missing "
                              f"{_listed(sorted(listed - names))}; not listed {_listed(sorted(names - listed))}")


def _verify(ckpt_dir: Path, expected_step: int | None, checksums: bool) -> dict:
    manifest = _read_manifest(ckpt_dir)
    if expected_step is not None and manifest["step"] != expected_step:
        raise CheckpointError(f"{ckpt_dir / MANIFEST_FILE} says step {manifest['step']} but the directory is "
                              f"{ckpt_dir.name} (step {expected_step})")
    _check_files(ckpt_dir, manifest, checksums)
    _check_step(ckpt_dir, manifest)
    _check_tensor_names(ckpt_dir, manifest)
    return manifest


def verify_checkpoint(ckpt_dir: str | os.PathLike, checksums: bool = True) -> dict:
    """Check a checkpoint dir against its manifest; return the manifest or raise CheckpointError.

    Checks that the manifest exists and parses, that its step equals the dir
    name's and trainer_state.json's, that every listed file exists with its
    size (and, with `checksums`, its sha256: this reads every byte), and that
    model.safetensors holds exactly the listed tensor names. Does not load
    tensors: `load_checkpoint` also refuses NaN or inf weights.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint dir not found: {ckpt_dir}")
    return _verify(ckpt_dir, _step_of(ckpt_dir), checksums)


# ---------------------------------------------------------------------------
# Finding checkpoints
# ---------------------------------------------------------------------------


def _checkpoints_dir(path: Path) -> Path:
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def _candidates(checkpoints_dir: Path) -> list[Path]:
    """Every checkpoint dir, complete or not, by increasing step; plus a same-step checkpoint a killed
    save moved aside (`.step_N.old` with no `step_N`), which is the last good copy of that step."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for d in checkpoints_dir.iterdir():
        if not d.is_dir():
            continue
        if _STEP_DIR.fullmatch(d.name):
            found.append(d)
        elif _ORPHAN_OLD.fullmatch(d.name) and not (checkpoints_dir / checkpoint_name(_step_of(d))).exists():
            found.append(d)
    return sorted(found, key=_step_of)


def list_checkpoints(path: str | os.PathLike) -> list[Path]:
    """Complete checkpoint dirs (with a manifest) under a run dir or checkpoints dir, by increasing step.

    Complete is not verified: use `resolve_resume` or `verify_checkpoint` before trusting one.
    """
    path = _checkpoints_dir(Path(path))
    return [d for d in _candidates(path) if _STEP_DIR.fullmatch(d.name) and (d / MANIFEST_FILE).is_file()]


def latest_checkpoint(path: str | os.PathLike) -> Path | None:
    """The highest-step complete checkpoint: `path` is a run dir, a checkpoints dir or a checkpoint dir.

    Temp dirs of interrupted saves (`.step_*.tmp`) are ignored. None if there is none.
    Not verified: to resume, use `resolve_resume`, which falls back past corrupt ones.
    """
    path = Path(path)
    if _STEP_DIR.fullmatch(path.name) and (path / MANIFEST_FILE).is_file():
        return path
    found = list_checkpoints(path)
    return found[-1] if found else None


def resolve_resume(path: str | os.PathLike) -> tuple[Path, Path]:
    """What `resume=path` means: (run dir, the checkpoint dir to load).

    `path` is a run dir (or its checkpoints dir): the newest checkpoint that
    verifies (sizes, checksums, names, steps) is chosen; each newer one that
    does not is skipped with a CheckpointWarning naming it and why. `path` may
    also be one checkpoint dir (`<run>/checkpoints/step_N`): then that one must
    verify, no fallback. The run dir must hold its config.yaml: resuming with
    default settings instead of the run's is refused. Raises FileNotFoundError
    for a missing path, config or checkpoints, and CheckpointError listing
    every checkpoint and why when none verifies.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"resume={str(path)!r}: no such directory; give a run directory "
                                "(or one of its checkpoints/step_N directories)")
    explicit = _step_of(path) is not None
    run_dir = path.parent.parent if explicit else (path.parent if path.name == "checkpoints" else path)
    config = run_dir / CONFIG_FILENAME
    if not config.is_file():
        raise FileNotFoundError(f"resume={str(path)!r}: {config} is missing; a run directory without its "
                                "config cannot be resumed (the defaults may differ from the settings it ran with)")
    if explicit:
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            raise CheckpointError(f"resume={str(path)!r}: {e} (give the run directory {run_dir} to resume from "
                                  "its newest checkpoint that verifies)") from e
        return run_dir, path
    candidates = _candidates(run_dir / "checkpoints")
    if not candidates:
        # A run killed before its first checkpoint: say how to start it again.
        raise FileNotFoundError(
            f"resume={str(path)!r}: no checkpoint in {run_dir / 'checkpoints'} (the run stopped before its first "
            "checkpoint, so there is nothing to resume from). Start it again with the same command without "
            "resume= (a run directory with no checkpoint and no trained step counts as fresh), or with "
            "overwrite=true if it trained steps")
    skipped: list[tuple[Path, CheckpointError]] = []
    for ckpt in reversed(candidates):
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            skipped.append((ckpt, e))
            continue
        if skipped:
            why = "; ".join(f"{d.name}: {e}" for d, e in skipped)
            warnings.warn(f"resume: skipped {len(skipped)} newer checkpoint(s) that do not verify ({why}); "
                          f"resuming from {ckpt}", CheckpointWarning, stacklevel=2)
        return run_dir, ckpt
    why = "\n".join(f"  {d}: {e}" for d, e in skipped)
    raise CheckpointError(f"resume={str(path)!r}: no checkpoint in {run_dir / 'checkpoints'} verifies:\n{why}")


def set_aside_checkpoints_after(run_dir: str | os.PathLike, step: int, into: str | os.PathLike) -> list[str]:
    """Move every checkpoint of `run_dir` past `step` (complete or not) into the folder `into`; returns their
    names. A resume from an older checkpoint abandons them: left in checkpoints/, the next resume would pick
    the newest and mix the two timelines."""
    moved = []
    for ckpt in _candidates(Path(run_dir) / "checkpoints"):
        if _step_of(ckpt) > step:
            Path(into).mkdir(parents=True, exist_ok=True)
            os.replace(ckpt, Path(into) / ckpt.name)
            moved.append(ckpt.name)
    return moved


# ---------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------


def _check_save_arguments(step: int, model_state: dict, trainer_state: dict | None,
                          keep_last: int | None) -> dict:
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
    return trainer_state


def _refuse_non_finite(step: int, what: str, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       checkpoints_dir: Path) -> None:
    bad = first_non_finite(named_tensors)
    if bad is not None:
        raise NonFiniteError(f"step {step}: {what} {bad!r} holds NaN or inf; not saving a checkpoint of a diverged "
                             f"run (the checkpoints in {checkpoints_dir} are kept as they are)")


def _recover_orphans(checkpoints_dir: Path) -> None:
    # A save of an existing step killed between its two renames left the previous copy
    # at .step_N.old and no step_N: put it back, or the leftover cleanup would delete it.
    for d in _candidates(checkpoints_dir):
        if _ORPHAN_OLD.fullmatch(d.name):
            final = checkpoints_dir / checkpoint_name(_step_of(d))
            os.replace(d, final)
            warnings.warn(f"restored {final} from {d.name}, left by a save that was killed", CheckpointWarning,
                          stacklevel=3)


def save_checkpoint(checkpoints_dir: str | os.PathLike, step: int, model_state: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer | None = None,
                    named_params: Iterable[tuple[str, nn.Parameter]] | None = None,
                    trainer_state: dict | None = None, keep_last: int | None = 3,
                    optimizer_state: dict | None = None) -> Path:
    """Write `checkpoints_dir/step_{step:06d}/` atomically and prune old checkpoints.

    `named_params` (e.g. `list(model.named_parameters())`) names the optimizer's
    parameters; without it, names come from the optimizer's `param_names` (torch
    >= 2.6, when built from named parameters) or from positions. In place of
    `optimizer`, `optimizer_state` is a named state (`optimizer_state_by_name`'s
    form, e.g. the full state an FSDP run gathers). `trainer_state`
    must be JSON-serializable; "step" is added. A checkpoint of the same step is
    replaced. Afterwards only the `keep_last` highest-step checkpoints that pass
    the structural check are kept (the new one always; None keeps all); ones
    that fail it are left alone with a CheckpointWarning. Raises NonFiniteError,
    writing nothing, when the model or optimizer state holds NaN or inf.
    Returns the checkpoint dir.
    """
    trainer_state = _check_save_arguments(step, model_state, trainer_state, keep_last)
    checkpoints_dir = Path(checkpoints_dir)
    # Before anything touches the disk: a diverged run must not write, or prune for, a checkpoint.
    _refuse_non_finite(step, "model_state", model_state.items(), checkpoints_dir)
    if optimizer is not None and optimizer_state is not None:
        raise ValueError("save_checkpoint takes an optimizer or a named optimizer_state, not both")
    if optimizer is not None:
        optimizer_state = optimizer_state_by_name(optimizer, list(named_params) if named_params is not None else None)
    if optimizer_state is not None:
        _refuse_non_finite(step, "optimizer state", _named_state_tensors(optimizer_state), checkpoints_dir)

    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    _recover_orphans(checkpoints_dir)
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
        if optimizer_state is not None:
            opt_tensors, opt_meta = _optimizer_files(optimizer_state)
            _write_tensors(tmp / OPTIMIZER_TENSORS_FILE, opt_tensors)
            _write_json(tmp / OPTIMIZER_FILE, opt_meta)
        rng_tensors, rng_meta = _rng_files()
        _write_tensors(tmp / RNG_TENSORS_FILE, rng_tensors)
        _write_json(tmp / RNG_FILE, rng_meta)
        _write_json(tmp / TRAINER_STATE_FILE, trainer_state)
        _write_manifest(tmp, step, sorted(model_state))
        # Read back what a resume will check (checksums were just computed from these files).
        _verify(tmp, step, checksums=False)
        fsync_dir(tmp)
        # os.replace cannot overwrite a non-empty dir: move the old one aside first.
        # A crash between the two renames leaves it at .old, which the next save puts back.
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


def _remove(d: Path) -> None:
    # Out of sight first: a kill during rmtree then leaves a hidden leftover, never a half-deleted step_N.
    hidden = d.with_name(f".{d.name}.pruned")
    os.replace(d, hidden)
    shutil.rmtree(hidden)


def _prune(checkpoints_dir: Path, keep_last: int | None, newest: Path) -> None:
    # Leftovers of saves and prunes killed mid-way: never complete, only taking disk space.
    # (Orphaned .old dirs were put back before this save started.)
    for d in checkpoints_dir.iterdir():
        if d.name.startswith(".step_") and d.name.endswith(_LEFTOVER_SUFFIXES) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
    if keep_last is None:
        return
    good, bad = [], []
    for d in reversed(_candidates(checkpoints_dir)):
        if d == newest:
            continue
        try:
            _verify(d, _step_of(d), checksums=False)
            good.append(d)
        except CheckpointError as e:
            bad.append(f"{d.name}: {e}")
    if bad:
        warnings.warn(f"pruning left alone checkpoints that do not verify (not counted in keep_last={keep_last}): "
                      + "; ".join(bad), CheckpointWarning, stacklevel=3)
    for d in good[keep_last - 1:]:
        _remove(d)


# ---------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------


def load_checkpoint(ckpt_dir: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                    named_params: Iterable[tuple[str, nn.Parameter]] | None = None,
                    restore_rng: bool = True, checksums: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Verify and load a checkpoint dir: returns (model_state on CPU, trainer_state).

    `checksums=False` skips re-hashing a checkpoint `resolve_resume` has just
    verified (sizes, names and steps are still checked): hashing reads every byte.

    The checkpoint is verified first (`verify_checkpoint`, with checksums) and
    its tensors must be finite: a CheckpointError names the file otherwise,
    before anything is restored. If `optimizer` is given its state and
    param_group hyperparameters are restored by parameter name (pass the same
    kind of `named_params` as when saving). With `restore_rng`, the torch /
    CUDA / numpy / Python global RNG states are restored. The model state is
    returned, not loaded: `load_trainable(named_params, model_state, ckpt_dir)`
    loads it strictly by name.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(
            f"checkpoint dir not found: {ckpt_dir} (use resolve_resume(run_dir) to find one)")
    verify_checkpoint(ckpt_dir, checksums=checksums)
    model_state = _load_tensors(ckpt_dir, MODEL_FILE)
    trainer_state = _read_json(ckpt_dir, TRAINER_STATE_FILE)
    if optimizer is not None:
        _restore_optimizer(ckpt_dir, optimizer, list(named_params) if named_params is not None else None)
    if restore_rng:
        _restore_rng(ckpt_dir)
    return model_state, trainer_state


def load_trainable(named_params: Iterable[tuple[str, nn.Parameter]], model_state: dict[str, torch.Tensor],
                   source: str | os.PathLike = "checkpoint") -> None:
    """Copy `model_state` into the parameters of `named_params`, strictly by name.

    The names must be equal both ways and the shapes must match, else a
    CheckpointError names `source` and lists the missing and unexpected names
    (nothing is copied then). Checkpoints hold what the recipe trains (for LoRA,
    only the adapter), so pass the same trainable `(name, param)` pairs that
    were saved. Values are cast to each parameter's dtype and device.
    """
    params = dict(named_params)
    missing = sorted(set(params) - set(model_state))
    unexpected = sorted(set(model_state) - set(params))
    if missing or unexpected:
        raise CheckpointError(
            f"{Path(source) / MODEL_FILE}: its tensors are not the trainable parameters: missing from the "
            f"checkpoint: {_listed(missing)}; in the checkpoint but not trainable here: {_listed(unexpected)} "
            "(resume with the same model and finetune settings, e.g. the same LoRA rank and targets)")
    shapes = [f"{n!r} {tuple(model_state[n].shape)} vs {tuple(p.shape)}" for n, p in params.items()
              if model_state[n].shape != p.shape]
    if shapes:
        raise CheckpointError(f"{Path(source) / MODEL_FILE}: tensor shapes differ from the parameters "
                              f"(checkpoint vs model): {', '.join(shapes[:_LISTED])}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(model_state[n])
