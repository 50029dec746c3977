"""MixGRPO-Flash's solver: DPM-Solver++(2M) for rectified flow, its compressed schedule and the engine path.

The solver is checked against the formula of DPM-Solver++ (Lu et al., arXiv 2211.01095,
Alg. 2, midpoint form) written here in the diffusion notation, alpha_t = 1 - t,
sigma_t = t, lambda_t = log(alpha_t / sigma_t), in float64 with the logs and
exponentials the paper writes (the solver avoids them), and by its order: on an
ODE with a closed-form solution, halving the step divides its error by ~4 where
Euler's is divided by ~2.
"""

import math

import pytest
import torch

from engine import Engine, GenerationRequest, load_model
from engine.sampling import compressed_tail, dpm_solver_2m_step, flow_timesteps, ode_step


def paper_2m(x, v, t, t_next, x0_prev, t_prev):
    """x_{t_next} = (sigma_next/sigma)·x - alpha_next·(e^{-h} - 1)·(D0 + D1/2), D1 = (D0 - x0_prev)/r."""
    lam = lambda s: math.log((1 - s) / s)  # noqa: E731
    h = lam(t_next) - lam(t)
    r = (lam(t) - lam(t_prev)) / h
    d0 = x - t * v
    d1 = (d0 - x0_prev) / r
    return (t_next / t) * x - (1 - t_next) * (math.exp(-h) - 1) * (d0 + 0.5 * d1)


def test_one_step_equals_the_papers_formula_golden_values():
    # A case small enough to check by hand: t 0.8 -> 0.6 -> 0.3, lambda = log 1/4, log 2/3, log 7/3.
    x, v, x0_prev = 0.5, -1.25, 1.5
    got = dpm_solver_2m_step(torch.tensor(x), torch.tensor(v), torch.tensor(0.6), torch.tensor(0.3),
                             torch.tensor(x0_prev), torch.tensor(0.8))
    # By hand: D0 = 0.5 + 0.6·1.25 = 1.25; h = log(7/3) - log(2/3) = log 3.5; e^{-h} = 2/7;
    # r = (log(2/3) - log(1/4)) / log 3.5 = log(8/3) / log 3.5; D1 = (1.25 - 1.5) / r;
    # x' = 0.5·0.5 + 0.7·(5/7)·(1.25 + D1/2) = 0.25 + 0.5·(1.25 + D1/2).
    d1 = -0.25 * math.log(3.5) / math.log(8 / 3)
    hand = 0.25 + 0.5 * (1.25 + 0.5 * d1)
    assert hand == pytest.approx(0.795172, abs=1e-6)  # log 3.5 = 1.252763, log 8/3 = 0.980829
    assert float(got) == pytest.approx(hand, abs=1e-6)
    assert float(got) == pytest.approx(paper_2m(x, v, 0.6, 0.3, x0_prev, 0.8), abs=1e-6)


def test_without_a_slope_it_is_the_euler_step():
    """D1 = 0 (the previous prediction equals this one) leaves the first-order step, Euler for flows."""
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)
    t, t_next = torch.tensor(0.7), torch.tensor(0.45)
    same = dpm_solver_2m_step(x, v, t, t_next, x - t * v, torch.tensor(0.9))
    torch.testing.assert_close(same, ode_step(x, v, t, t_next), rtol=0, atol=1e-6)


def integrate(n, second_order, a=0.3, b=-2.0, x_start=1.7, t_start=0.9, t_end=0.2):
    """x' = (x - D(t)) / t with D(t) = a + b·t: the data prediction x - t·v is D(t) on every path.

    Exact: d(x/t)/dt = -D/t², so x(t) = t·(x_s/t_s + a(1/t - 1/t_s) + b·log(t_s/t)).
    """
    ts = torch.linspace(t_start, t_end, n + 1, dtype=torch.float64)
    x = torch.tensor(x_start, dtype=torch.float64)
    x0_prev = None
    for k in range(n):
        t, t_next = ts[k], ts[k + 1]
        v = (x - (a + b * t)) / t
        x_now = x
        x = (dpm_solver_2m_step(x, v, t, t_next, x0_prev, ts[k - 1]) if second_order and k >= 1
             else ode_step(x, v, t, t_next))
        x0_prev = x_now - t * v
    exact = t_end * (x_start / t_start + a * (1 / t_end - 1 / t_start) + b * math.log(t_start / t_end))
    return abs(float(x) - exact)


def test_second_order_convergence_where_euler_is_first_order():
    dpm = [integrate(n, True) for n in (32, 64, 128)]
    euler = [integrate(n, False) for n in (32, 64, 128)]
    for coarse, fine in zip(dpm, dpm[1:]):
        assert 3.5 < coarse / fine < 4.8  # error ~ h² (measured 4.55, 4.28: approaching 4 from above)
    for coarse, fine in zip(euler, euler[1:]):
        assert 1.7 < coarse / fine < 2.3  # error ~ h
    assert dpm[-1] < euler[-1] / 20


def test_compressed_tail_keeps_the_window_and_thins_the_rest():
    ts = flow_timesteps(10)
    out = compressed_tail(ts, 4, 0.4)  # 6 steps after index 4 -> int(2.4) = 2 steps: t = 0.6, 0.3, 0
    torch.testing.assert_close(out, torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.3, 0.0]))
    assert compressed_tail(ts, 9, 0.2).tolist() == ts.tolist()  # one step left: at least one is kept
    assert compressed_tail(ts, 2, 1.0).tolist() == ts.tolist()


def generate(engine, flash, window=(1, 3), steps=10):
    engine.flash_compress = flash
    requests = [GenerationRequest(prompt="the digit four", seed=7 + i, steps=steps, sampler="sde", noise_level=0.7,
                                  sde_window=window) for i in range(3)]
    return engine.generate(requests)


def test_engine_flash_keeps_the_window_steps_and_runs_fewer_after_it():
    engine = Engine(load_model("toy-digits"))
    plain, flash = generate(engine, None), generate(engine, 0.5)
    assert flash.num_steps == 3 + 3  # the window ends at step 3; 7 ODE steps become int(3.5) = 3
    torch.testing.assert_close(flash.timesteps, torch.tensor([1.0, 0.9, 0.8, 0.7, 0.5, 0.2, 0.0]))
    # Up to the window's end, the same steps bit for bit: the trained part of the trajectory is unchanged.
    assert torch.equal(flash.latents[:, :4], plain.latents[:, :4])
    assert torch.equal(flash.log_probs[:, :3], plain.log_probs[:, :3])
    assert (flash.log_probs[:, 3:] == 0).all() and (flash.log_probs[:, 1:3] != 0).all()
    assert flash.noise_levels.tolist() == pytest.approx([0.0, 0.7, 0.7, 0.0, 0.0, 0.0])
    # The second-order tail lands near the full Euler ODE's image (a different solver, not a different policy).
    assert torch.isfinite(flash.images).all()
    assert (flash.images - plain.images).abs().mean() < 0.1
    # ODE requests (evaluation) are never touched by the setting.
    engine.flash_compress = 0.5
    ode = engine.generate([GenerationRequest(prompt="the digit four", seed=7, steps=10, sampler="ode")])
    engine.flash_compress = None
    ode_plain = engine.generate([GenerationRequest(prompt="the digit four", seed=7, steps=10, sampler="ode")])
    assert torch.equal(ode.latents, ode_plain.latents)


def test_engine_flash_tail_matches_the_solver_step_by_step():
    """The engine's Flash steps are dpm_solver_2m_step on its own velocities (the last one Euler)."""
    engine = Engine(load_model("toy-digits"))
    traj = generate(engine, 0.5)
    model, ts = engine.model, traj.timesteps
    from flywheel.recipe.update import trajectory_conditioning
    from engine.denoise import guided_velocity

    cond, _ = trajectory_conditioning(traj, False)
    with torch.no_grad():
        v = [guided_velocity(model, model.transformer, traj.latents[:, k], ts[k], cond, None, 1.0)
             for k in range(traj.num_steps)]
    for k in range(3, traj.num_steps):
        x = traj.latents[:, k]
        if k == traj.num_steps - 1:
            expected = ode_step(x, v[k], ts[k], ts[k + 1])
        else:
            x0_prev = traj.latents[:, k - 1] - ts[k - 1] * v[k - 1]
            expected = dpm_solver_2m_step(x, v[k], ts[k], ts[k + 1], x0_prev, ts[k - 1])
        torch.testing.assert_close(traj.latents[:, k + 1], expected, rtol=0, atol=1e-5)
