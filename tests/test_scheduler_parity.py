"""The engine's ODE rollout equals a loop driven by diffusers' FlowMatchEulerDiscreteScheduler; compare_outputs."""

import math

import torch

from engine import Engine, GenerationRequest, compare_outputs


def test_ode_rollout_matches_diffusers_flow_match_euler(toy_model):
    from diffusers import FlowMatchEulerDiscreteScheduler  # ~4 s import: only this test pays it

    steps = 8
    for shift in (1.0, 3.0):
        engine = Engine(toy_model, time_shift=shift)
        reqs = [GenerationRequest(prompt=p, seed=s, steps=steps, sampler="ode", guidance_scale=g)
                for p, s, g in (("a handwritten seven", 3, 1.0), ("a handwritten two", 4, 1.0))]
        traj = engine.generate(reqs)

        # diffusers' scheduler: its own shifted sigmas from the same linear grid; shift is applied by it.
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
        base = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1].numpy()
        scheduler.set_timesteps(sigmas=base, device="cpu")
        torch.testing.assert_close(scheduler.sigmas.float(), traj.timesteps, rtol=0, atol=1e-6)

        x = traj.latents[:, 0].clone()  # the same initial noise
        cond = engine.encode_prompts([r.prompt for r in reqs])
        with torch.no_grad():
            for t in scheduler.timesteps:
                sigma = t / scheduler.config.num_train_timesteps
                v = toy_model.velocity(toy_model.transformer, x, sigma.float(), cond)
                x = scheduler.step(v, t, x).prev_sample
        assert (x - traj.latents[:, -1]).abs().max() <= 1e-6


def test_compare_outputs_reports_per_field(toy_model):
    engine = Engine(toy_model)
    reqs = [GenerationRequest(prompt="a handwritten one", seed=1, steps=3)]
    a, b = engine.generate(reqs), engine.generate(reqs)
    same = compare_outputs(a, b)
    assert same["all"] == {"equal": True, "max_abs_diff": 0.0}
    assert same["latents"]["equal"] and same["weight_version"]["equal"]
    b.latents = b.latents + 1e-3
    b.weight_version = 1
    diff = compare_outputs(a, b)
    assert not diff["latents"]["equal"] and math.isclose(diff["latents"]["max_abs_diff"], 1e-3, rel_tol=1e-3)
    assert diff["log_probs"]["equal"] and not diff["weight_version"]["equal"] and not diff["all"]["equal"]
    shapes = compare_outputs({"x": torch.zeros(2)}, {"x": torch.zeros(3), "y": torch.ones(1)})
    assert shapes["x"]["max_abs_diff"] == math.inf and "missing" in shapes["y"]["note"]
