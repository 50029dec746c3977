"""`compare_outputs(a, b)`: per-field bitwise equality and max abs difference, for parity tests."""

from __future__ import annotations

import dataclasses
import math

import torch


def _fields(x) -> dict:
    """Named fields of a Trajectory / dataclass, a dict, or a lone tensor ("value")."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return dict(x)
    return {"value": x}


def _compare_one(a, b) -> dict:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return {"equal": False, "max_abs_diff": math.inf, "note": f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"}
        equal = a.dtype == b.dtype and torch.equal(a, b)
        if a.numel() == 0:
            diff = 0.0
        elif a.dtype == torch.bool or b.dtype == torch.bool:
            diff = float((a != b).any())
        else:
            diff = (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()
        return {"equal": equal, "max_abs_diff": diff}
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return {"equal": False, "max_abs_diff": math.inf, "note": "one side is not a tensor"}
    return {"equal": a == b, "max_abs_diff": 0.0 if a == b else math.inf}


def compare_outputs(a, b) -> dict[str, dict]:
    """For every field of two outputs (Trajectories, dicts of tensors or tensors):
    {"equal": bitwise (and dtype) equal, "max_abs_diff": float}, plus an "all" summary.

    Non-tensor fields compare with ==; a field missing on one side is unequal with diff inf.
    """
    fa, fb = _fields(a), _fields(b)
    report = {}
    for name in list(fa) + [k for k in fb if k not in fa]:
        if name not in fa or name not in fb:
            report[name] = {"equal": False, "max_abs_diff": math.inf, "note": "missing on one side"}
        elif fa[name] is None and fb[name] is None:
            report[name] = {"equal": True, "max_abs_diff": 0.0}
        else:
            report[name] = _compare_one(fa[name], fb[name])
    report["all"] = {"equal": all(r["equal"] for r in report.values()),
                     "max_abs_diff": max((r["max_abs_diff"] for r in report.values()), default=0.0)}
    return report
