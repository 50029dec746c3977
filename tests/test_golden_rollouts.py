"""Golden tests: the engine's CFG and samplers against an oracle written here, and hard-coded slices.

The oracle re-derives every rollout step by step in float64 from the formulas
of DESIGN.md and the engine.sampling docstring (rectified flow, Flow-GRPO Eq. 9,
CPS). It uses only the model's own forward, one CFG branch at a time, and
torch.randn drawn the way the engine documents (one generator per request,
seeded with the request's seed: the initial noise first, then every step's
noise in one draw). It never calls engine.sampling or engine.denoise, so a wrong
formula there cannot also be wrong here.

The golden slices at the bottom pin the numbers themselves, so a change to a
formula is caught even if the engine and this oracle were changed together.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import GenerationRequest, PromptEmbeds
from engine.denoise import concat_embeds, guided_velocity

PROMPTS = ("a handwritten seven", "the digit 2")
SEEDS = (11, 2024)
LATENT = (1, 8, 8)
# fp32 engine vs float64 oracle, and a batched CFG forward vs two separate forwards: the
# differences measured on this CPU are <= 2e-6 on latents and <= 3e-7 on log-probs; the bounds
# leave room for other BLAS builds and stay orders of magnitude below what any wrong formula,
# branch or noise does to these rollouts (> 1e-2).
LATENT_ATOL = 1e-4
LOG_PROB_ATOL = 1e-4


def _requests(**kw) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=p, seed=s, **kw) for p, s in zip(PROMPTS, SEEDS)]


# ---- the oracle -----------------------------------------------------------------------------------------

def _draw_noise(seed: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's initial noise [*latent] and step noise [steps, *latent], drawn as Engine._draw_noise documents."""
    generator = torch.Generator().manual_seed(seed)
    initial = torch.randn(LATENT, generator=generator)
    per_step = torch.randn((steps, *LATENT), generator=generator)
    return initial, per_step


def _noise(seeds, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    drawn = [_draw_noise(s, steps) for s in seeds]
    return torch.stack([d[0] for d in drawn]), torch.stack([d[1] for d in drawn])


def _branch_velocities(model, x: torch.Tensor, t: float, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_cond, v_uncond) from two separate plain forwards of the transformer, in float64."""
    cond = model.encode_prompts(list(prompts))
    uncond = model.encode_prompts([""] * len(prompts))
    t32 = torch.tensor(t, dtype=torch.float32)
    with torch.no_grad():
        v_cond = model.velocity(model.transformer, x.float(), t32, cond)
        v_uncond = model.velocity(model.transformer, x.float(), t32, uncond)
    return v_cond.double(), v_uncond.double()


def _cfg_velocity(model, x: torch.Tensor, t: float, prompts, guidance: float) -> torch.Tensor:
    """v = v_u + g·(v_c - v_u); at g = 1 only the conditional branch (as DESIGN.md's CFG)."""
    if guidance == 1.0:
        cond = model.encode_prompts(list(prompts))
        with torch.no_grad():
            return model.velocity(model.transformer, x.float(), torch.tensor(t, dtype=torch.float32), cond).double()
    v_cond, v_uncond = _branch_velocities(model, x, t, prompts)
    return v_uncond + guidance * (v_cond - v_uncond)


def _schedule(steps: int) -> list[float]:
    """t_k = 1 - k/T: the engine's default (unshifted) schedule, from noise to data."""
    return [1.0 - k / steps for k in range(steps + 1)]


def _flow_sde(x, v, t: float, t_next: float, t_1: float, a: float) -> tuple[torch.Tensor, float]:
    """Flow-GRPO Eq. 9: mean and std of x_{t_next} given x_t; 1 - t is floored at 1 - t_1."""
    dt = t_next - t
    sigma = a * math.sqrt(t / (1.0 - min(t, t_1)))
    mean = x + dt * (v + sigma**2 / (2.0 * t) * (x + (1.0 - t) * v))
    return mean, sigma * math.sqrt(-dt)


def _cps(x, v, t: float, t_next: float, eta: float) -> tuple[torch.Tensor, float]:
    """Coefficients-preserving sampling: mean and std of x_{t_next} given x_t."""
    x0_hat = x - t * v
    eps_hat = x + (1.0 - t) * v
    mean = (1.0 - t_next) * x0_hat + t_next * math.cos(eta * math.pi / 2) * eps_hat
    return mean, t_next * math.sin(eta * math.pi / 2)


def _log_density(x_next: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """Per-sample mean over elements of log N(x_next; mean, std^2); 0 for a deterministic step."""
    if std == 0.0:
        return torch.zeros(x_next.shape[0], dtype=torch.float64)
    z = (x_next - mean) / std
    return (-0.5 * z**2 - math.log(std) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)


def _transition(sampler: str, x, v, t, t_next, t_1, level) -> tuple[torch.Tensor, float]:
    """Mean and std of one step; a step with noise level 0 is the Euler step x + dt·v."""
    if level == 0.0:
        return x + (t_next - t) * v, 0.0
    if sampler == "cps":
        return _cps(x, v, t, t_next, level)
    return _flow_sde(x, v, t, t_next, t_1, level)


def _levels(steps: int, sampler: str, level: float, window) -> list[float]:
    if sampler == "ode":
        return [0.0] * steps
    start, end = window if window is not None else (0, steps)
    return [level if start <= k < end else 0.0 for k in range(steps)]


def oracle_rollout(model, prompts, seeds, steps: int, sampler: str, level: float = 0.0,
                   guidance: float = 1.0, window=None) -> dict:
    """Every latent [B, T+1, *latent] and log-prob [B, T] of a rollout, recomputed here in float64."""
    initial, step_noise = _noise(seeds, steps)
    ts, levels = _schedule(steps), _levels(steps, sampler, level, window)
    x = initial.double()
    latents, log_probs = [x], []
    for k in range(steps):
        v = _cfg_velocity(model, x, ts[k], prompts, guidance)
        mean, std = _transition(sampler, x, v, ts[k], ts[k + 1], ts[1], levels[k])
        x = mean + std * step_noise[:, k].double()
        latents.append(x)
        log_probs.append(_log_density(x, mean, std))
    return {"latents": torch.stack(latents, 1), "log_probs": torch.stack(log_probs, 1),
            "initial": initial, "step_noise": step_noise, "levels": levels}


def _recovered_step_noise(model, traj, sampler: str, level: float, guidance: float = 1.0,
                          window=None) -> dict[int, torch.Tensor]:
    """The noise the engine actually added at each stochastic step: (x_{k+1} - mean_k) / std_k of its own states."""
    steps = traj.num_steps
    ts, levels = _schedule(steps), _levels(steps, sampler, level, window)
    found = {}
    for k in range(steps):
        x = traj.latents[:, k].double()
        v = _cfg_velocity(model, x, ts[k], traj.prompts, guidance)
        mean, std = _transition(sampler, x, v, ts[k], ts[k + 1], ts[1], levels[k])
        if std > 0:
            found[k] = (traj.latents[:, k + 1].double() - mean) / std
    return found


# ---- classifier-free guidance ----------------------------------------------------------------------------

@pytest.mark.parametrize("guidance", [1.0, 3.0, 4.5])
def test_guided_velocity_is_the_cfg_formula_of_two_separate_forwards(toy_model, guidance):
    """The batched cond/uncond forward of guided_velocity equals v_u + g·(v_c - v_u) from two plain forwards."""
    model = toy_model
    x = torch.randn((2, *LATENT), generator=torch.Generator().manual_seed(5))
    t = 0.6
    v_cond, v_uncond = _branch_velocities(model, x, t, PROMPTS)
    # Not vacuous: the two branches differ by far more than the tolerance.
    assert (v_cond - v_uncond).abs().max() > 0.1
    cond, uncond = model.encode_prompts(list(PROMPTS)), model.encode_prompts(["", ""])
    with torch.no_grad():
        got = guided_velocity(model, model.transformer, x, torch.tensor(t), cond, concat_embeds(uncond, cond),
                              guidance)
    expected = v_uncond + guidance * (v_cond - v_uncond)
    torch.testing.assert_close(got.double(), expected, atol=1e-5 * guidance, rtol=0)
    if guidance == 1.0:
        # What the engine runs at g = 1: the conditional branch alone, the plain forward bit for bit.
        with torch.no_grad():
            alone = guided_velocity(model, model.transformer, x, torch.tensor(t, dtype=torch.float32), cond, None, 1.0)
        assert torch.equal(alone.double(), v_cond)


def test_guided_ode_rollout_equals_an_euler_loop_over_two_separate_forwards(toy_engine, toy_model):
    traj = toy_engine.generate(_requests(sampler="ode", steps=5, guidance_scale=3.0))
    oracle = oracle_rollout(toy_model, PROMPTS, SEEDS, 5, "ode", guidance=3.0)
    assert torch.equal(traj.latents[:, 0], oracle["initial"])  # same noise, drawn from the request seed
    torch.testing.assert_close(traj.timesteps.double(), torch.tensor(_schedule(5), dtype=torch.float64),
                               atol=1e-7, rtol=0)
    torch.testing.assert_close(traj.latents.double(), oracle["latents"], atol=LATENT_ATOL, rtol=0)
    assert torch.equal(traj.log_probs, torch.zeros(2, 5))
    # The unconditional branch is the empty prompt.
    empty = toy_model.encode_prompts(["", ""])
    torch.testing.assert_close(traj.negative_prompt_embeds, empty.embeds, atol=1e-6, rtol=0)
    # Guidance matters here: the same seeds at g = 1 end far away (the test could not pass by ignoring g).
    plain = oracle_rollout(toy_model, PROMPTS, SEEDS, 5, "ode", guidance=1.0)
    assert (plain["latents"][:, -1] - oracle["latents"][:, -1]).abs().max() > 0.2


def test_unguided_rollout_runs_the_conditional_branch_alone(toy_engine, toy_model):
    """At g = 1 no unconditional forward runs, and the rollout is the plain conditional Euler loop."""
    traj = toy_engine.generate(_requests(sampler="ode", steps=4, guidance_scale=1.0))
    assert traj.negative_prompt_embeds is None
    oracle = oracle_rollout(toy_model, PROMPTS, SEEDS, 4, "ode", guidance=1.0)
    torch.testing.assert_close(traj.latents.double(), oracle["latents"], atol=LATENT_ATOL, rtol=0)


# ---- stochastic samplers ----------------------------------------------------------------------------------

def _check_against_oracle(engine, model, sampler, level, steps, guidance=1.0, window=None):
    traj = engine.generate(_requests(sampler=sampler, noise_level=level, steps=steps, guidance_scale=guidance,
                                     sde_window=window))
    oracle = oracle_rollout(model, PROMPTS, SEEDS, steps, sampler, level, guidance, window)
    assert traj.sampler == sampler
    assert torch.equal(traj.latents[:, 0], oracle["initial"])
    torch.testing.assert_close(traj.noise_levels, torch.tensor(oracle["levels"]), atol=0, rtol=0)
    # Every latent, not just the last: a wrong step that later steps wash out is still caught.
    torch.testing.assert_close(traj.latents.double(), oracle["latents"], atol=LATENT_ATOL, rtol=0)
    torch.testing.assert_close(traj.log_probs.double(), oracle["log_probs"], atol=LOG_PROB_ATOL, rtol=0)
    return traj, oracle


def _check_step_noise(model, traj, oracle, sampler, level, guidance=1.0, window=None):
    """The noise the engine added is the drawn step noise: not the initial noise, and new at every step."""
    found = _recovered_step_noise(model, traj, sampler, level, guidance, window)
    assert len(found) >= 2
    initial = oracle["initial"].double()
    for k, eps in found.items():
        torch.testing.assert_close(eps, oracle["step_noise"][:, k].double(), atol=1e-3, rtol=0)
        # Two independent N(0, 1) draws of 64 elements differ by ~3 somewhere; equal noise by ~0.
        assert (eps - initial).abs().amax(dim=(1, 2, 3)).min() > 1.0, f"step {k} reused the initial noise"
        for j, other in found.items():
            if j < k:
                assert (eps - other).abs().amax(dim=(1, 2, 3)).min() > 1.0, f"steps {j} and {k} share noise"
    # And the two requests of the batch got different noise (one generator per request seed).
    first = found[min(found)]
    assert (first[0] - first[1]).abs().max() > 1.0


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_sde_rollout_equals_flow_grpo_eq9_step_by_step(toy_engine, toy_model, guidance):
    traj, oracle = _check_against_oracle(toy_engine, toy_model, "sde", 0.7, steps=4, guidance=guidance)
    assert (traj.log_probs != 0).all()  # every step is stochastic and recorded
    _check_step_noise(toy_model, traj, oracle, "sde", 0.7, guidance)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_cps_rollout_equals_the_cps_formula_step_by_step(toy_engine, toy_model, guidance):
    traj, oracle = _check_against_oracle(toy_engine, toy_model, "cps", 0.3, steps=4, guidance=guidance)
    # The last step lands on t = 0, where CPS's std t_next·sin(eta·pi/2) is 0: deterministic, log-prob 0.
    assert (traj.log_probs[:, :3] != 0).all() and torch.equal(traj.log_probs[:, 3], torch.zeros(2))
    _check_step_noise(toy_model, traj, oracle, "cps", 0.3, guidance)


@pytest.mark.parametrize("sampler,level", [("sde", 0.7), ("cps", 0.3)])
def test_window_rollout_is_euler_outside_the_window_and_the_sampler_inside(toy_engine, toy_model, sampler, level):
    window = (1, 3)
    traj, oracle = _check_against_oracle(toy_engine, toy_model, sampler, level, steps=5, window=window)
    _check_step_noise(toy_model, traj, oracle, sampler, level, window=window)
    cond = PromptEmbeds(traj.prompt_embeds, traj.pooled_prompt_embeds, traj.prompt_mask)
    for k in (0, 3, 4):
        x, t, t_next = traj.latents[:, k], traj.timesteps[k], traj.timesteps[k + 1]
        with torch.no_grad():
            v = toy_model.velocity(toy_model.transformer, x, t, cond)
        # The Euler step of the recorded state, written here, in the engine's fp32: equal bit for bit.
        assert torch.equal(traj.latents[:, k + 1], x + (t_next - t) * v), f"step {k} is not an Euler step"
        assert torch.equal(traj.log_probs[:, k], torch.zeros(2))
    assert (traj.log_probs[:, 1:3] != 0).all()
    # Before the window the rollout is the ODE rollout of the same seeds, bit for bit.
    ode = toy_engine.generate(_requests(sampler="ode", steps=5))
    assert torch.equal(traj.latents[:, :2], ode.latents[:, :2])
    assert not torch.allclose(traj.latents[:, 2], ode.latents[:, 2], atol=0.05)


# ---- golden slices ----------------------------------------------------------------------------------------
#
# latents[:, -1, 0, 3, 2:6] (row 3, columns 2-5 of both final 8x8 latents) of the shipped toy-digits
# weights, PROMPTS / SEEDS, 4 steps, the unshifted schedule. Produced once by this file's float64 oracle
# (`python tests/test_golden_rollouts.py` prints them) and checked against the engine on this CPU. If the
# shipped weights are retrained these numbers change with them: regenerate and say so in the commit.
GOLDEN = {
    ("ode", 0.0, 3.0): [[-0.411143, 0.159679, 0.936981, 0.677633], [-0.885432, -1.055242, 1.08049, -0.614323]],
    ("sde", 0.7, 1.0): [[0.206928, 0.415665, 0.740922, -0.748175], [-1.347121, -0.717372, 0.746096, -0.624072]],
    ("cps", 0.3, 1.0): [[0.442028, 0.645498, 1.001844, -0.612691], [-0.634787, -0.860096, 1.012003, -0.054744]],
}
GOLDEN_ATOL = 1e-4


def _golden_slice(latents: torch.Tensor) -> torch.Tensor:
    return latents[:, -1, 0, 3, 2:6]


@pytest.mark.parametrize("sampler,level,guidance", list(GOLDEN))
def test_final_latents_match_the_golden_slice(toy_engine, sampler, level, guidance):
    traj = toy_engine.generate(_requests(sampler=sampler, noise_level=level, steps=4, guidance_scale=guidance))
    expected = torch.tensor(GOLDEN[(sampler, level, guidance)], dtype=torch.float64)
    torch.testing.assert_close(_golden_slice(traj.latents).double(), expected, atol=GOLDEN_ATOL, rtol=0)


if __name__ == "__main__":
    from engine import load_model

    shipped = load_model("toy-digits")
    for sampler, level, guidance in GOLDEN:
        rollout = oracle_rollout(shipped, PROMPTS, SEEDS, 4, sampler, level, guidance)
        values = [[round(float(v), 6) for v in row] for row in _golden_slice(rollout["latents"])]
        print(f"    ({sampler!r}, {level}, {guidance}): {values},")
