"""Admission control: estimate a request's memory, queue what does not fit now, refuse what never can.

The estimate is deliberately simple and documented rather than measured:
the fp32 latents the loop keeps (T+1 of them with `keep_trajectory`, else
one), the working latents of a step (x, v, the CFG-doubled input and output),
the pre-drawn step noise of a stochastic rollout, the log-probs and the
decoded output, times `overhead` for activations. A scoring request costs its
images. Callers pass their own `estimate` function for a real model.
"""

from __future__ import annotations

import asyncio
import math

from engine.types import GenerationRequest

FLOAT32_BYTES = 4


class AdmissionError(RuntimeError):
    """A request can never fit within the admission budget."""


def estimate_generation_bytes(request: GenerationRequest, latent_shape: tuple[int, ...],
                              output_elements: int | None = None, overhead: float = 2.0) -> int:
    """Estimated peak bytes of one generation request (see the module docstring)."""
    latent = math.prod(latent_shape)
    kept = request.steps + 1 if request.keep_trajectory else 1
    branches = 2 if request.guidance_scale != 1.0 else 1
    working = 2 * latent + 2 * branches * latent
    noise = request.steps * latent if request.sampler != "ode" else 0
    output = output_elements if output_elements is not None else latent
    elements = kept * latent + working + noise + request.steps + output
    return int(elements * FLOAT32_BYTES * overhead)


class AdmissionController:
    """A byte budget shared by concurrent requests (asyncio; one event loop).

    `acquire(n)` waits until n bytes fit, raises AdmissionError when n exceeds
    the whole budget; `release(n)` refunds. Use `reserve(n)` as an async
    context manager so the refund happens on success, failure and cancellation.
    """

    def __init__(self, capacity_bytes: int):
        if not 0 < capacity_bytes < math.inf:  # NaN fails too
            raise ValueError(f"capacity_bytes must be a finite number > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.waiting = 0
        self.refused = 0
        self.admitted = 0
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        # Created on first use so the controller can be built outside a running loop.
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def check(self, nbytes: int) -> None:
        """Raise AdmissionError if `nbytes` can never fit (ValueError if it is not a byte count at all)."""
        if not 0 <= nbytes < math.inf:  # a negative count would hand budget to others; NaN never fits
            raise ValueError(f"admission needs a finite byte estimate >= 0, got {nbytes!r} (check the engine's "
                             "estimate function)")
        if nbytes > self.capacity_bytes:
            self.refused += 1
            raise AdmissionError(f"request needs an estimated {nbytes} bytes but the admission budget is "
                                 f"{self.capacity_bytes} bytes; reduce steps, size, batch or keep_trajectory")

    async def acquire(self, nbytes: int) -> None:
        """Take `nbytes` of the budget, waiting while other requests hold too much."""
        self.check(nbytes)
        cond = self._condition()
        async with cond:
            self.waiting += 1
            try:
                await cond.wait_for(lambda: self.used_bytes + nbytes <= self.capacity_bytes)
            finally:
                self.waiting -= 1
            self.used_bytes += nbytes
            self.admitted += 1

    async def release(self, nbytes: int) -> None:
        """Refund `nbytes` and wake waiting requests."""
        cond = self._condition()
        async with cond:
            self.used_bytes -= nbytes
            cond.notify_all()

    def reserve(self, nbytes: int) -> "_Reservation":
        """`async with controller.reserve(n):` holds n bytes for the block, refunding however it ends."""
        return _Reservation(self, nbytes)

    def stats(self) -> dict[str, int]:
        return {"admission/used_bytes": self.used_bytes, "admission/capacity_bytes": self.capacity_bytes,
                "admission/waiting": self.waiting, "admission/refused": self.refused,
                "admission/admitted": self.admitted}


class _Reservation:
    def __init__(self, controller: AdmissionController, nbytes: int):
        self.controller, self.nbytes = controller, nbytes

    async def __aenter__(self):
        await self.controller.acquire(self.nbytes)
        return self

    async def __aexit__(self, *exc):
        # Shielded so that a cancellation arriving during the refund cannot leak the bytes.
        await asyncio.shield(self.controller.release(self.nbytes))
        return False
