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

_lock = threading.Lock()


class HostTransferError(RuntimeError):
    """A tensor was moved to the host inside a guarded region."""


@contextlib.contextmanager
def forbid_host_transfers():
    """Raise HostTransferError on `.item()`, `.cpu()`, `.numpy()`, `.tolist()` and tensor truthiness."""
    with _lock:
        originals = {name: getattr(torch.Tensor, name) for name in GUARDED_METHODS}

        def make_trap(name):
            def trap(self, *args, **kwargs):
                raise HostTransferError(f"Tensor.{name}() moves data to the host inside a device-resident loop")
            return trap

        for name in GUARDED_METHODS:
            setattr(torch.Tensor, name, make_trap(name))
        try:
            yield
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)
