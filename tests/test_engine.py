"""The engine on the toy card: device-resident loop, invariants, versions, sync side."""

import threading
import time

import pytest
import torch

from engine import Engine, GenerationRequest, HostTransferError, PromptEmbeds, forbid_host_transfers
from engine.types import overlay_request_fields
from engine.denoise import guided_velocity
from engine.sampling import sde_step_log_prob, sde_t_cap


def requests(n=4, **kw):
    return [GenerationRequest(prompt=f"a handwritten {w}", seed=100 + i, **kw)
            for i, w in enumerate(["seven", "three", "one", "zero", "two", "nine"][:n])]


def test_trajectory_shapes_dtypes_and_version(toy_engine):
    traj = toy_engine.generate(requests(3, steps=6))
    assert traj.latents.shape == (3, 7, 1, 8, 8) and traj.latents.dtype == torch.float32
    assert traj.log_probs.shape == (3, 6) and traj.log_probs.dtype == torch.float32
    assert traj.images.shape == (3, 1, 8, 8) and 0 <= traj.images.min() and traj.images.max() <= 1
    assert traj.weight_version == 0 and traj.card == "toy-digits"
    assert torch.isfinite(traj.log_probs).all() and (traj.log_probs != 0).all()


def test_denoise_loop_never_moves_data_to_the_host(toy_engine):
    reqs = requests(2, steps=4)
    cond = toy_engine.encode_prompts([r.prompt for r in reqs])  # prompt encoding is outside the loop
    with forbid_host_transfers():
        for sampler, guidance in (("sde", 1.0), ("ode", 1.0), ("sde", 3.0)):
            from engine.denoise import concat_embeds, denoise
            from engine.sampling import flow_timesteps, step_noise_levels
            uncond = toy_engine.encode_prompts([""] * 2) if guidance != 1.0 else None
            noise = torch.randn(2, 1, 8, 8)
            denoise(toy_engine.model, toy_engine.model.transformer, noise,
                    torch.randn(2, 4, 1, 8, 8) if sampler == "sde" else None, flow_timesteps(4),
                    step_noise_levels(4, sampler, 0.7), cond, None if uncond is None else concat_embeds(uncond, cond),
                    guidance)


def test_the_guard_catches_host_transfers():
    x = torch.ones(3)
    with forbid_host_transfers():
        for bad in (lambda: x.sum().item(), lambda: x.cpu(), lambda: x.numpy(), lambda: x.tolist(),
                    lambda: bool(x.sum() > 0), lambda: torch.equal(x, x), lambda: torch.allclose(x, x),
                    lambda: torch.is_nonzero(x[0])):
            with pytest.raises(HostTransferError):
                bad()
    assert x.sum().item() == 3.0 and torch.equal(x, x)  # restored afterwards


def test_the_guard_nests_without_deadlock_and_the_inner_exit_keeps_the_outer_in_force():
    import threading

    x, outcome = torch.ones(3), []

    def nested():
        with forbid_host_transfers():
            with forbid_host_transfers():  # a guarded helper inside a guarded test
                pass
            try:
                x.tolist()
            except HostTransferError:
                outcome.append("outer still guards")

    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "nested forbid_host_transfers() deadlocked"
    assert outcome == ["outer still guards"] and x.tolist() == [1.0, 1.0, 1.0]


def test_sde_with_zero_noise_equals_ode_through_the_engine(toy_engine):
    ode = toy_engine.generate(requests(3, sampler="ode"))
    sde = toy_engine.generate(requests(3, sampler="sde", noise_level=0.0))
    assert torch.equal(ode.latents, sde.latents)
    assert torch.equal(sde.log_probs, torch.zeros_like(sde.log_probs))


def test_sde_window_steps_outside_are_ode_steps(toy_engine):
    traj = toy_engine.generate(requests(2, steps=6, sde_window=(2, 4)))
    assert (traj.log_probs[:, [0, 1, 4, 5]] == 0).all() and (traj.log_probs[:, 2:4] != 0).all()
    ode = toy_engine.generate(requests(2, steps=6, sampler="ode"))
    assert torch.equal(traj.latents[:, :3], ode.latents[:, :3])  # identical until the window opens


def test_same_seed_same_output_and_batch_invariance(toy_engine):
    alone = toy_engine.generate(requests(1))
    again = toy_engine.generate(requests(1))
    assert torch.equal(alone.latents, again.latents)
    batched = toy_engine.generate(requests(4))
    diff = (batched.latents[0] - alone.latents[0]).abs().max()
    assert diff <= 1e-5
    small = Engine(toy_engine.model, max_batch=3).generate(requests(4))
    assert (small.latents - batched.latents).abs().max() <= 1e-5


def test_on_policy_ratio_is_exactly_one(toy_engine):
    """Recomputing a rollout's log-probs with unchanged weights gives ratio 1, bit for bit."""
    for guidance in (1.0, 3.0):
        traj = toy_engine.generate(requests(4, guidance_scale=guidance))
        from engine.denoise import concat_embeds
        from engine import PromptEmbeds
        cond = PromptEmbeds(traj.prompt_embeds, traj.pooled_prompt_embeds, traj.prompt_mask)
        uncond = None
        if guidance != 1.0:
            uncond = concat_embeds(PromptEmbeds(traj.negative_prompt_embeds, traj.negative_pooled_prompt_embeds,
                                                traj.negative_prompt_mask), cond)
        for j in range(traj.num_steps):
            v = guided_velocity(toy_engine.model, toy_engine.model.transformer, traj.latents[:, j],
                                traj.timesteps[j], cond, uncond, guidance)
            log_prob, _, _ = sde_step_log_prob(traj.latents[:, j], traj.latents[:, j + 1], v, traj.timesteps[j],
                                               traj.timesteps[j + 1], traj.noise_levels[j],
                                               sde_t_cap(traj.timesteps))
            assert torch.equal(torch.exp(log_prob - traj.log_probs[:, j]), torch.ones(4))


def test_guidance_changes_the_output_by_the_cfg_term(toy_engine):
    """From the same noise, the first guided Euler step moves dt·(g - 1)·(v_c - v_u) away from the unguided one."""
    g = 4.0
    plain = toy_engine.generate(requests(2, sampler="ode"))
    guided = toy_engine.generate(requests(2, sampler="ode", guidance_scale=g))
    assert guided.negative_prompt_embeds is not None and plain.negative_prompt_embeds is None
    assert torch.equal(plain.latents[:, 0], guided.latents[:, 0])
    model, x, t, t_next = toy_engine.model, plain.latents[:, 0], plain.timesteps[0], plain.timesteps[1]
    cond = PromptEmbeds(plain.prompt_embeds, plain.pooled_prompt_embeds, plain.prompt_mask)
    uncond = PromptEmbeds(guided.negative_prompt_embeds, guided.negative_pooled_prompt_embeds,
                          guided.negative_prompt_mask)
    with torch.no_grad():  # each branch on its own, outside the engine
        v_cond = model.velocity(model.transformer, x, t, cond)
        v_uncond = model.velocity(model.transformer, x, t, uncond)
    expected = (t_next - t) * (g - 1) * (v_cond - v_uncond)
    assert expected.abs().max() > 0.1  # a change well above the tolerance below
    torch.testing.assert_close(guided.latents[:, 1] - plain.latents[:, 1], expected, atol=1e-5, rtol=0)


def test_a_negative_prompt_is_refused_where_it_would_change_nothing_and_used_under_guidance(toy_engine):
    # At guidance 1 the unconditional branch never runs, so the negative prompt would be dropped silently.
    with pytest.raises(ValueError, match="negative_prompt='a 4' is used only under classifier-free guidance"):
        GenerationRequest(prompt="a 3", seed=0, negative_prompt="a 4")
    GenerationRequest(prompt="a 3", seed=0, negative_prompt="a 4", guidance_scale=0.0)  # uncond only: used
    ode = dict(prompt="a 3", seed=0, sampler="ode", guidance_scale=4.0)
    empty = toy_engine.generate([GenerationRequest(**ode)])
    negative = toy_engine.generate([GenerationRequest(**ode, negative_prompt="a 4")])
    assert not torch.equal(empty.negative_prompt_embeds, negative.negative_prompt_embeds)
    assert (empty.latents[:, -1] - negative.latents[:, -1]).abs().max() > 1e-3


def test_an_ode_request_refuses_the_noise_it_would_ignore_and_takes_each_samplers_default_level(toy_engine):
    # The ODE draws no noise: a level or window given with it would change nothing, so it is refused by name.
    with pytest.raises(ValueError, match=r"^noise_level=0.5 with sampler='ode': the ODE draws no noise"):
        GenerationRequest(prompt="a 3", seed=0, sampler="ode", noise_level=0.5)
    with pytest.raises(ValueError, match=r"^sde_window=\(0, 2\) with sampler='ode': the ODE has no stochastic"):
        GenerationRequest(prompt="a 3", seed=0, sampler="ode", sde_window=(0, 2))
    with pytest.raises(ValueError, match=r"^audio_noise_level=0.3 with sampler='ode'"):
        GenerationRequest(prompt="a 3", seed=0, sampler="ode", audio=True, audio_noise_level=0.3)
    assert GenerationRequest(prompt="a 3", seed=0, sampler="ode", noise_level=0).noise_level == 0
    # Left out, the level is the sampler's own, and ODE requests batch whatever their rollouts' level was.
    assert GenerationRequest(prompt="a 3", seed=0).noise_level == 0.7
    assert GenerationRequest(prompt="a 3", seed=0, sampler="cps").noise_level == 0.7
    ode = GenerationRequest(prompt="a 3", seed=0, sampler="ode")
    assert ode.noise_level == 0.0 and ode.batch_key() == GenerationRequest(prompt="a 9", seed=1, sampler="ode").batch_key()
    # An ODE over SDE settings (an evaluation of the rollouts' fields, a workflow stage) drops their noise.
    sde = dict(steps=4, sampler="sde", noise_level=1.1, sde_window=(0, 2))
    fields = overlay_request_fields(sde, {"sampler": "ode"})
    assert fields == dict(steps=4, sampler="ode", noise_level=None, sde_window=None, audio_noise_level=None)
    assert GenerationRequest(prompt="a 3", seed=0, **fields).noise_level == 0.0
    assert overlay_request_fields(sde, {"guidance_scale": 2.0}) == {**sde, "guidance_scale": 2.0}  # SDE kept
    with pytest.raises(ValueError, match="noise_level=1.1 with sampler='ode'"):  # named by the override: refused
        GenerationRequest(prompt="a 3", seed=0, **overlay_request_fields(sde, {"sampler": "ode", "noise_level": 1.1,
                                                                               "sde_window": None}))
    overlaid = toy_engine.generate([GenerationRequest(prompt="a 3", seed=0, **fields)])
    plain = toy_engine.generate([GenerationRequest(prompt="a 3", seed=0, steps=4, sampler="ode")])
    assert torch.equal(overlaid.latents, plain.latents) and not overlaid.log_probs.any()


def test_incompatible_requests_and_wrong_card_are_clear_errors(toy_engine):
    with pytest.raises(ValueError, match="batch keys differ"):
        toy_engine.generate(requests(1, steps=4) + requests(1, steps=5))
    with pytest.raises(ValueError, match="serves 'toy-digits'"):
        toy_engine.generate([GenerationRequest(prompt="x", seed=0, card="sd3")])
    with pytest.raises(ValueError, match="valid samplers"):
        GenerationRequest(prompt="x", seed=0, sampler="ddim")
    with pytest.raises(KeyError, match="known cards: .*toy-digits"):
        Engine.from_card("nope")


def test_prompt_cache_hits_and_invalidation(toy_engine):
    toy_engine.generate(requests(2))
    misses = toy_engine.prompt_cache.misses
    toy_engine.generate(requests(2))
    assert toy_engine.prompt_cache.misses == misses and toy_engine.prompt_cache.hits >= 2
    toy_engine.set_weight_version(1)  # transformer-only update keeps the cache
    toy_engine.generate(requests(2))
    assert toy_engine.prompt_cache.misses == misses
    toy_engine.set_weight_version(2, prompt_encoder_changed=True)
    assert len(toy_engine.prompt_cache) == 0
    traj = toy_engine.generate(requests(2))
    assert toy_engine.prompt_cache.misses == misses + 2 and traj.weight_version == 2


def test_a_bucketed_write_into_the_text_encoder_drops_cached_prompts_at_the_commit():
    """write_weights + set_weight_version (the bucketed sync) without prompt_encoder_changed: the cache must
    not hand back embeddings of the old encoder."""
    engine = Engine.from_card("toy-digits")
    prompt = "a handwritten seven"
    old = engine.encode_prompts([prompt]).embeds.clone()
    engine.pause()
    engine.drain()
    engine.write_weights({k: v * 3 for k, v in engine.component("text_encoder").state_dict().items()
                          if v.is_floating_point()}, "text_encoder")
    engine.set_weight_version(1)
    engine.resume()
    served = engine.encode_prompts([prompt]).embeds
    assert not torch.equal(served, old) and torch.equal(served, engine.model.encode_prompts([prompt]).embeds)
    engine.set_weight_version(2)  # the flag is spent: a later transformer-only version keeps the cache
    assert len(engine.prompt_cache) == 1


def test_cached_prompt_rows_own_their_memory_and_the_length_limit_is_part_of_the_key():
    engine = Engine.from_card("toy-digits", prompt_cache_size=4)
    prompts = [f"a handwritten digit number {i}" for i in range(40)]
    engine.encode_prompts(prompts)
    for entry in engine.prompt_cache._entries.values():  # a view would pin the whole 40-row batch
        assert entry[0].untyped_storage().nbytes() == entry[0].numel() * entry[0].element_size()
    full = engine.encode_prompts(prompts[-1:]).embeds
    engine.model.max_length = 6
    short = engine.encode_prompts(prompts[-1:]).embeds
    assert short.shape[1] == 6 != full.shape[1]
    assert torch.equal(short, engine.model.encode_prompts(prompts[-1:]).embeds)


def test_versions_only_increase(toy_engine):
    with pytest.raises(ValueError, match="must increase"):
        toy_engine.set_weight_version(0)


def test_a_weights_file_with_values_not_finite_in_the_served_dtype_is_refused_and_nothing_changes(tmp_path):
    from safetensors.torch import save_file

    engine = Engine.from_card("toy-digits")
    before = {k: v.clone() for k, v in engine.model.transformer.state_dict().items()}
    name = next(k for k, v in before.items() if v.is_floating_point() and v.numel() > 1)
    for label, value in (("nan", float("nan")), ("overflow", 1e300)):  # 1e300: finite as float64, inf as float32
        weights = {k: v.double() if k == name else v for k, v in before.items()}
        weights[name] = weights[name].flatten().index_fill(0, torch.tensor([0]), value).view_as(before[name])
        save_file(weights, str(tmp_path / f"{label}.safetensors"))
        with pytest.raises(ValueError, match=f"tensor '{name}' holds values that are NaN or inf as torch.float32"):
            engine.load_weights(str(tmp_path / f"{label}.safetensors"), version=1)
    assert engine.weight_version == 0
    assert all(torch.equal(v, before[k]) for k, v in engine.model.transformer.state_dict().items())


def test_pause_drain_resume_keeps_inflight_on_their_version(toy_engine):
    results = {}

    def run(name, reqs):
        results[name] = toy_engine.generate(reqs)

    slow = threading.Thread(target=run, args=("before", requests(6, steps=40)))
    slow.start()
    deadline = time.monotonic() + 10
    while toy_engine._in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    toy_engine.pause()
    waiting = threading.Thread(target=run, args=("after", requests(1)))
    waiting.start()
    toy_engine.drain(timeout_s=60)
    assert "after" not in results  # held at the door during the sync
    toy_engine.set_weight_version(1)
    toy_engine.resume()
    slow.join()
    waiting.join()
    assert results["before"].weight_version == 0 and results["after"].weight_version == 1


def test_drain_times_out_with_a_clear_error(toy_engine):
    with pytest.raises(RuntimeError, match="pause"):
        toy_engine.drain()
    toy_engine._in_flight += 1  # a call that never finishes
    toy_engine.pause()
    try:
        with pytest.raises(TimeoutError, match="did not drain"):
            toy_engine.drain(timeout_s=0.05)
    finally:
        toy_engine._in_flight -= 1
        toy_engine.resume()


# ---- samplers through the engine, grouping, weight loading -----------------------------------

from engine import compare_outputs, load_model  # noqa: E402
from engine.denoise import concat_embeds, denoise  # noqa: E402
from engine.sampling import flow_timesteps, ode_step, step_noise_levels  # noqa: E402


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_steps_outside_the_sde_window_are_ode_steps_bitwise(toy_engine, sampler):
    """Every step outside the window is the Euler step of the recorded state, bit for bit."""
    traj = toy_engine.generate(requests(2, steps=6, sampler=sampler, noise_level=0.5, sde_window=(2, 4)))
    assert traj.sampler == sampler
    assert (traj.log_probs[:, [0, 1, 4, 5]] == 0).all() and (traj.log_probs[:, 2:4] != 0).all()
    cond = PromptEmbeds(traj.prompt_embeds, traj.pooled_prompt_embeds, traj.prompt_mask)
    for k in (0, 1, 4, 5):
        v = guided_velocity(toy_engine.model, toy_engine.model.transformer, traj.latents[:, k],
                            traj.timesteps[k], cond, None, 1.0)
        euler = ode_step(traj.latents[:, k], v, traj.timesteps[k], traj.timesteps[k + 1])
        assert torch.equal(euler, traj.latents[:, k + 1])


def test_cps_with_zero_eta_equals_ode_through_the_engine(toy_engine):
    ode = toy_engine.generate(requests(3, sampler="ode"))
    cps = toy_engine.generate(requests(3, sampler="cps", noise_level=0.0))
    assert compare_outputs(ode.latents, cps.latents)["value"]["equal"]
    assert torch.equal(cps.log_probs, torch.zeros_like(cps.log_probs))
    with pytest.raises(ValueError, match="eta"):
        GenerationRequest(prompt="x", seed=0, sampler="cps", noise_level=1.0)


@pytest.mark.parametrize("sampler,guidance,window", [("ode", 1.0, None), ("sde", 1.0, None), ("cps", 1.0, None),
                                                     ("sde", 3.0, (1, 3)), ("cps", 3.0, (1, 3))])
def test_host_transfer_guard_on_every_sampler(toy_engine, sampler, guidance, window):
    cond = toy_engine.encode_prompts(["a handwritten seven", "a handwritten two"])
    uncond = concat_embeds(toy_engine.encode_prompts(["", ""]), cond) if guidance != 1.0 else None
    noise, step_noise = torch.randn(2, 1, 8, 8), (None if sampler == "ode" else torch.randn(2, 4, 1, 8, 8))
    with forbid_host_transfers():
        latents, log_probs = denoise(toy_engine.model, toy_engine.model.transformer, noise, step_noise,
                                     flow_timesteps(4), step_noise_levels(4, sampler, 0.5, window), cond,
                                     uncond, guidance, sampler=sampler)
    assert latents.shape == (2, 5, 1, 8, 8) and log_probs.shape == (2, 4)


def test_generate_many_groups_keeps_order_and_is_batch_invariant(toy_engine):
    mixed = [GenerationRequest(prompt="a handwritten seven", seed=1, steps=4),
             GenerationRequest(prompt="a handwritten two", seed=2, steps=6, sampler="ode"),
             GenerationRequest(prompt="a handwritten one", seed=3, steps=4),
             GenerationRequest(prompt="a handwritten nine", seed=4, steps=4, sampler="cps", noise_level=0.5),
             GenerationRequest(prompt="a handwritten zero", seed=5, steps=6, sampler="ode", guidance_scale=2.0)]
    results = toy_engine.generate_many(mixed)
    assert [r.prompts[0] for r in results] == [m.prompt for m in mixed]
    assert [r.seeds[0] for r in results] == [m.seed for m in mixed]
    assert [r.sampler for r in results] == [m.sampler for m in mixed]
    for request, result in zip(mixed, results):
        alone = toy_engine.generate([request])
        report = compare_outputs(alone, result)
        assert report["latents"]["max_abs_diff"] <= 1e-5 and report["log_probs"]["max_abs_diff"] <= 1e-5


def _perturbed(module, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in module.state_dict().items()}


def test_load_weights_copies_in_place_and_bumps_version(tmp_path):
    engine = Engine(load_model("toy-digits"))
    new = _perturbed(engine.model.transformer)
    param_ids = [id(p) for p in engine.model.transformer.parameters()]
    engine.generate(requests(2))
    misses = engine.prompt_cache.misses
    info = engine.load_weights(new, version=3)
    assert info["version"] == 3 and engine.weight_version == 3 and not engine.paused
    assert [id(p) for p in engine.model.transformer.parameters()] == param_ids  # in place
    for k, v in engine.model.transformer.state_dict().items():
        assert torch.equal(v, new[k])
    engine.generate(requests(2))
    assert engine.prompt_cache.misses == misses  # a transformer update keeps the prompt cache
    fresh = Engine(load_model("toy-digits"))
    fresh.model.transformer.load_state_dict(new)
    assert torch.equal(engine.generate(requests(2)).latents, fresh.generate(requests(2)).latents)

    # A .safetensors file, keys prefixed with the component, for the prompt encoder: invalidates the cache.
    from safetensors.torch import save_file
    encoder = {f"text_encoder.{k}": v.clone() for k, v in _perturbed(engine.model.text_encoder, 1).items()}
    save_file(encoder, str(tmp_path / "enc.safetensors"))
    engine.load_weights(str(tmp_path / "enc.safetensors"), version=4, component="prompt_encoder")
    assert len(engine.prompt_cache) == 0 and engine.weight_version == 4
    traj = engine.generate(requests(2))
    assert engine.prompt_cache.misses == misses + 2 and traj.weight_version == 4


def test_load_weights_rejects_bad_names_shapes_versions_and_components():
    engine = Engine(load_model("toy-digits"))
    before = {k: v.clone() for k, v in engine.model.transformer.state_dict().items()}
    good_name = next(iter(before))
    with pytest.raises(KeyError, match="examples of valid names") as err:
        engine.load_weights({good_name: before[good_name], "no.such.weight": torch.zeros(1)}, version=1)
    assert "no.such.weight" in str(err.value) and good_name in str(err.value)
    with pytest.raises(ValueError, match="wrong shape"):
        engine.load_weights({good_name: torch.zeros(3, 3, 3)}, version=1)
    with pytest.raises(ValueError, match="must increase"):
        engine.load_weights({good_name: before[good_name]}, version=0)
    with pytest.raises(ValueError, match="components with weights: text_encoder, transformer"):
        engine.load_weights({good_name: before[good_name]}, version=1, component="vae")
    with pytest.raises(ValueError, match="valid modes: drain"):
        engine.pause(mode="abort")
    # Nothing was copied by the failed calls, and the engine still serves.
    for k, v in engine.model.transformer.state_dict().items():
        assert torch.equal(v, before[k])
    assert engine.weight_version == 0 and not engine.paused


def test_weight_sync_in_flight_finishes_on_old_version_and_later_requests_use_new():
    """pause(mode="drain") -> load_weights -> resume: the running call is bit-identical to a never-synced
    engine; the call that arrived during the sync matches a fresh engine holding the new weights."""
    engine = Engine(load_model("toy-digits"))
    new = _perturbed(engine.model.transformer, seed=2)
    slow_reqs, later_reqs = requests(4, steps=20), requests(3, steps=5)
    results = {}

    def run(name, reqs):
        results[name] = engine.generate(reqs)

    slow = threading.Thread(target=run, args=("before", slow_reqs))
    slow.start()
    deadline = time.monotonic() + 10
    while engine.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.0005)
    engine.pause(mode="drain")
    later = threading.Thread(target=run, args=("after", later_reqs))
    later.start()
    engine.load_weights(new, version=1)  # paused: drains, loads, stays paused
    assert engine.paused and "after" not in results and "before" in results
    engine.resume()
    slow.join()
    later.join()

    never_synced = Engine(load_model("toy-digits"))
    assert results["before"].weight_version == 0
    assert compare_outputs(results["before"], never_synced.generate(slow_reqs))["latents"]["equal"]
    fresh_new = Engine(load_model("toy-digits"))
    fresh_new.model.transformer.load_state_dict(new)
    assert results["after"].weight_version == 1
    assert compare_outputs(results["after"], fresh_new.generate(later_reqs))["latents"]["equal"]


@pytest.mark.parametrize("setting, value, valid", [
    ("max_batch", 0, "integer >= 1"), ("max_batch", -1, "integer >= 1"), ("max_batch", 2.5, "integer >= 1"),
    ("time_shift", 0.0, "finite number > 0"), ("time_shift", -1.0, "finite number > 0"),
    ("time_shift", float("nan"), "finite number > 0"), ("time_shift", float("inf"), "finite number > 0"),
    ("flash_compress", 2.0, r"in \(0, 1\]"), ("flash_compress", 0.0, r"in \(0, 1\]"),
    ("flash_compress", float("nan"), r"in \(0, 1\]")])
def test_engine_settings_out_of_range_are_refused_when_set(setting, value, valid):
    """Before: time_shift 0 gave NaN latents, max_batch 0 a range() error inside generate, flash_compress 2
    NaN latents; each now fails where it is set, naming the setting and the valid range."""
    if setting == "flash_compress":
        engine = Engine.from_card("toy-digits")
        with pytest.raises(ValueError, match=f"Engine {setting} must be .*{valid}"):
            engine.flash_compress = value
        assert engine.flash_compress is None
    else:
        with pytest.raises(ValueError, match=f"Engine {setting} must be .*{valid}"):
            Engine.from_card("toy-digits", **{setting: value})
    engine = Engine.from_card("toy-digits", max_batch=2, time_shift=3)
    engine.flash_compress = 0.5
    assert engine.time_shift == 3.0 and engine.generate(requests(3)).latents.shape[0] == 3
