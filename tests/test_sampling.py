"""Samplers against direct computations (no model needed)."""

import math

import pytest
import torch

from engine.sampling import (cps_mean_std, cps_step, cps_step_log_prob, flow_timesteps, gaussian_step_log_prob,
                             ode_step, sde_mean_std, sde_step, sde_step_log_prob, sde_t_cap, step_log_prob,
                             step_noise_levels)


def _state(seed=0, shape=(3, 1, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_timesteps_run_from_noise_to_data():
    t = flow_timesteps(10)
    assert t.dtype == torch.float32 and t.shape == (11,)
    assert t[0] == 1.0 and t[-1] == 0.0 and torch.all(t[1:] < t[:-1])
    shifted = flow_timesteps(10, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0
    assert torch.all(shifted[1:-1] > t[1:-1])  # shift > 1 spends more steps near noise
    assert math.isclose(float(shifted[5]), 3 * 0.5 / (1 + 2 * 0.5), rel_tol=1e-6)


def test_sde_with_zero_noise_is_the_ode_step_bit_for_bit():
    x, v, eps = _state()
    t_all = flow_timesteps(10)
    for k in range(10):
        x_sde, log_prob = sde_step(x, v, t_all[k], t_all[k + 1], 0.0, eps, sde_t_cap(t_all))
        assert torch.equal(x_sde, ode_step(x, v, t_all[k], t_all[k + 1]))
        assert torch.equal(log_prob, torch.zeros(3))


def test_sde_mean_and_std_follow_flow_grpo_eq9():
    x, v, _ = _state(1)
    t, t_next, a = torch.tensor(0.6), torch.tensor(0.5), 0.7
    mean, std = sde_mean_std(x, v, t, t_next, a, torch.tensor(0.9))
    sigma = a * math.sqrt(0.6 / 0.4)
    dt = -0.1
    expected_mean = x + (v + sigma**2 / (2 * 0.6) * (x + 0.4 * v)) * dt
    torch.testing.assert_close(mean, expected_mean, rtol=1e-5, atol=1e-6)
    assert math.isclose(float(std), sigma * math.sqrt(0.1), rel_tol=1e-5)


def test_first_step_sigma_is_finite_with_the_cap():
    t_all = flow_timesteps(10)
    x, v, eps = _state(2)
    x_next, log_prob = sde_step(x, v, t_all[0], t_all[1], 0.7, eps, sde_t_cap(t_all))
    assert torch.isfinite(x_next).all() and torch.isfinite(log_prob).all()
    _, std = sde_mean_std(x, v, t_all[0], t_all[1], 0.7, sde_t_cap(t_all))
    assert math.isclose(float(std), 0.7 * math.sqrt(1.0 / 0.1) * math.sqrt(0.1), rel_tol=1e-5)


def test_log_prob_equals_the_gaussian_density_of_the_taken_step():
    x, v, eps = _state(3)
    t_all = flow_timesteps(10)
    for k in (0, 4, 9):
        x_next, log_prob = sde_step(x, v, t_all[k], t_all[k + 1], 0.7, eps, sde_t_cap(t_all))
        mean, std = sde_mean_std(x, v, t_all[k], t_all[k + 1], 0.7, sde_t_cap(t_all))
        direct = torch.distributions.Normal(mean.double(), std.double()).log_prob(x_next.double())
        torch.testing.assert_close(log_prob.double(), direct.flatten(1).mean(1), rtol=1e-5, atol=1e-5)


def test_recomputed_log_prob_equals_recorded_bitwise():
    x, v, eps = _state(4)
    t_all = flow_timesteps(10)
    x_next, recorded = sde_step(x, v, t_all[3], t_all[4], 0.7, eps, sde_t_cap(t_all))
    recomputed, _, _ = sde_step_log_prob(x, x_next, v, t_all[3], t_all[4], 0.7, sde_t_cap(t_all))
    assert torch.equal(recorded, recomputed)


def test_log_prob_is_the_gaussian_log_density_in_numbers():
    """log N(x; m, s^2) = -(x - m)^2 / (2 s^2) - log s - log(2 pi) / 2, averaged over elements; 0 where s = 0."""
    mean = torch.zeros(3, 4)
    offsets = torch.tensor([[0.01] * 4, [1.0, -1.0, 0.5, 0.0], [2.0] * 4])
    got = gaussian_step_log_prob(mean + offsets, mean, torch.tensor(0.5))
    c = 0.5 * math.log(2 * math.pi)
    expected = [-(0.01**2) / 0.5 + math.log(2) - c,                          # 0.01 from the mean
                -(1 + 1 + 0.25 + 0) / 4 / 0.5 + math.log(2) - c,             # mixed offsets: the mean over elements
                -(2.0**2) / 0.5 + math.log(2) - c]
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    assert math.isclose(expected[0], -0.2259918, abs_tol=1e-6)  # the formula itself, in one number
    # A deterministic step (std 0) has log-prob 0, not -inf or NaN.
    assert torch.equal(gaussian_step_log_prob(mean + offsets, mean, torch.tensor(0.0)), torch.zeros(3))


def test_sde_and_cps_steps_add_std_times_the_given_noise():
    """x_next = mean + std · eps with the caller's eps: the noise is neither redrawn nor rescaled."""
    x, v, eps = _state(10)
    t_all = flow_timesteps(10)
    cap = sde_t_cap(t_all)
    for k in (0, 5):
        t, t_next = t_all[k], t_all[k + 1]
        x_sde, _ = sde_step(x, v, t, t_next, 0.7, eps, cap)
        mean, std = sde_mean_std(x, v, t, t_next, 0.7, cap)
        torch.testing.assert_close(x_sde, mean + std * eps, rtol=0, atol=1e-6)
        x_cps, _ = cps_step(x, v, t, t_next, 0.3, eps)
        mean, std = cps_mean_std(x, v, t, t_next, 0.3)
        torch.testing.assert_close(x_cps, mean + std * eps, rtol=0, atol=1e-6)
        assert float(std) > 0.01  # the noise term is not negligible at these steps


def test_noise_levels_respect_the_window():
    assert step_noise_levels(5, "ode", 0.7) == [0.0] * 5
    assert step_noise_levels(5, "sde", 0.7) == [0.7] * 5
    assert step_noise_levels(5, "sde", 0.7, (1, 3)) == [0.0, 0.7, 0.7, 0.0, 0.0]


def test_cps_mean_and_std_follow_the_formula():
    """x0_hat = x - t·v, eps_hat = x + (1-t)·v, std = t'·sin(eta·pi/2),
    mean = (1-t')·x0_hat + sqrt(t'^2-std^2)·eps_hat."""
    x, v, _ = _state(5)
    # eta = 0.3, not 0.5: at eta = 0.5 sin and cos of eta·pi/2 are equal, and swapping them would pass.
    t, t_next, eta = 0.6, 0.45, 0.3
    mean, std = cps_mean_std(x, v, torch.tensor(t), torch.tensor(t_next), eta)
    xd, vd = x.double(), v.double()
    x0_hat, eps_hat = xd - t * vd, xd + (1 - t) * vd
    std_direct = t_next * math.sin(eta * math.pi / 2)
    mean_direct = (1 - t_next) * x0_hat + math.sqrt(t_next**2 - std_direct**2) * eps_hat
    assert math.isclose(float(std), std_direct, rel_tol=1e-6)
    torch.testing.assert_close(mean.double(), mean_direct, rtol=1e-6, atol=1e-6)


def test_cps_with_zero_eta_is_the_euler_step():
    x, v, eps = _state(6)
    t_all = flow_timesteps(10)
    for k in range(10):
        x_cps, log_prob = cps_step(x, v, t_all[k], t_all[k + 1], 0.0, eps)
        assert (x_cps - ode_step(x, v, t_all[k], t_all[k + 1])).abs().max() <= 1e-6
        assert torch.equal(log_prob, torch.zeros(3))


def test_cps_keeps_the_marginal_coefficients_for_an_exact_velocity():
    """With v = eps - x0 the next state is (1-t')·x0 + t'·cos·eps + t'·sin·z: noise norm exactly t'."""
    x0, eps, z = _state(7)
    t, t_next, eta = torch.tensor(0.8), torch.tensor(0.6), 0.7
    x_t = (1 - t) * x0 + t * eps
    x_next, _ = cps_step(x_t, eps - x0, t, t_next, eta, z)
    c, s = math.cos(eta * math.pi / 2), math.sin(eta * math.pi / 2)
    expected = (1 - 0.6) * x0 + 0.6 * c * eps + 0.6 * s * z
    torch.testing.assert_close(x_next, expected, rtol=1e-5, atol=1e-5)
    assert math.isclose(c**2 + s**2, 1.0)


def test_cps_log_prob_is_the_gaussian_density_and_recomputes_bitwise():
    x, v, eps = _state(8)
    t_all = flow_timesteps(10)
    for k in (0, 5, 8):
        x_next, log_prob = cps_step(x, v, t_all[k], t_all[k + 1], 0.6, eps)
        mean, std = cps_mean_std(x, v, t_all[k], t_all[k + 1], 0.6)
        direct = torch.distributions.Normal(mean.double(), std.double()).log_prob(x_next.double())
        torch.testing.assert_close(log_prob.double(), direct.flatten(1).mean(1), rtol=1e-5, atol=1e-5)
        again, _, _ = cps_step_log_prob(x, x_next, v, t_all[k], t_all[k + 1], torch.tensor(0.6))
        assert torch.equal(again, log_prob)
    # The last step lands on t' = 0: deterministic, log-prob 0.
    _, last = cps_step(x, v, t_all[9], t_all[10], 0.6, eps)
    assert torch.equal(last, torch.zeros(3))


def test_step_log_prob_dispatches_on_the_sampler():
    x, v, eps = _state(9)
    t_all = flow_timesteps(10)
    cap = sde_t_cap(t_all)
    x_sde, lp_sde = sde_step(x, v, t_all[2], t_all[3], 0.7, eps, cap)
    x_cps, lp_cps = cps_step(x, v, t_all[2], t_all[3], 0.7, eps)
    assert torch.equal(step_log_prob("sde", x, x_sde, v, t_all[2], t_all[3], 0.7, cap)[0], lp_sde)
    assert torch.equal(step_log_prob("cps", x, x_cps, v, t_all[2], t_all[3], 0.7, cap)[0], lp_cps)
    assert step_noise_levels(4, "cps", 0.5, (1, 3)) == [0.0, 0.5, 0.5, 0.0]


def test_log_prob_takes_a_per_sample_std():
    from engine.sampling import gaussian_step_log_prob

    x_next, mean = torch.full((3, 4), 0.1), torch.zeros(3, 4)
    std = torch.tensor([[0.5], [0.0], [0.2]])
    out = gaussian_step_log_prob(x_next, mean, std)
    assert out.shape == (3,)
    for i, s in enumerate([0.5, 0.0, 0.2]):
        expected = 0.0 if s == 0 else -0.01 / (2 * s * s) - math.log(s) - 0.5 * math.log(2 * math.pi)
        assert float(out[i]) == pytest.approx(expected, rel=1e-6)


def test_a_nan_std_gives_a_nan_log_prob_never_a_deterministic_zero():
    """std == 0 exactly is a deterministic step (log-prob 0); a NaN std is a broken step and must show."""
    x = torch.zeros(2, 3, 4)
    scalar = gaussian_step_log_prob(x, x, torch.tensor(float("nan")))
    per_sample = gaussian_step_log_prob(x, x, torch.tensor([float("nan"), 0.0]).view(2, 1, 1))
    per_element = gaussian_step_log_prob(x, x, torch.tensor([float("nan"), 0.0, 1.0]).view(1, 3, 1).expand(2, 3, 4))
    assert torch.isnan(scalar).all() and torch.isnan(per_sample[0]) and per_sample[1] == 0
    assert torch.isnan(per_element).all()
    zero = gaussian_step_log_prob(x, x, torch.tensor(0.0))
    assert torch.equal(zero, torch.zeros(2))
