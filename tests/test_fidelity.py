"""Fidelity to the released code (issue 23, item 5): each difference the audit found is matched or an option.

Each test pins the released code's behaviour with numbers worked out by hand
(or drawn with a fixed generator and checked against the formula), so the
recipe's earlier behaviour fails it.
"""

from types import SimpleNamespace

import pytest
import torch

from engine import Engine, GenerationRequest, PromptEmbeds
from engine.denoise import guided_velocity
from engine.sampling import flow_timesteps
from flywheel.rollout_collector import sample_seed
from trainers.awm import AWMConfig, awm_loss, draw_times
from trainers.dpo import DPOConfig, draw_times_and_noise, schedule_shift
from trainers.nft import NFTConfig, SamplingPolicy


# ---- a. AWM: the loss averages over every sample, flat groups included -------------------------


def test_awm_policy_term_keeps_the_released_weight_next_to_the_regularisers_with_flat_groups():
    """6 rows, 3 of them flat (A = 0, not usable): the code's mean over all 6 rows."""
    n = 6
    x0, noise = torch.zeros(n, 2), torch.zeros(n, 2)
    # v - (noise - x0) = v: the matching error l = mean(v^2); row i has v = [1, 1] -> l = 1.
    v = torch.ones(n, 2)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.0, 0.0, 0.0])
    usable = torch.tensor([True, True, True, False, False, False])
    v_ref = torch.zeros(n, 2)  # |v - v_ref|^2 = 1 per row
    loss, stats = awm_loss(v, x0, noise, 1.0, adv, v_ref, usable=usable, weighting="uniform", kl_beta=1.0)
    # policy: (1 - 1 + 2)·1 / 6 = 1/3 ; kl: 6·1 / 6 = 1
    assert float(stats["policy_loss"]) == pytest.approx(2 / 6, abs=1e-6)
    assert float(stats["ref_mse"]) == pytest.approx(1.0, abs=1e-6)
    assert float(loss) == pytest.approx(2 / 6 + 1.0, abs=1e-6)
    # The earlier average over usable rows: policy 2/3, kl 1 — the policy term N/N_usable = 2.0x stronger.
    loss_u, stats_u = awm_loss(v, x0, noise, 1.0, adv, v_ref, usable=usable, weighting="uniform", kl_beta=1.0,
                               average="usable")
    ratio = (float(stats_u["policy_loss"]) / float(stats_u["ref_mse"])) / (float(stats["policy_loss"]) / float(stats["ref_mse"]))
    assert ratio == pytest.approx(2.0, abs=1e-6)
    assert AWMConfig().loss_average == "all"


def test_awm_flat_row_with_a_stray_advantage_adds_no_policy_term():
    # An unusable row is out of the policy term whatever advantage it carries.
    v, x0, noise = torch.ones(2, 2), torch.zeros(2, 2), torch.zeros(2, 2)
    _, stats = awm_loss(v, x0, noise, 1.0, torch.tensor([1.0, 5.0]), usable=torch.tensor([True, False]),
                        weighting="uniform")
    assert float(stats["policy_loss"]) == pytest.approx(0.5, abs=1e-6)


# ---- b. shared initial noise per group (MixGRPO's --init_same_noise) ------------------------------


def test_noise_seed_shares_the_initial_noise_and_keeps_each_requests_step_noise(toy_model):
    engine = Engine(toy_model)
    base = dict(prompt="3", steps=4, sampler="sde", noise_level=0.7)
    own = engine.generate([GenerationRequest(seed=11, **base), GenerationRequest(seed=12, **base)])
    shared = engine.generate([GenerationRequest(seed=11, noise_seed=11, **base),
                              GenerationRequest(seed=12, noise_seed=11, **base)])
    # Both start from seed 11's noise ...
    assert torch.equal(shared.latents[0, 0], own.latents[0, 0])
    assert torch.equal(shared.latents[1, 0], own.latents[0, 0])
    assert not torch.equal(own.latents[1, 0], own.latents[0, 0])
    # ... the first request is unchanged bit for bit, and the second's SDE steps still differ from the first's.
    assert torch.equal(shared.latents[0], own.latents[0])
    assert not torch.equal(shared.latents[1, 1], shared.latents[0, 1])
    with pytest.raises(TypeError, match="noise_seed"):
        GenerationRequest(prompt="3", seed=1, noise_seed="a")


def test_flywheel_gives_each_group_its_first_rows_noise_seed():
    from flywheel.rollout_collector import Flywheel

    fly = SimpleNamespace(same_noise_per_group=True, seed=5, group_size=4)
    rows = [Flywheel._shared_noise(fly, 7, row)["noise_seed"] for row in range(8)]
    assert rows[:4] == [sample_seed(5, 7, 0)] * 4 and rows[4:] == [sample_seed(5, 7, 4)] * 4
    fly.same_noise_per_group = False
    assert Flywheel._shared_noise(fly, 7, 3) == {}


def test_same_noise_per_group_with_the_ode_is_refused():
    from flywheel.recipe.sections import check_shared_sections
    from trainers.grpo import Config

    cfg = Config()
    cfg.sampling.same_noise_per_group = True
    cfg.sampling.sampler = "ode"
    checks = check_shared_sections(cfg)
    with pytest.raises(Exception, match="same_noise_per_group=true with sampling.sampler=ode"):
        checks.raise_if_any()
    cfg.sampling.sampler = "sde"
    check_shared_sections(cfg).raise_if_any()


# ---- c. AWM's rollouts: the ODE default is a listed deviation --------------------------------------


def test_awm_lists_the_released_sa_solver_rollouts_among_its_deviations():
    import trainers.awm

    deviations = trainers.awm.__doc__.split("Deviations from that code")[1].split("In this recipe:")[0]
    assert "SA-Solver" in deviations and "0.4" in deviations


# ---- d. DPO's logit-normal times follow the schedule's shift ---------------------------------------


def test_schedule_shift_reads_the_shift_of_the_rollout_schedule():
    assert schedule_shift(flow_timesteps(10, 3.0)) == pytest.approx(3.0, rel=1e-5)
    assert schedule_shift(flow_timesteps(10, 1.0)) == pytest.approx(1.0, rel=1e-5)
    assert schedule_shift(flow_timesteps(7, 2.5)) == pytest.approx(2.5, rel=1e-5)


@pytest.mark.parametrize("shift, median", [(3.0, 0.75), (1.0, 0.5)])
def test_dpo_logit_normal_times_have_the_shifted_median(shift, median):
    # u = sigmoid(N(0, 1)) has median 1/2; under the shift s: s/2 / (1 + (s - 1)/2) = 0.75 for SD3.5's s = 3.
    traj = SimpleNamespace(timesteps=flow_timesteps(10, shift), latents=torch.zeros(1, 11, 1, 2, 2))
    times, _ = draw_times_and_noise(traj, 4000, DPOConfig(time_sampling="logit_normal", timesteps_per_pair=1),
                                    torch.Generator().manual_seed(0))
    assert float(times.median()) == pytest.approx(median, abs=0.01)
    # Each t is the shift of a logit-normal u: undoing it gives back a median-1/2 logit-normal.
    u = times / (shift - (shift - 1) * times)
    assert float(torch.logit(u.double()).std()) == pytest.approx(1.0, abs=0.05)


# ---- e. AWM's uniform times are drawn per row ------------------------------------------------------


def test_awm_uniform_times_are_per_row_and_schedule_times_per_minibatch():
    g = torch.Generator().manual_seed(3)
    uniform = draw_times(torch.linspace(1, 0, 11), AWMConfig(time_sampling="uniform", timesteps_per_sample=3), g,
                         rows=4)
    assert uniform.shape == (3, 4)
    assert len(set(uniform[0].tolist())) == 4  # the rows of a minibatch do not share a time
    schedule = draw_times(torch.linspace(1, 0, 11), AWMConfig(timesteps_per_sample=3), g, rows=4)
    assert schedule.shape == (3,)


def test_guided_velocity_takes_one_time_per_row_with_guidance():
    """Per-row times reach both CFG branches of a row: the batched forward equals row-by-row forwards."""
    seen = []

    def velocity(transformer, x, t, cond):
        t = torch.as_tensor(t).reshape(-1).expand(x.shape[0])
        seen.append(t.clone())
        return x * t.reshape(-1, 1) + cond.embeds

    model = SimpleNamespace(velocity=velocity)
    x = torch.tensor([[1.0], [2.0]])
    t = torch.tensor([0.25, 0.5])
    cond = PromptEmbeds(torch.tensor([[1.0], [3.0]]), None, None)
    uncond_cond = PromptEmbeds(torch.tensor([[0.0], [0.0], [1.0], [3.0]]), None, None)
    v = guided_velocity(model, None, x, t, cond, uncond_cond, 2.0)
    # row i: v_u = x·t, v_c = x·t + c, v = v_u + 2·(v_c - v_u) = x·t + 2c
    torch.testing.assert_close(v, torch.tensor([[0.25 + 2.0], [1.0 + 6.0]]))
    assert seen[-1].tolist() == [0.25, 0.5, 0.25, 0.5]


# ---- f. NFT's soft update: eta is the schedule's at the steps done ----------------------------------


def test_nft_first_soft_update_uses_the_released_codes_eta():
    trained = [("w", torch.nn.Parameter(torch.tensor([1.0])))]
    weights = {"w": torch.tensor([0.0])}
    sampling = SamplingPolicy(weights, policy=None, tc=NFTConfig())
    # The code's global_step is 1 when it soft-updates after the first optimizer step: eta = min(0.001·1, 0.5).
    assert sampling.follow(trained, step=0)["nft/eta"] == pytest.approx(0.001)
    assert float(weights["w"]) == pytest.approx(0.999)  # 0.001·0 + 0.999·1
    assert sampling.follow(trained, step=499)["nft/eta"] == pytest.approx(0.5)
