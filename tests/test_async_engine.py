"""AsyncEngine: dynamic batching, ordering, hosting several cards, weight sync in a running server."""

import asyncio

import pytest
import torch

from engine import AsyncEngine, Engine, GenerationRequest, UnknownCardError, compare_outputs, load_model


def reqs(n, **kw):
    words = ["seven", "three", "one", "zero", "two", "nine", "four", "five", "six", "eight"]
    return [GenerationRequest(prompt=f"a handwritten {words[i % 10]}", seed=200 + i, steps=4, **kw) for i in range(n)]


class BatchSpy:
    """Wraps an engine's generate() to record the batch sizes the pool ran."""

    def __init__(self, engine):
        self.sizes = []
        self._generate = engine.generate
        engine.generate = self

    def __call__(self, requests):
        self.sizes.append(len(requests))
        return self._generate(requests)


def test_concurrent_requests_are_batched_in_order_and_match_solo_runs(toy_model):
    engine = Engine(toy_model)
    spy = BatchSpy(engine)
    requests = reqs(8)

    async def main():
        ae = AsyncEngine(engine, max_batch=8, max_wait_ms=500, max_concurrency=1)
        out = await ae.generate(requests)
        await ae.aclose()
        return out

    results = asyncio.run(main())
    assert spy.sizes == [8]
    assert [r.seeds[0] for r in results] == [r.seed for r in requests]
    assert [r.prompts[0] for r in results] == [r.prompt for r in requests]
    reference = Engine(toy_model).generate(requests)  # the same batch run directly
    for i, r in enumerate(results):
        assert len(r) == 1 and torch.equal(r.latents[0], reference.latents[i])
        solo = Engine(toy_model).generate([requests[i]])
        assert compare_outputs(solo.latents, r.latents)["value"]["max_abs_diff"] <= 1e-5


def test_max_batch_and_batch_keys_split_batches(toy_model):
    engine = Engine(toy_model)
    spy = BatchSpy(engine)
    mixed = reqs(10) + reqs(3, sampler="ode")

    async def main():
        ae = AsyncEngine(engine, max_batch=4, max_wait_ms=200, max_concurrency=2)
        out = await ae.generate(mixed)
        stats = ae.stats()
        await ae.aclose()
        return out, stats

    results, stats = asyncio.run(main())
    assert max(spy.sizes) <= 4 and sum(spy.sizes) == 13 and len(spy.sizes) >= 4
    assert [r.sampler for r in results] == [m.sampler for m in mixed]
    assert stats["pool/rows"] == 13 and stats["admission/used_bytes"] == 0
    # Every row-step called the model (no adaptive request): 13 rows x their steps, hit rate 0.
    assert stats["engine/steps"] == stats["engine/steps_computed"] == sum(r.steps for r in mixed)
    assert stats["engine/cache_hit_rate"] == 0.0


def test_unknown_card_and_model_errors_reach_every_caller(toy_model):
    class Broken:
        card_id = "broken"
        transformer = toy_model.transformer

        def latent_shape(self, h, w, f):
            return (1, 8, 8)

    engine = Engine(toy_model)
    bad_engine = Engine(Broken())

    async def main():
        ae = AsyncEngine({"toy-digits": engine, "broken": bad_engine}, max_wait_ms=50)
        with pytest.raises(UnknownCardError, match="known: broken, toy-digits"):
            await ae.submit(GenerationRequest(prompt="x", seed=0, card="nope"))
        outcomes = await asyncio.gather(*(ae.submit(GenerationRequest(prompt="x", seed=i, card="broken"))
                                          for i in range(3)), return_exceptions=True)
        ok = await ae.submit(reqs(1)[0])  # the pool still serves after a failed batch
        used = ae.admission.used_bytes
        await ae.aclose()
        return outcomes, ok, used

    outcomes, ok, used = asyncio.run(main())
    assert all(isinstance(o, AttributeError) for o in outcomes)
    assert ok.latents.shape[0] == 1 and used == 0


def test_async_pause_drain_load_resume():
    """A request running at pause finishes on version 0 bit-identically to a never-synced engine; one that
    arrives during the sync waits and then matches a fresh engine holding the new weights."""
    engine = Engine(load_model("toy-digits"))
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in engine.model.transformer.state_dict().items()}
    slow = reqs(4, sampler="sde")
    slow = [GenerationRequest(prompt=r.prompt, seed=r.seed, steps=20) for r in slow]
    later = reqs(2)

    async def main():
        ae = AsyncEngine(engine, max_batch=4, max_wait_ms=20, max_concurrency=1)
        first = asyncio.ensure_future(ae.generate(slow))
        while ae.stats()["pool/running"] == 0:
            await asyncio.sleep(0.001)
        pausing = asyncio.ensure_future(ae.pause(mode="drain"))
        await asyncio.sleep(0)
        assert ae.paused
        second = asyncio.ensure_future(ae.generate(later))
        await pausing
        await asyncio.wait_for(asyncio.shield(first), 10)  # the running batch finished while paused
        assert not second.done()
        info = await ae.load_weights(new, version=1)
        await asyncio.sleep(0.05)
        assert not second.done() and ae.paused  # still held: the caller resumes
        await ae.resume()
        out = await first, await second, info, ae.models()
        await ae.aclose()
        return out

    (before, after, info, models) = asyncio.run(main())
    assert info["version"] == 1 and models[0]["weight_version"] == 1
    never_synced = Engine(load_model("toy-digits")).generate(slow)
    assert all(t.weight_version == 0 for t in before)
    for i, t in enumerate(before):
        assert torch.equal(t.latents[0], never_synced.latents[i])
    fresh = Engine(load_model("toy-digits"))
    fresh.model.transformer.load_state_dict(new)
    expected = fresh.generate(later)
    assert all(t.weight_version == 1 for t in after)
    for i, t in enumerate(after):
        assert torch.equal(t.latents[0], expected.latents[i])


def test_scorers_are_hosted_batched_and_replaceable(toy_model):
    calls = []

    class Mean:
        def score(self, images, prompts, metadata):
            calls.append(len(prompts))
            return images.flatten(1).mean(1)

    class Max:
        def score(self, images, prompts, metadata):
            return images.flatten(1).amax(1)

    images = torch.rand(6, 1, 8, 8)

    async def main():
        ae = AsyncEngine({"toy-digits": Engine(toy_model), "mean": Mean()}, max_batch=8, max_wait_ms=300)
        parts = await asyncio.gather(*(ae.score("mean", images[i:i + 2], ["p", "q"]) for i in (0, 2, 4)))
        ae.replace_model("mean", Max())
        swapped = await ae.score("mean", images, ["p"] * 6)
        with pytest.raises(UnknownCardError, match="unknown scorer card 'toy-digits'; known: mean"):
            await ae.score("toy-digits", images, ["p"] * 6)
        kinds = {m["id"]: m["kind"] for m in ae.models()}
        await ae.aclose()
        return parts, swapped, kinds

    parts, swapped, kinds = asyncio.run(main())
    assert calls == [6]  # three callers, one batched call
    assert torch.equal(torch.cat(parts), images.flatten(1).mean(1))
    assert torch.equal(swapped, images.flatten(1).amax(1))
    assert kinds == {"toy-digits": "generator", "mean": "scorer"}


def test_a_load_whose_drain_times_out_undoes_its_pause_and_later_requests_run():
    """A batch that outlives the drain: load_weights raises naming the drain, nothing is loaded, and the
    engine is not left paused (before the fix every later request waited forever)."""
    import threading

    engine = Engine(load_model("toy-digits"))
    release = threading.Event()
    generate = engine.generate
    engine.generate = lambda requests: (release.wait(10), generate(requests))[1]
    bias = {k: v + 1.0 for k, v in engine.model.transformer.state_dict().items() if k.endswith("proj_out.bias")}

    async def main():
        ae = AsyncEngine(engine, max_wait_ms=0, drain_timeout_s=0.1)
        running = asyncio.ensure_future(ae.submit(reqs(1)[0]))
        while ae.stats()["pool/running"] == 0:
            await asyncio.sleep(0.001)
        with pytest.raises(TimeoutError, match=r"did not drain within 0\.1s.*not paused, serving goes on"):
            await ae.load_weights(bias, version=1)
        paused_after = ae.paused
        release.set()
        first = await running
        later = await asyncio.wait_for(ae.submit(reqs(2)[1]), 10)
        version = ae.weight_version("toy-digits")
        await ae.aclose()
        return paused_after, first, later, version

    paused_after, first, later, version = asyncio.run(main())
    assert not paused_after and version == 0
    assert first.weight_version == 0 and later.weight_version == 0


def test_a_caller_held_pause_survives_a_second_pause_that_times_out():
    """pause() restores the state it found: a pause the caller already holds stays in force."""
    engine = Engine(load_model("toy-digits"))

    async def main():
        ae = AsyncEngine(engine, max_wait_ms=0)
        await ae.pause()
        ae._running += 1  # a batch that never ends
        try:
            with pytest.raises(TimeoutError, match="still paused as before"):
                await ae.pause(timeout_s=0.05)
            return ae.paused
        finally:
            ae._running -= 1
            await ae.aclose()

    assert asyncio.run(main()) is True


@pytest.mark.parametrize("kwargs", [{"max_wait_ms": float("nan")}, {"max_wait_ms": float("inf")},
                                    {"drain_timeout_s": 0}, {"drain_timeout_s": float("nan")},
                                    {"max_batch": 0}])
def test_async_engine_settings_out_of_range_are_refused(kwargs):
    with pytest.raises(ValueError, match="need max_batch >= 1"):
        AsyncEngine(None, **kwargs)
