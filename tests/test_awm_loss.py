"""Advantage Weighted Matching (arXiv 2509.25050) against its formulas.

Golden values are worked out by hand on 2-row tensors (the arithmetic is
written out in each test); the update is compared with plain SGD on a loss
written here from the formulas (x_t = (1 - t)·x0 + t·eps, error against
eps - x0, A·w(l, t), velocity MSEs to the reference and to the EMA anchor),
using the recipe's own draws of t and eps, which the recipe draws from a
generator seeded by (seed, step, rank).
"""

import copy
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from engine import Engine, GenerationRequest, PromptEmbeds, load_model
from engine.denoise import guided_velocity
from flywheel.rollout_collector import RolloutBatch
from flywheel.recipe.policy import Policy
from flywheel.recipe.sections import AdvantageConfig
from trainers.awm import (AWM, AWMConfig, EMAAnchor, awm_loss, draw_generator, draw_minibatch, draw_times,
                          schedule_strata, weighted_error)

D = 1e-10  # the weightings' delta, written out again here

# ---- the 2-row case -----------------------------------------------------------------------
# row 0: v = [1, 2], x0 = [0, 1], eps = [1, 0]  -> target eps - x0 = [1, -1], v - target = [0, 3],  l0 = 9/2 = 4.5
# row 1: v = [0, 0], x0 = [1, 1], eps = [2, -1] -> target [1, -2],            v - target = [-1, 2], l1 = 5/2 = 2.5
V = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
X0 = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
EPS = torch.tensor([[1.0, 0.0], [2.0, -1.0]])
T = torch.tensor([0.5, 0.25])
ADV = torch.tensor([2.0, -1.0])
# v_ref: row 0 [1, 0] -> (v - v_ref)^2 = [0, 4], mean 2; row 1 [1, 1] -> [1, 1], mean 1
V_REF = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
# v_anchor: row 0 [0, 2] -> [1, 0], mean 0.5; row 1 [0, 3] -> [0, 9], mean 4.5
V_ANCHOR = torch.tensor([[0.0, 2.0], [0.0, 3.0]])


def loss_of(weighting="uniform", **kw):
    return awm_loss(V, X0, EPS, T, ADV, weighting=weighting, **kw)


def test_uniform_weighting_is_the_advantage_weighted_flow_matching_loss():
    loss, stats = loss_of("uniform")
    # (A0·l0 + A1·l1) / 2 = (2·4.5 - 1·2.5) / 2 = 3.25
    assert float(loss) == pytest.approx(3.25, abs=1e-6)
    assert float(stats["matching_error"]) == pytest.approx((4.5 + 2.5) / 2, abs=1e-6)
    assert float(stats["matching_error/positive"]) == pytest.approx(4.5, abs=1e-6)
    assert float(stats["matching_error/negative"]) == pytest.approx(2.5, abs=1e-6)
    assert not {"kl", "ref_mse", "anchor_kl", "anchor_mse"} & set(stats)  # no reference, no anchor: nothing measured, nothing logged


@pytest.mark.parametrize("weighting, expected", [
    ("t", (2 * 0.5 * 4.5 - 1 * 0.25 * 2.5) / 2),                    # 1.9375
    ("t2", (2 * 0.25 * 4.5 - 1 * 0.0625 * 2.5) / 2),                # 1.046875
    ("huber", (2 * 0.5 * (math.sqrt(4.5 + D) - math.sqrt(D))
               - 1 * 0.25 * (math.sqrt(2.5 + D) - math.sqrt(D))) / 2),
    ("ghuber", (2 * 0.5 / 0.25 * ((4.5 + D) ** 0.25 - D**0.25)
                - 1 * 0.25 / 0.25 * ((2.5 + D) ** 0.25 - D**0.25)) / 2),
])
def test_each_weighting_against_its_formula(weighting, expected):
    loss, _ = loss_of(weighting, ghuber_power=0.25)
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_ghuber_power_one_is_the_t_weighting_and_power_half_twice_huber():
    errors = torch.tensor([4.5, 2.5, 0.0])
    t = torch.tensor([0.5, 0.25, 0.75])
    # p = 1: t·((l + d) - d) = t·l; p = 1/2: t/(1/2)·(sqrt(l + d) - sqrt(d)) = 2·huber
    torch.testing.assert_close(weighted_error(errors, t, "ghuber", 1.0), t * errors)
    torch.testing.assert_close(weighted_error(errors, t, "ghuber", 0.5), 2 * weighted_error(errors, t, "huber"))
    assert float(weighted_error(errors, t, "ghuber", 0.25)[2]) == 0.0  # no error, no loss
    with pytest.raises(ValueError, match="uniform, t, t2, huber, ghuber"):
        weighted_error(errors, t, "elbo")


def test_gradient_pulls_positive_samples_to_their_target_and_pushes_negative_ones_away():
    """dL/dv = A·2(v - target)/(D·N), D = N = 2, for the uniform weighting: (2·2·[0, 3]/4, -1·2·[-1, 2]/4)."""
    v = V.clone().requires_grad_(True)
    loss, _ = awm_loss(v, X0, EPS, T, ADV, weighting="uniform")
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 3.0], [0.5, -1.0]]))
    # With the t weighting each row's gradient is scaled by its t as well.
    v = V.clone().requires_grad_(True)
    awm_loss(v, X0, EPS, T, ADV, weighting="t")[0].backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 3.0 * 0.5], [0.5 * 0.25, -1.0 * 0.25]]))


def test_regularisers_are_velocity_mses_with_their_betas():
    loss, stats = loss_of("uniform", v_ref=V_REF, kl_beta=0.1, v_anchor=V_ANCHOR, anchor_beta=0.5)
    # kl = (2 + 1)/2 = 1.5, anchor = (0.5 + 4.5)/2 = 2.5; 3.25 + 0.1·1.5 + 0.5·2.5 = 4.65
    assert float(stats["ref_mse"]) == pytest.approx(1.5, abs=1e-6)
    assert float(stats["anchor_mse"]) == pytest.approx(2.5, abs=1e-6)
    assert float(stats["policy_loss"]) == pytest.approx(3.25, abs=1e-6)
    assert float(loss) == pytest.approx(4.65, abs=1e-6)
    # Measured but not added when its beta is 0.
    loss, stats = loss_of("uniform", v_ref=V_REF, kl_beta=0.0)
    assert float(loss) == pytest.approx(3.25, abs=1e-6) and float(stats["ref_mse"]) == pytest.approx(1.5, abs=1e-6)


def test_zero_advantages_leave_only_the_regulariser():
    v = V.clone().requires_grad_(True)
    loss, stats = awm_loss(v, X0, EPS, T, torch.zeros(2), V_REF, weighting="ghuber", kl_beta=0.1)
    assert float(stats["policy_loss"]) == 0.0
    assert float(loss.detach()) == pytest.approx(0.1 * 1.5, abs=1e-7)
    loss.backward()
    # d(0.1·mean_rows mean_elems (v - v_ref)^2)/dv = 0.1·2(v - v_ref)/(2·2)
    torch.testing.assert_close(v.grad, 0.1 * 2 * (V - V_REF) / 4)


def test_usable_average_counts_only_usable_rows():
    usable = torch.tensor([True, False])
    loss, stats = loss_of("uniform", usable=usable, v_ref=V_REF, kl_beta=1.0, average="usable")
    # Row 0 alone: 2·4.5 + 1·2 = 11
    assert float(loss) == pytest.approx(11.0, abs=1e-6)
    assert float(stats["matching_error/negative"]) == 0.0  # the negative row is not usable
    loss, _ = loss_of("uniform", usable=torch.tensor([False, False]), v_ref=V_REF, kl_beta=1.0, average="usable")
    assert float(loss) == 0.0


def test_default_average_is_over_every_row_as_the_released_code():
    usable = torch.tensor([True, False])
    loss, stats = loss_of("uniform", usable=usable, v_ref=V_REF, kl_beta=1.0)
    # (row 0: 2·4.5 + 1·2, row 1: no policy term (not usable) + 1·1) / 2 = 6
    assert float(loss) == pytest.approx(6.0, abs=1e-6)
    assert float(stats["policy_loss"]) == pytest.approx(4.5, abs=1e-6)
    # No usable row: the regularisers alone, over both rows.
    loss, _ = loss_of("uniform", usable=torch.tensor([False, False]), v_ref=V_REF, kl_beta=1.0)
    assert float(loss) == pytest.approx(1.5, abs=1e-6)
    with pytest.raises(ValueError, match="all or usable"):
        loss_of("uniform", average="rows")


def test_scalar_time_broadcasts_over_rows():
    loss, _ = awm_loss(V, X0, EPS, torch.tensor(0.5), ADV, weighting="t")
    assert float(loss) == pytest.approx((2 * 0.5 * 4.5 - 1 * 0.5 * 2.5) / 2, abs=1e-6)


# ---- flow times ---------------------------------------------------------------------------


def test_schedule_strata_match_the_papers_discrete_sampling():
    # The code's 14-step SD3.5 runs: floor(linspace(1, int(0.9·14) = 12, 7)) = [1, 2, 4, 6, 8, 10, 12]
    # (linspace = 1, 2.83, 4.67, 6.5, 8.33, 10.17, 12).
    assert schedule_strata(14, 6, 0.9, True) == [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    # 10 steps: [1, 9) in 6 parts, cut at 1 + floor(8i/6) = 1, 2, 3, 5, 6, 7, 9.
    assert schedule_strata(10, 6, 0.9, True) == [(1, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 9)]
    # With the first step: [0, 9) in 3 parts.
    assert schedule_strata(10, 3, 0.9, False) == [(0, 3), (3, 6), (6, 9)]
    with pytest.raises(ValueError, match="timesteps_per_sample=6 needs at least 6 eligible steps.*has 2"):
        schedule_strata(4, 6, 0.9, True)


def test_schedule_times_come_one_from_each_stratum():
    timesteps = torch.linspace(1.0, 0.0, 11)
    tc = AWMConfig(timesteps_per_sample=6)
    seen = set()
    for seed in range(40):
        times = draw_times(timesteps, tc, torch.Generator().manual_seed(seed))
        index = [round(float(t) * -10 + 10) for t in times]  # t = 1 - i/10
        for i, (lo, hi) in zip(index, schedule_strata(10, 6, 0.9, True)):
            assert lo <= i < hi
        seen.update(index)
    assert seen == set(range(1, 9))  # every eligible step is drawn sometimes; 0 (t = 1) and 9 never


def test_uniform_times_are_stratified_per_row_then_shifted():
    tc = AWMConfig(timesteps_per_sample=4, time_sampling="uniform", uniform_t_min=0.2, time_shift=3.0)
    times = draw_times(torch.linspace(1, 0, 11), tc, torch.Generator().manual_seed(0), rows=5).double()
    assert times.shape == (4, 5)
    # Undo s·t / (1 + (s - 1)·t): t = t' / (s - (s - 1)·t'); each row has one t in each [0.2 + 0.2k, 0.2 + 0.2(k + 1)).
    unshifted = times / (3.0 - 2.0 * times)
    for row in unshifted.T.tolist():
        strata = sorted(int((t - 0.2) / 0.2 + 1e-9) for t in row)
        assert strata == [0, 1, 2, 3], row
    # The rows draw their own times, in orders of their own (the code's per-row draw and shuffle).
    assert len({tuple(r) for r in unshifted.T.tolist()}) == 5
    orders = {tuple(int((t - 0.2) / 0.2 + 1e-9) for t in row) for row in unshifted.T.tolist()}
    assert len(orders) > 1


def test_draws_depend_only_on_seed_step_and_rank():
    tc = AWMConfig(timesteps_per_sample=3)
    timesteps = torch.linspace(1, 0, 11)

    def draw(seed, step, rank):
        return draw_minibatch(timesteps, 2, (1, 8, 8), tc, draw_generator(seed, step, rank))

    a, b = draw(0, 5, 0), draw(0, 5, 0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for other in (draw(1, 5, 0), draw(0, 6, 0), draw(0, 5, 1)):
        assert not torch.equal(a[1], other[1])
    assert a[1].shape == (3, 2, 1, 8, 8)


# ---- the EMA anchor -----------------------------------------------------------------------


def test_ema_anchor_update_decay_and_swap():
    layer = torch.nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0]]))
        layer.bias.fill_(0.5)
    named = list(layer.named_parameters())
    anchor = EMAAnchor(named)
    tc = AWMConfig(anchor_decay=0.3, anchor_decay_ramp=0.001)
    assert EMAAnchor.decay(0, tc) == 0.0 and EMAAnchor.decay(100, tc) == pytest.approx(0.1)
    assert EMAAnchor.decay(1000, tc) == 0.3
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[3.0, -2.0]]))
    anchor.update(named, 0.25)  # 0.25·[1, 2] + 0.75·[3, -2] = [2.5, -1]
    torch.testing.assert_close(anchor.shadow["weight"], torch.tensor([[2.5, -1.0]]))
    torch.testing.assert_close(anchor.shadow["bias"], torch.tensor([0.5]))
    # The anchor's velocity runs the trained module with the EMA values, then leaves the trained ones in place.
    model = SimpleNamespace(transformer=layer, velocity=lambda transformer, x, t, cond: transformer(x))
    policy = Policy(model, named, None, {})
    v = anchor.velocity(policy, torch.tensor([[1.0, 1.0]]), 0.5, None, None, 1.0)
    assert float(v) == pytest.approx(2.5 - 1.0 + 0.5) and not v.requires_grad
    assert torch.equal(layer.weight, torch.tensor([[3.0, -2.0]])) and layer.weight.requires_grad
    assert torch.equal(layer.bias, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="names differ"):
        anchor.load_state_dict({"weight": torch.zeros(1, 2)})
    with pytest.raises(ValueError, match="shape"):
        anchor.load_state_dict({"weight": torch.zeros(2, 2), "bias": torch.zeros(1)})


# ---- the update on the toy model ----------------------------------------------------------

ROWS, STEPS, LR = 8, 10, 0.5
TOY_ADV = torch.tensor([1.0, -0.5, 0.0, 0.8, -1.2, 0.7, 0.3, -0.9])
TOY_USABLE = torch.tensor([True, True, False, True, True, True, True, True])


@dataclass
class TrainSection(AWMConfig):
    """The recipe's train section with the test's minibatches and no clipping: the oracle is plain SGD."""

    minibatch_size: int = 4
    max_grad_norm: float = 1e9


@dataclass
class RecipeConfig:
    seed: int = 0
    train: TrainSection = field(default_factory=TrainSection)
    advantage: AdvantageConfig = field(default_factory=lambda: AdvantageConfig(global_std=True))


@pytest.fixture(scope="module")
def toy():
    model = load_model("toy-digits")
    prompts = ["a handwritten three", "the digit seven"]
    requests = [GenerationRequest(prompt=prompts[i // 4], seed=200 + i, steps=STEPS, sampler="ode")
                for i in range(ROWS)]
    traj = Engine(model).generate(requests)
    return model, traj, copy.deepcopy(model.transformer.state_dict())


def run_update(model, traj, cfg, reference=None, anchor=None, step=0, advantages=TOY_ADV, usable=TOY_USABLE, lr=LR):
    transformer = model.transformer

    def reference_velocity(x, t, cond, uncond_cond, g):
        return guided_velocity(model, reference, x, t, cond, uncond_cond, g)

    policy = Policy(model, list(transformer.named_parameters()), None if reference is None else reference_velocity, {})
    batch = RolloutBatch(traj, None, advantages.clone(), usable.clone(), torch.arange(ROWS) // 4)
    awm = AWM(policy, torch.optim.SGD(transformer.parameters(), lr=lr), transformer, cfg, Accelerator(cpu=True))
    awm.anchor = anchor  # the test's own (or none)
    return awm.update(batch, step).metrics


def oracle_update(model, reference, anchor_model, traj, cfg, step):
    """SGD on the loss written from the formulas, with the recipe's draws (same generator, same order)."""
    tc = cfg.train
    transformer = model.transformer
    opt = torch.optim.SGD(transformer.parameters(), lr=LR)
    generator = draw_generator(cfg.seed, step, 0)
    x0_all = traj.latents[:, -1]
    scale = tc.advantage_max / cfg.advantage.clip_max
    for start in range(0, ROWS, tc.minibatch_size):
        rows = list(range(start, start + tc.minibatch_size))
        cond = PromptEmbeds(traj.prompt_embeds[rows], traj.pooled_prompt_embeds[rows],
                            None if traj.prompt_mask is None else traj.prompt_mask[rows])
        times, noise = draw_minibatch(traj.timesteps, len(rows), tuple(x0_all.shape[1:]), tc, generator)
        x0, adv, usable = x0_all[rows], TOY_ADV[rows] * scale, TOY_USABLE[rows].float()
        for i in range(tc.timesteps_per_sample):
            t, eps = float(times[i]), noise[i]
            x_t = (1 - t) * x0 + t * eps
            v = model.velocity(transformer, x_t, t, cond)
            err = ((v - (eps - x0)) ** 2).flatten(1).mean(1)
            p = tc.ghuber_power
            w = t / p * ((err + D) ** p - D**p)
            with torch.no_grad():
                v_ref = model.velocity(reference, x_t, t, cond)
                v_anchor = model.velocity(anchor_model, x_t, t, cond)
            kl = ((v - v_ref) ** 2).flatten(1).mean(1)
            anchor_kl = ((v - v_anchor) ** 2).flatten(1).mean(1)
            per_row = adv * w + tc.kl_beta * kl + tc.anchor_beta * anchor_kl
            # An unusable row has no policy term; the mean is over every row (the code's) or the usable ones.
            per_row = usable * adv * w + tc.kl_beta * kl + tc.anchor_beta * anchor_kl
            loss = (per_row.mean() if tc.loss_average == "all" else (per_row * usable).sum() / usable.sum())
            (loss / tc.timesteps_per_sample).backward()
        opt.step()
        opt.zero_grad()


def test_awm_update_equals_sgd_on_the_hand_written_loss(toy):
    model, traj, start = toy
    model.transformer.load_state_dict(start)
    cfg = RecipeConfig(seed=3)
    cfg.train.timesteps_per_sample = 3
    cfg.train.kl_beta = 0.5
    cfg.train.anchor_beta = 0.7
    reference = copy.deepcopy(model.transformer).requires_grad_(False)
    with torch.no_grad():  # a policy that has left the reference, so the KL term has a gradient
        for p in model.transformer.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    moved = copy.deepcopy(model.transformer.state_dict())
    anchor = EMAAnchor(list(model.transformer.named_parameters()))
    anchor_model = copy.deepcopy(model.transformer).requires_grad_(False)  # the anchor holds the start weights

    metrics = run_update(model, traj, cfg, reference=reference, anchor=anchor, step=4)
    after_recipe = copy.deepcopy(model.transformer.state_dict())

    model.transformer.load_state_dict(moved)
    oracle_update(model, reference, anchor_model, traj, cfg, step=4)
    for name, value in model.transformer.state_dict().items():
        torch.testing.assert_close(after_recipe[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert metrics["train/optimizer_steps"] == 2  # minibatch 4 of 8 rows: two optimizer steps
    assert metrics["ref_mse"] > 0 and metrics["anchor_mse"] > 0 and metrics["grad_norm"] > 0
    # The anchor moved once, with decay min(0.3, 0.001·5) = 0.005, toward the weights after the update.
    assert metrics["anchor/decay"] == pytest.approx(0.005)
    for name, p in model.transformer.named_parameters():
        expected = 0.005 * moved[name] + 0.995 * after_recipe[name]
        torch.testing.assert_close(anchor.shadow[name], expected, rtol=1e-5, atol=1e-7)


def test_awm_update_is_deterministic_finite_and_moves_the_weights(toy):
    model, traj, start = toy
    cfg = RecipeConfig()
    cfg.train.minibatch_size = 8
    cfg.train.timesteps_per_sample = 2
    results = []
    for step in (7, 7, 8):
        model.transformer.load_state_dict(start)
        metrics = run_update(model, traj, cfg, step=step)
        assert all(math.isfinite(v) for v in metrics.values())
        results.append(copy.deepcopy(model.transformer.state_dict()))
    assert any(not torch.equal(results[0][k], start[k]) for k in start)
    assert all(torch.equal(results[0][k], results[1][k]) for k in start)  # same seed and step: same weights
    assert any(not torch.equal(results[0][k], results[2][k]) for k in start)  # another step draws other t, eps


def test_no_usable_sample_leaves_the_weights_where_they_were(toy):
    model, traj, start = toy
    model.transformer.load_state_dict(start)
    cfg = RecipeConfig()
    cfg.train.timesteps_per_sample = 2
    reference = copy.deepcopy(model.transformer).requires_grad_(False)
    run_update(model, traj, cfg, reference=reference, usable=torch.zeros(ROWS, dtype=torch.bool))
    assert all(torch.equal(v, start[k]) for k, v in model.transformer.state_dict().items())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_positive_advantages_lower_the_matching_error_and_negative_ones_raise_it(toy, sign):
    """The training signal end to end: at the same (t, eps), A > 0 fits the samples better after one update."""
    model, traj, start = toy
    model.transformer.load_state_dict(start)
    cfg = RecipeConfig()
    cfg.train.minibatch_size = 8
    cfg.train.timesteps_per_sample = 2
    cfg.train.weighting = "uniform"

    def error():
        tc = cfg.train
        times, noise = draw_minibatch(traj.timesteps, ROWS, (1, 8, 8), tc, draw_generator(0, 0, 0))
        x0 = traj.latents[:, -1]
        cond = PromptEmbeds(traj.prompt_embeds, traj.pooled_prompt_embeds, traj.prompt_mask)
        with torch.no_grad():
            return sum(float(((model.velocity(model.transformer, (1 - t) * x0 + t * e, t, cond) - (e - x0)) ** 2)
                             .mean()) for t, e in zip(times.tolist(), noise))

    before = error()
    # A small step: SGD at the oracle's 0.5 overshoots the minimum of a 243k-weight DiT's error.
    run_update(model, traj, cfg, advantages=torch.full((ROWS,), 5 * sign), usable=torch.ones(ROWS, dtype=torch.bool),
               lr=0.01)
    after = error()
    assert (after - before) * sign < 0, (before, after)
