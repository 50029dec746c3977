"""A guard that fails on any device-to-host transfer, for keeping loops on the device.

The denoise loop must not synchronise with the host (DESIGN.md): a `.item()`
or a Python `if` on a tensor stalls a GPU pipeline once per step. Inside
`forbid_host_transfers()` the usual ways of doing that raise `HostTransferError`.
It patches `torch.Tensor` for the whole process, so use it in tests or in a
debugging run, not around concurrent serving.
"""

from __future__ import annotations

import contextlib
import threading

import torch

# Methods that copy tensor data to the host or make Python branch on it.
GUARDED_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")
# torch functions that return a Python bool, computed from the data (a sync on a GPU).
GUARDED_FUNCTIONS = ("equal", "allclose", "is_nonzero")

_lock = threading.RLock()  # re-entrant: a guarded region may call code that guards itself


class HostTransferError(RuntimeError):
    """A tensor was moved to the host inside a guarded region."""


@contextlib.contextmanager
def forbid_host_transfers():
    """Raise HostTransferError on `.item()`, `.cpu()`, `.numpy()`, `.tolist()`, tensor truthiness and
    `torch.equal` / `torch.allclose` / `torch.is_nonzero`.

    `.to("cpu")` is not trapped: on a CPU test run it cannot be told apart from the loop's own `.to(device)`;
    the GPU suite's `torch.cuda.set_sync_debug_mode("error")` run catches it."""
    with _lock:
        originals = {name: getattr(torch.Tensor, name) for name in GUARDED_METHODS}
        functions = {name: getattr(torch, name) for name in GUARDED_FUNCTIONS}

        def make_trap(label):
            def trap(*args, **kwargs):
                raise HostTransferError(f"{label}() moves data to the host inside a device-resident loop")
            return trap

        for name in GUARDED_METHODS:
            setattr(torch.Tensor, name, make_trap(f"Tensor.{name}"))
        for name in GUARDED_FUNCTIONS:
            setattr(torch, name, make_trap(f"torch.{name}"))
        try:
            yield
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)
            for name, function in functions.items():
                setattr(torch, name, function)
