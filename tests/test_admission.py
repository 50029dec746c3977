"""AdmissionController: refuse what can never fit, queue what does not fit now, refund however a request ends."""

import asyncio

import pytest

from engine import AdmissionController, AdmissionError, AsyncEngine, Engine, GenerationRequest
from engine.admission import estimate_generation_bytes


def request(**kw):
    return GenerationRequest(prompt="a handwritten seven", seed=0, steps=4, **kw)


def test_estimate_follows_the_request():
    shape = (1, 8, 8)
    base = estimate_generation_bytes(request(sampler="ode", keep_trajectory=False), shape)
    assert estimate_generation_bytes(request(sampler="ode"), shape) > base  # keeps T+1 latents
    assert estimate_generation_bytes(request(sampler="sde", keep_trajectory=False), shape) > base  # step noise
    assert estimate_generation_bytes(request(sampler="ode", keep_trajectory=False, guidance_scale=3.0), shape) > base
    assert estimate_generation_bytes(request(sampler="ode", keep_trajectory=False), (4, 64, 64)) == pytest.approx(
        base * 256, rel=0.05)


def test_refuses_what_can_never_fit(toy_model):
    async def main():
        ae = AsyncEngine(Engine(toy_model), admission=AdmissionController(1000))
        with pytest.raises(AdmissionError, match="admission budget is 1000 bytes"):
            await ae.submit(request())
        stats = ae.stats()
        await ae.aclose()
        return stats

    stats = asyncio.run(main())
    assert stats["admission/refused"] == 1 and stats["admission/used_bytes"] == 0


def test_queues_what_does_not_fit_now_and_refunds_on_success():
    async def main():
        controller = AdmissionController(100)
        await controller.acquire(60)
        waiter = asyncio.ensure_future(controller.acquire(60))
        await asyncio.sleep(0.01)
        assert not waiter.done() and controller.waiting == 1
        await controller.release(60)
        await asyncio.wait_for(waiter, 1)
        assert controller.used_bytes == 60 and controller.waiting == 0
        await controller.release(60)
        return controller.used_bytes

    assert asyncio.run(main()) == 0


def test_engine_requests_queue_then_all_complete(toy_model):
    one = estimate_generation_bytes(request(), (1, 8, 8))

    async def main():
        ae = AsyncEngine(Engine(toy_model), admission=AdmissionController(one * 2), max_wait_ms=1)
        tasks = [asyncio.ensure_future(ae.submit(GenerationRequest(prompt="a seven", seed=i, steps=4)))
                 for i in range(5)]
        await asyncio.sleep(0)
        peak_waiting = 0
        while not all(t.done() for t in tasks):
            peak_waiting = max(peak_waiting, ae.admission.waiting)
            assert ae.admission.used_bytes <= one * 2
            await asyncio.sleep(0.001)
        out = [t.result() for t in tasks]
        await ae.aclose()
        return out, peak_waiting, ae.admission.used_bytes

    results, peak_waiting, used = asyncio.run(main())
    assert [r.seeds[0] for r in results] == list(range(5))
    assert peak_waiting >= 1 and used == 0


def test_refund_on_failure_and_on_cancellation(toy_model):
    class Failing:
        def score(self, images, prompts, metadata):
            raise RuntimeError("scorer exploded")

    import torch

    async def main():
        ae = AsyncEngine({"toy-digits": Engine(toy_model), "fail": Failing()}, max_wait_ms=1,
                         admission=AdmissionController(10_000_000))
        with pytest.raises(RuntimeError, match="exploded"):
            await ae.score("fail", torch.rand(2, 1, 8, 8), ["a", "b"])
        after_failure = ae.admission.used_bytes
        # Cancelled while waiting for admission, and while queued or running.
        blocker = 10_000_000 - 100
        await ae.admission.acquire(blocker)
        waiting = asyncio.ensure_future(ae.submit(request()))
        await asyncio.sleep(0.01)
        assert ae.admission.waiting == 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await ae.admission.release(blocker)
        running = asyncio.ensure_future(ae.submit(GenerationRequest(prompt="x", seed=1, steps=30)))
        await asyncio.sleep(0.005)
        assert ae.admission.used_bytes > 0
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        after_cancel = ae.admission.used_bytes
        ok = await ae.submit(request())  # the engine still serves
        await ae.aclose()
        return after_failure, after_cancel, waiting.cancelled(), ok

    after_failure, after_cancel, cancelled, ok = asyncio.run(main())
    assert after_failure == 0 and after_cancel == 0 and cancelled and len(ok) == 1


def test_a_byte_count_that_is_negative_or_not_finite_is_refused_and_takes_no_budget():
    """Before: acquire(-1000) lowered the usage so later requests overran the budget; acquire(nan) hung."""
    async def main():
        controller = AdmissionController(100)
        for bad in (-1000, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="finite byte estimate >= 0"):
                await asyncio.wait_for(controller.acquire(bad), 1)
        await controller.acquire(0)
        return controller.used_bytes

    assert asyncio.run(main()) == 0
    for bad in (0, -5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="capacity_bytes must be a finite number > 0"):
            AdmissionController(bad)
