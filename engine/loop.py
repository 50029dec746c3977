"""Deprecated name of `engine.denoise` (the denoise loop). Kept importable for one release."""

import warnings

import engine.denoise as _denoise

warnings.warn("engine.loop is renamed engine.denoise; the old name goes in the next release", DeprecationWarning,
              stacklevel=2)


def __getattr__(name: str):
    return getattr(_denoise, name)
