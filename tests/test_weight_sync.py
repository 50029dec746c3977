"""WeightSyncController: the protocol, each transport, parity after a sync, verification, caches."""

import threading
import time

import pytest
import torch

from engine import Engine, GenerationRequest, PromptEmbeds, load_model
from engine.denoise import guided_velocity
from engine.sampling import sde_step_log_prob, sde_t_cap
from flywheel.sync.engine_process import EngineProcess
from flywheel.sync.controller import (CopyTransport, DiskTransport, SharedMemoryTransport, SyncState, WeightSyncController)
from flywheel.sync.transport import tensor_checksums


def reqs(n=4, steps=10, **kw):
    return [GenerationRequest(prompt=f"the digit {d}", seed=500 + i, steps=steps, **kw)
            for i, d in enumerate([7, 3, 1, 0, 2, 9, 4, 5][:n])]


def trained_weights(seed=1):
    """A different set of weights for the toy transformer (a stand-in for an optimizer step)."""
    model = load_model("toy-digits")
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in model.transformer.state_dict().items()}


def engine_with(weights=None):
    model = load_model("toy-digits")
    if weights is not None:
        model.transformer.load_state_dict(weights)
    return Engine(model)


def test_colocated_sync_runs_every_phase_and_bumps_the_version():
    engine = engine_with()
    controller = WeightSyncController(engine)
    metrics = controller.sync()
    assert metrics["weight_version"] == 1 and engine.weight_version == 1 and controller.state is SyncState.IDLE
    assert set(metrics) == {"sync/drain_s", "sync/transfer_s", "sync/commit_s", "sync/total_s", "sync/bytes",
                            "weight_version"}
    assert metrics["sync/bytes"] == 0 and not engine.paused


def test_inflight_requests_finish_on_their_version_and_later_ones_use_the_new_weights():
    new = trained_weights()
    engine = engine_with()
    results = {}

    def run(name, requests):
        results[name] = engine.generate(requests)

    before = threading.Thread(target=run, args=("before", reqs(8, steps=60)))
    before.start()
    while engine.in_flight == 0:
        time.sleep(0.001)
    controller = WeightSyncController(engine, transport=CopyTransport(), verify=True)
    syncing = threading.Thread(target=lambda: results.setdefault("sync", controller.sync(new)))
    syncing.start()
    while not engine.paused:
        time.sleep(0.001)
    after = threading.Thread(target=run, args=("after", reqs(4)))
    after.start()  # arrives during the sync: waits, then runs on the new version
    for t in (before, syncing, after):
        t.join(timeout=120)

    assert results["before"].weight_version == 0 and results["after"].weight_version == 1
    baseline = engine_with().generate(reqs(8, steps=60))
    assert torch.equal(results["before"].latents, baseline.latents)  # as if no sync ever happened
    fresh = engine_with(new).generate(reqs(4))
    assert torch.equal(results["after"].latents, fresh.latents)  # as if built with the new weights
    assert results["sync"]["sync/bytes"] == sum(t.numel() * 4 for t in new.values())


@pytest.fixture(scope="module")
def engine_process():
    with EngineProcess.start("toy-digits", threads=1) as handle:
        yield handle


@pytest.mark.parametrize("transport", ["shm", "shm-buckets", "disk"])
def test_process_sync_into_a_randomized_receiver_matches_the_sender(engine_process, transport, tmp_path):
    sender_weights = trained_weights(seed=2)
    # Randomize the receiver first, so a sync that moved nothing could not pass.
    junk = {k: torch.randn(v.shape) for k, v in sender_weights.items()}
    WeightSyncController(engine_process, transport=DiskTransport(tmp_path / "junk")).sync(junk)
    assert engine_process.checksums(list(junk)) == tensor_checksums(junk)

    chosen = {"shm": lambda: SharedMemoryTransport(),  # writes into the engine's mapped weights
              "shm-buckets": lambda: SharedMemoryTransport(bucket_bytes=128 * 1024, mapped=False),
              "disk": lambda: DiskTransport(tmp_path)}[transport]()
    controller = WeightSyncController(engine_process, transport=chosen, verify=True)
    try:
        before = engine_process.weight_version
        metrics = controller.sync(sender_weights)
    finally:
        controller.close()
    assert metrics["weight_version"] == before + 1 == engine_process.weight_version
    assert engine_process.checksums(list(sender_weights)) == tensor_checksums(sender_weights)

    # A sentinel rollout in the engine process equals the sender's own rollout ...
    sender_engine = engine_with(sender_weights)
    remote = engine_process.generate(reqs(4))
    local = sender_engine.generate(reqs(4))
    assert torch.equal(remote.latents, local.latents) and torch.equal(remote.log_probs, local.log_probs)
    # ... and the trainer's recomputed log-probs of that rollout agree with the engine's.
    cond = PromptEmbeds(local.prompt_embeds, local.pooled_prompt_embeds, local.prompt_mask)
    model = sender_engine.model
    for j in range(remote.log_probs.shape[1]):
        v = guided_velocity(model, model.transformer, remote.latents[:, j], remote.timesteps[j], cond, None, 1.0)
        log_prob, _, _ = sde_step_log_prob(remote.latents[:, j], remote.latents[:, j + 1], v, remote.timesteps[j],
                                           remote.timesteps[j + 1], remote.noise_levels[j],
                                           sde_t_cap(remote.timesteps))
        assert (log_prob - remote.log_probs[:, j]).abs().max() <= 1e-6


def test_verification_fails_loudly_on_a_corrupted_transfer():
    class Corrupting(CopyTransport):
        def transfer(self, engine, tensors, version, component):
            bad = dict(tensors)
            name = next(iter(bad))
            bad[name] = bad[name] + 1e-3
            return super().transfer(engine, bad, version, component)

    engine = engine_with()
    with pytest.raises(RuntimeError, match="verification failed: 1 tensor"):
        WeightSyncController(engine, transport=Corrupting(), verify=True).sync(trained_weights())
    assert not engine.paused  # the engine is never left frozen


def test_transformer_sync_keeps_the_prompt_cache_and_an_encoder_sync_drops_it():
    engine = engine_with()
    engine.generate(reqs(4))
    misses = engine.prompt_cache.misses
    controller = WeightSyncController(engine, transport=CopyTransport())
    controller.sync(trained_weights())
    engine.generate(reqs(4))
    assert engine.prompt_cache.misses == misses  # no prompt re-encoded

    encoder = {k: v + 0.01 for k, v in engine.model.text_encoder.state_dict().items()}
    controller.sync(encoder, component="text_encoder")
    assert len(engine.prompt_cache) == 0
    traj = engine.generate(reqs(4))
    assert engine.prompt_cache.misses == misses + 4 and traj.weight_version == 2


def test_a_drain_that_never_ends_times_out_with_a_clear_error_and_resumes():
    engine = engine_with()
    engine._in_flight += 1  # a generate() call that never returns
    try:
        controller = WeightSyncController(engine, timeout_s=0.05)
        with pytest.raises(TimeoutError, match="did not drain within"):
            controller.sync()
        assert controller.state is SyncState.IDLE and not engine.paused and engine.weight_version == 0
    finally:
        engine._in_flight -= 1


def test_lora_only_sync_moves_just_the_adapter_and_leaves_the_base_untouched():
    from flywheel.lora import add_lora

    targets = ["qkv", "proj", "mlp.0", "mlp.2"]
    trainer = load_model("toy-digits")
    add_lora(trainer.transformer, 4, 4.0, targets)
    adapter = {n: p.detach() + 0.05 for n, p in trainer.transformer.named_parameters() if "lora_" in n}
    with EngineProcess.start("toy-digits", lora={"rank": 4, "alpha": 4.0, "targets": targets}) as handle:
        base_names = [n for n in trainer.transformer.state_dict() if "lora_" not in n]
        base_before = handle.checksums(base_names)
        handle.generate(reqs(2))
        controller = WeightSyncController(handle, transport=SharedMemoryTransport(), verify=True)
        try:
            metrics = controller.sync(adapter)
        finally:
            controller.close()
        assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in adapter.values())
        assert metrics["sync/bytes"] < 0.2 * sum(t.numel() * 4 for t in trainer.transformer.state_dict().values())
        assert handle.checksums(base_names) == base_before  # the frozen base is untouched
        assert handle.checksums(list(adapter)) == tensor_checksums(adapter)
        assert handle.generate(reqs(2)).weight_version == 1


def test_hundred_requests_in_flight_on_the_async_engine_with_a_sync_in_the_middle():
    """None lost or failed; each result is on the old or the new version and bit-identical to the engine
    that version implies (batches of one, so every result's batch shape is reproducible)."""
    import asyncio

    from engine import AsyncEngine

    new = trained_weights(seed=4)
    requests = [GenerationRequest(prompt=f"the digit {i % 10}", seed=900 + i, steps=6) for i in range(100)]

    async def main():
        ae = AsyncEngine(engine_with(), max_batch=1, max_wait_ms=0, max_concurrency=4)
        tasks = [asyncio.ensure_future(ae.submit(r)) for r in requests]
        while sum(t.done() for t in tasks) < 30:  # sync once a third has finished and others are running
            await asyncio.sleep(0.001)
        running_at_freeze = ae.stats()["pool/running"]
        await ae.pause(mode="drain")
        await ae.load_weights(new, version=1)
        await ae.resume()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await ae.aclose()
        return results, running_at_freeze

    results, running_at_freeze = asyncio.run(main())
    assert running_at_freeze > 0
    assert len(results) == 100 and not [r for r in results if isinstance(r, BaseException)]
    versions = [r.weight_version for r in results]
    assert set(versions) == {0, 1} and versions.count(0) >= 30
    old, fresh = engine_with(), engine_with(new)
    for request, result in zip(requests, results):
        expected = (old if result.weight_version == 0 else fresh).generate([request])
        assert torch.equal(result.latents, expected.latents), request.seed


def test_copy_sync_keeps_trainer_and_rollout_log_probs_within_1e6():
    """Right after a sync the trainer's recomputed log-probs match the engine's rollout (copy transport)."""
    trainer = engine_with()
    engine = engine_with()
    new = trained_weights(seed=5)
    trainer.model.transformer.load_state_dict(new)  # the optimizer step, on the trainer's side
    WeightSyncController(engine, transport=CopyTransport()).sync(new)
    rollout = engine.generate(reqs(4))
    cond = PromptEmbeds(rollout.prompt_embeds, rollout.pooled_prompt_embeds, rollout.prompt_mask)
    model = trainer.model
    for j in range(rollout.num_steps):
        v = guided_velocity(model, model.transformer, rollout.latents[:, j], rollout.timesteps[j], cond, None, 1.0)
        log_prob, _, _ = sde_step_log_prob(rollout.latents[:, j], rollout.latents[:, j + 1], v, rollout.timesteps[j],
                                           rollout.timesteps[j + 1], rollout.noise_levels[j],
                                           sde_t_cap(rollout.timesteps))
        assert (log_prob - rollout.log_probs[:, j]).abs().max() <= 1e-6


class DiesMidTransfer(SharedMemoryTransport):
    """A sender that writes part of the weights and then fails, before any commit."""

    def transfer(self, engine, tensors, version, component):
        half = dict(list(tensors.items())[: len(tensors) // 2])
        super().transfer(engine, half, version, component)
        raise ConnectionError("trainer died mid-transfer")


@pytest.mark.parametrize("mapped", [True, False])
def test_an_engine_refuses_weights_a_failed_sync_left_half_written_until_a_sync_completes(mapped):
    new = trained_weights(seed=7)
    with EngineProcess.start("toy-digits", threads=1) as handle:
        before = handle.generate(reqs(2))
        broken = DiesMidTransfer(bucket_bytes=64 * 1024, mapped=mapped)
        try:
            with pytest.raises(ConnectionError, match="mid-transfer"):
                WeightSyncController(handle, transport=broken).sync(new)
        finally:
            broken.close()
        assert handle.weight_version == 0  # never committed
        with pytest.raises(RuntimeError, match="partly overwritten by a weight sync that never committed"):
            handle.generate(reqs(2))
        controller = WeightSyncController(handle, transport=SharedMemoryTransport(mapped=mapped), verify=True)
        try:
            controller.sync(new)
        finally:
            controller.close()
        after = handle.generate(reqs(2))
    assert after.weight_version == 1 and not torch.equal(after.latents, before.latents)
    local = engine_with(new).generate(reqs(2))
    assert torch.equal(after.latents, local.latents)
    assert torch.equal(after.steps_computed, local.steps_computed)  # the model calls per row travel too


def test_mapped_sync_of_more_tensors_than_before_remaps_and_keeps_earlier_updates():
    new = trained_weights(seed=8)
    names = list(new)
    first = {n: new[n] for n in names[:10]}
    with EngineProcess.start("toy-digits", threads=1) as handle:
        controller = WeightSyncController(handle, transport=SharedMemoryTransport(), verify=True)
        try:
            controller.sync(first)   # maps just these tensors
            controller.sync(new)     # more names: the engine maps the union into a new block
            assert handle.checksums(names) == tensor_checksums(new)
            again = {n: v + 0.01 for n, v in first.items()}
            controller.sync(again)   # the new block covers these: written in place
            assert handle.checksums(list(again)) == tensor_checksums(again)
            assert handle.checksums(names[10:]) == tensor_checksums({n: new[n] for n in names[10:]})
        finally:
            controller.close()


def test_write_weights_needs_a_paused_drained_engine():
    engine = engine_with()
    transformer = engine.model.transformer
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    storage = {k: v.data_ptr() for k, v in transformer.state_dict().items()}
    new = trained_weights()
    assert not any(torch.equal(new[k], before[k]) for k in new)  # every tensor differs: the check below can fail

    def unchanged():
        return all(torch.equal(v, before[k]) for k, v in transformer.state_dict().items())

    with pytest.raises(RuntimeError, match="paused, drained engine"):
        engine.write_weights(new)
    assert unchanged()
    # Paused but not drained: a generate() call still running refuses the write too.
    started, release = threading.Event(), threading.Event()
    velocity = engine.model.velocity

    def held_velocity(*args, **kwargs):
        started.set()
        release.wait(timeout=30)
        return velocity(*args, **kwargs)

    engine.model.velocity = held_velocity
    worker = threading.Thread(target=engine.generate, args=(reqs(1, steps=2),))
    worker.start()
    try:
        assert started.wait(timeout=30)
        engine.pause()
        with pytest.raises(RuntimeError, match=r"generate\(\) calls running=1"):
            engine.write_weights(new)
    finally:
        release.set()
        worker.join(timeout=30)
        del engine.model.velocity
    assert unchanged()
    engine.drain(timeout_s=5)
    written = engine.write_weights(new)
    # The served weights are now the given tensors, bit for bit, written in place (same storage).
    served = transformer.state_dict()
    assert set(served) == set(new)
    for name, tensor in new.items():
        assert torch.equal(served[name], tensor), name
        assert served[name].data_ptr() == storage[name], name
    assert written == sum(t.numel() * t.element_size() for t in new.values())
    assert engine.weight_version == 0  # a write marks no version; set_weight_version commits
