"""Online Diffusion-DPO (arXiv 2311.12908, Eq. 14 in the rectified-flow form) against its formulas.

Golden values are worked out by hand on 2-pair, 2-element tensors (the
arithmetic is written beside each); the pairing rules on small reward lists;
the update is compared with plain SGD on a loss written here from the formulas
(x_t = (1 - t)·x0 + t·eps with one t and eps per pair, errors against eps - x0,
-log sigmoid(-beta·Delta)), with pairs picked by hand and the recipe's own draws.
"""

import copy
import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from engine import Engine, GenerationRequest, PromptEmbeds, load_model
from flywheel.rollout_collector import RolloutBatch
from flywheel.recipe.policy import Policy
from flywheel.recipe.update import update_generator
from trainers.dpo import ANCHOR_STREAM, DPO, DRAW_STREAM, DPOConfig, dpo_loss, draw_times_and_noise, preference_pairs

# ---- the 2-pair case ------------------------------------------------------------------------
# pair 0: x0_w = [0, 1], x0_l = [1, 0], eps = [1, 1]  -> u_w = eps - x0_w = [1, 0], u_l = [0, 1]
#   v_w = [1, 0]: e_w = 0;        v_ref_w = [0, 0]: ref_w = (1 + 0)/2 = 0.5
#   v_l = [0, 0]: e_l = 1/2;      v_ref_l = [0, 1]: ref_l = 0
#   Delta = (0 - 0.5) - (0.5 - 0) = -1
# pair 1: x0_w = [2, 0], x0_l = [0, 0], eps = [0, 2]  -> u_w = [-2, 2], u_l = [0, 2]
#   v_w = [0, 0]: e_w = (4 + 4)/2 = 4;   v_ref_w = [-2, 0]: ref_w = (0 + 4)/2 = 2
#   v_l = [0, 2]: e_l = 0;               v_ref_l = [0, 0]: ref_l = (0 + 4)/2 = 2
#   Delta = (4 - 2) - (0 - 2) = 4
V_W = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
V_L = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
REF_W = torch.tensor([[0.0, 0.0], [-2.0, 0.0]])
REF_L = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
X0_W = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
X0_L = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
EPS = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
BETA = 2.0
# -log sigmoid(m) = log(1 + e^-m): margin m = -beta·Delta = 2 (pair 0) and -8 (pair 1)
LOSS_0 = math.log(1 + math.exp(-2.0))  # 0.126928...
LOSS_1 = math.log(1 + math.exp(8.0))   # 8.000335...


def loss_of(**kw):
    return dpo_loss(V_W, V_L, REF_W, REF_L, X0_W, X0_L, EPS, BETA, **kw)


def test_loss_is_the_mean_over_pairs_of_minus_log_sigmoid_of_the_implicit_margin():
    loss, stats = loss_of()
    assert float(loss) == pytest.approx((LOSS_0 + LOSS_1) / 2, rel=1e-6)  # 4.0636317...
    assert float(stats["dpo/implicit_margin"]) == pytest.approx((2.0 - 8.0) / 2, abs=1e-6)
    assert float(stats["dpo/implicit_acc"]) == pytest.approx(0.5)  # pair 0 is right (m = 2 > 0), pair 1 wrong
    assert float(stats["dpo/error_w"]) == pytest.approx((0 + 4) / 2, abs=1e-6)
    assert float(stats["dpo/error_l"]) == pytest.approx((0.5 + 0) / 2, abs=1e-6)
    assert float(stats["dpo/ref_error_w"]) == pytest.approx((0.5 + 2) / 2, abs=1e-6)
    assert float(stats["dpo/ref_error_l"]) == pytest.approx((0 + 2) / 2, abs=1e-6)
    # kl: mean over both rows of |v - v_ref|^2: pair 0 (w: [1, 0] -> 0.5, l: [0, -1] -> 0.5) = 0.5,
    # pair 1 (w: [2, 0] -> 2, l: [0, 2] -> 2) = 2; mean 1.25
    assert float(stats["ref_mse"]) == pytest.approx(1.25, abs=1e-6)


def test_kl_beta_adds_the_weighted_velocity_mse_to_the_reference_and_its_gradient():
    """loss = DPO + kl_beta·sum_p w_p·(mean|v_w - ref_w|^2 + mean|v_l - ref_l|^2)/2: per-pair MSEs 0.5 and 2 (above)."""
    loss, stats = loss_of(kl_beta=0.1)
    assert float(loss) == pytest.approx((LOSS_0 + LOSS_1) / 2 + 0.1 * 1.25, rel=1e-6)
    assert float(stats["ref_mse"]) == pytest.approx(1.25, abs=1e-6)  # logged as before, without the weight
    loss, _ = loss_of(kl_beta=0.1, weight=torch.tensor([0.25, 0.75]))
    assert float(loss) == pytest.approx(0.25 * LOSS_0 + 0.75 * LOSS_1 + 0.1 * (0.25 * 0.5 + 0.75 * 2.0), rel=1e-6)
    # The KL's own gradient: d/dv_w of kl_beta·w_p·mean|v_w - ref_w|^2/2 = kl_beta·w_p·(v_w - ref_w)/D, D = 2.
    grads = []
    for kl_beta in (0.0, 0.1):
        v_w = V_W.clone().requires_grad_(True)
        dpo_loss(v_w, V_L, REF_W, REF_L, X0_W, X0_L, EPS, BETA, kl_beta=kl_beta)[0].backward()
        grads.append(v_w.grad)
    torch.testing.assert_close(grads[1] - grads[0], 0.1 * 0.5 * (V_W - REF_W) / 2)


def test_pair_weights_select_and_weigh_pairs():
    loss, stats = loss_of(weight=torch.tensor([1.0, 0.0]))
    assert float(loss) == pytest.approx(LOSS_0, rel=1e-6)
    assert float(stats["dpo/implicit_acc"]) == 1.0
    loss, _ = loss_of(weight=torch.tensor([0.25, 0.75]))
    assert float(loss) == pytest.approx(0.25 * LOSS_0 + 0.75 * LOSS_1, rel=1e-6)


def test_beta_scales_the_margin_inside_the_sigmoid():
    loss, stats = dpo_loss(V_W, V_L, REF_W, REF_L, X0_W, X0_L, EPS, 0.5)
    # m = -0.5·Delta = 0.5 and -2
    assert float(loss) == pytest.approx((math.log(1 + math.exp(-0.5)) + math.log(1 + math.exp(2.0))) / 2, rel=1e-6)
    assert float(stats["dpo/implicit_margin"]) == pytest.approx(-0.75, abs=1e-6)


def test_gradient_pulls_toward_the_winners_target_and_away_from_the_losers():
    """dL/dDelta = beta·sigmoid(beta·Delta)/P; dDelta/dv_w = 2(v_w - u_w)/D, dDelta/dv_l = -2(v_l - u_l)/D, D = 2."""
    v_w, v_l = V_W.clone().requires_grad_(True), V_L.clone().requires_grad_(True)
    dpo_loss(v_w, v_l, REF_W, REF_L, X0_W, X0_L, EPS, BETA)[0].backward()
    s0, s1 = 1 / (1 + math.exp(2.0)), 1 / (1 + math.exp(-8.0))  # sigmoid(beta·Delta) = sigmoid(-2), sigmoid(8)
    # pair 0: v_w - u_w = [0, 0]; v_l - u_l = [0, -1] -> grad_l = 2·s0/2 · -[0, -1] = [0, s0]
    # pair 1: v_w - u_w = [2, -2] -> grad_w = 2·s1/2 · [2, -2]; v_l - u_l = [0, 0]
    torch.testing.assert_close(v_w.grad, torch.tensor([[0.0, 0.0], [2 * s1, -2 * s1]]))
    torch.testing.assert_close(v_l.grad, torch.tensor([[0.0, s0], [0.0, 0.0]]))


def test_at_the_reference_the_loss_is_log_two_and_no_pair_is_counted_right():
    loss, stats = dpo_loss(V_W, V_L, V_W, V_L, X0_W, X0_L, EPS, BETA)
    assert float(loss) == pytest.approx(math.log(2.0), rel=1e-6)
    assert float(stats["dpo/implicit_acc"]) == 0.0 and float(stats["ref_mse"]) == 0.0
    # No gradient flows into the reference's velocities.
    ref_w = V_W.clone().requires_grad_(True)
    dpo_loss(V_W.clone().requires_grad_(True), V_L, ref_w, V_L, X0_W, X0_L, EPS, BETA)[0].backward()
    assert ref_w.grad is None


# ---- pairs ----------------------------------------------------------------------------------

GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2])
REWARDS = torch.tensor([0.2, 0.9, 0.5, 0.9, 0.4, 0.4, 0.4, 0.1, 0.7, 0.95])
VALID = torch.tensor([True, True, True, True, True, True, True, True, True, False])


def as_list(pairs):
    return list(zip(pairs.winners.tolist(), pairs.losers.tolist()))


def test_best_worst_takes_one_pair_per_group_and_skips_flat_groups_and_masked_rows():
    pairs = preference_pairs(REWARDS, VALID, GROUPS, "best_worst")
    # group 0: best 0.9 (rows 1 and 3: the first), worst row 0; group 1: all 0.4, no pair;
    # group 2: row 9 (0.95) is masked, so best row 8 (0.7), worst row 7 (0.1).
    assert as_list(pairs) == [(1, 0), (8, 7)]
    torch.testing.assert_close(pairs.reward_gap, torch.tensor([0.7, 0.6]))
    assert (pairs.groups_used, pairs.groups) == (2, 3)


def test_all_pairs_takes_every_strict_preference_above_the_margin():
    pairs = preference_pairs(REWARDS, VALID, GROUPS, "all_pairs")
    # group 0 (0.2, 0.9, 0.5, 0.9): 1>0, 1>2, 2>0, 3>0, 3>2 (1 and 3 tie: no pair); group 2: 8>7.
    assert as_list(pairs) == [(1, 0), (1, 2), (2, 0), (3, 0), (3, 2), (8, 7)]
    wide = preference_pairs(REWARDS, VALID, GROUPS, "all_pairs", margin=0.35)
    # gaps: 1-0 0.7, 1-2 0.4, 2-0 0.3, 3-0 0.7, 3-2 0.4, 8-7 0.6 -> 2-0 drops out
    assert as_list(wide) == [(1, 0), (1, 2), (3, 0), (3, 2), (8, 7)]
    assert as_list(preference_pairs(REWARDS, VALID, GROUPS, "all_pairs", margin=0.65)) == [(1, 0), (3, 0)]
    assert preference_pairs(REWARDS, VALID, GROUPS, "all_pairs", margin=0.65).groups_used == 1


def test_best_worst_needs_a_gap_above_the_margin_and_unknown_pairings_are_refused():
    assert as_list(preference_pairs(REWARDS, VALID, GROUPS, "best_worst", margin=0.65)) == [(1, 0)]
    none = preference_pairs(torch.ones(4), torch.ones(4, dtype=torch.bool), torch.tensor([0, 0, 1, 1]), "best_worst")
    assert len(none) == 0 and none.groups_used == 0 and none.groups == 2
    with pytest.raises(ValueError, match="valid pairings are best_worst, all_pairs"):
        preference_pairs(REWARDS, VALID, GROUPS, "top_k")


# ---- flow times and noise -------------------------------------------------------------------


def test_rollout_grid_times_come_from_the_schedule_and_the_draws_repeat():
    traj = SimpleNamespace(timesteps=torch.linspace(1.0, 0.0, 11), latents=torch.zeros(4, 11, 1, 8, 8))
    tc = DPOConfig(timesteps_per_pair=3)
    times, noise = draw_times_and_noise(traj, 50, tc, update_generator(0, 4, 0, DRAW_STREAM))
    assert times.shape == (50, 3) and noise.shape == (50, 3, 1, 8, 8)
    grid = {round(0.1 * i, 4) for i in range(1, 11)}  # t = 1, 0.9, ..., 0.1 (never the clean t = 0)
    drawn = {round(float(t), 4) for t in times.flatten()}
    assert drawn <= grid and len(drawn) >= 8
    again = draw_times_and_noise(traj, 50, tc, update_generator(0, 4, 0, DRAW_STREAM))
    assert torch.equal(times, again[0]) and torch.equal(noise, again[1])
    other = draw_times_and_noise(traj, 50, tc, update_generator(0, 5, 0, DRAW_STREAM))
    assert not torch.equal(noise, other[1])


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
def test_continuous_times_lie_in_the_open_unit_interval(sampling):
    traj = SimpleNamespace(timesteps=torch.linspace(1.0, 0.0, 11), latents=torch.zeros(2, 11, 1, 8, 8))
    times, _ = draw_times_and_noise(traj, 2000, DPOConfig(time_sampling=sampling, timesteps_per_pair=1),
                                    torch.Generator().manual_seed(0))
    assert 0 < float(times.min()) and float(times.max()) < 1
    assert float(times.mean()) == pytest.approx(0.5, abs=0.02)
    # logit-normal piles up in the middle: a smaller spread than U(0, 1)'s std 0.289
    assert (float(times.std()) < 0.25) == (sampling == "logit_normal")


# ---- the update on the toy model ------------------------------------------------------------

ROWS, STEPS, LR = 8, 10, 0.05
# group 0 = rows 0-3, group 1 = rows 4-7; best/worst by hand: (1, 0) and (6, 5)
TOY_REWARDS = torch.tensor([0.1, 0.9, 0.4, 0.6, 0.3, 0.2, 0.8, 0.5])
HAND_PAIRS = [(1, 0), (6, 5)]


@dataclass
class TrainSection(DPOConfig):
    """The recipe's train section with one pair per minibatch, no clipping and the paper's loss alone: kl_beta 0,
    with kl_rows left at its default "all", turns the recipe's velocity pull off. The oracle is plain SGD."""

    kl_beta: float = 0.0
    minibatch_size: int = 1
    max_grad_norm: float = 1e9
    timesteps_per_pair: int = 2
    beta: float = 20.0


@dataclass
class RecipeConfig:
    seed: int = 0
    train: TrainSection = field(default_factory=TrainSection)


@pytest.fixture(scope="module")
def toy():
    model = load_model("toy-digits")
    prompts = ["a handwritten three", "the digit seven"]
    requests = [GenerationRequest(prompt=prompts[i // 4], seed=300 + i, steps=STEPS, sampler="ode")
                for i in range(ROWS)]
    traj = Engine(model).generate(requests)
    reference = copy.deepcopy(model.transformer).requires_grad_(False)
    with torch.no_grad():  # a policy that has left the reference, so Delta is not 0
        for p in model.transformer.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model, traj, reference, copy.deepcopy(model.transformer.state_dict())


def row_cond(traj, row: int) -> PromptEmbeds:
    return PromptEmbeds(traj.prompt_embeds[[row]], traj.pooled_prompt_embeds[[row]],
                        None if traj.prompt_mask is None else traj.prompt_mask[[row]])


def run_update(model, traj, reference, cfg, step=0, rewards=TOY_REWARDS, lr=LR):
    transformer = model.transformer
    policy = Policy(model, list(transformer.named_parameters()),
                    lambda x, t, cond, uncond_cond=None, g=1.0: model.velocity(reference, x, t, cond), {})
    scored = SimpleNamespace(total=rewards.clone(), valid=torch.ones(ROWS, dtype=torch.bool))
    batch = RolloutBatch(traj, scored, torch.zeros(ROWS), torch.ones(ROWS, dtype=torch.bool), torch.arange(ROWS) // 4)
    dpo = DPO(policy, torch.optim.SGD(transformer.parameters(), lr=lr), transformer, cfg, Accelerator(cpu=True))
    result = dpo.update(batch, step)
    return {**result.metrics, "stepped": result.stepped, "skip_reason": result.skip_reason}


def oracle_update(model, reference, traj, cfg, step, pairs):
    """SGD on the loss written from the formulas, pairs given by hand, the recipe's draws (same order)."""
    tc = cfg.train
    transformer = model.transformer
    opt = torch.optim.SGD(transformer.parameters(), lr=LR)
    times, noise = draw_times_and_noise(traj, len(pairs), tc, update_generator(cfg.seed, step, 0, DRAW_STREAM))
    x0 = traj.latents[:, -1]
    for p, (w, lo) in enumerate(pairs):  # one pair per minibatch, one SGD step each
        for i in range(tc.timesteps_per_pair):
            t, eps = float(times[p, i]), noise[p, i]
            errors = {}
            for name, row in (("w", w), ("l", lo)):
                cond = row_cond(traj, row)
                x_t = (1 - t) * x0[[row]] + t * eps  # the same t and eps for the winner and the loser
                target = eps - x0[[row]]
                with torch.no_grad():
                    ref_error = ((model.velocity(reference, x_t, t, cond) - target) ** 2).mean()
                errors[name] = ((model.velocity(transformer, x_t, t, cond) - target) ** 2).mean() - ref_error
            delta = errors["w"] - errors["l"]
            loss = -torch.log(torch.sigmoid(-tc.beta * delta))
            (loss / tc.timesteps_per_pair).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("swap", [False, True])
def test_dpo_update_equals_sgd_on_the_hand_written_loss(toy, swap):
    model, traj, reference, start = toy
    cfg = RecipeConfig(seed=3)
    cfg.train.swap_pairs = swap
    model.transformer.load_state_dict(start)
    metrics = run_update(model, traj, reference, cfg, step=4)
    after_recipe = copy.deepcopy(model.transformer.state_dict())

    model.transformer.load_state_dict(start)
    oracle_update(model, reference, traj, cfg, step=4,
                  pairs=[(lo, w) for w, lo in HAND_PAIRS] if swap else HAND_PAIRS)
    for name, value in model.transformer.state_dict().items():
        torch.testing.assert_close(after_recipe[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(after_recipe[k], start[k]) for k in start)
    assert metrics["train/optimizer_steps"] == 2 and metrics["stepped"]  # two pairs, one per minibatch
    assert metrics["dpo/pairs"] == 2 and metrics["dpo/groups_used"] == 1.0
    assert metrics["dpo/reward_gap"] == pytest.approx((0.8 + 0.6) / 2)
    assert metrics["ref_mse"] > 0 and metrics["grad_norm"] > 0 and 0 <= metrics["dpo/implicit_acc"] <= 1


def test_kl_rows_all_adds_every_rows_velocity_mse_to_the_reference_as_sgd_on_the_hand_written_loss(toy):
    """train.kl_rows=all: each minibatch adds kl_beta·sum over its share of the step's rows (rows m, m + M, ... of
    M minibatches) of mean|v_theta - v_ref|^2 / ROWS, at one flow time and noise a row from the anchor stream; the
    pair rows' own KL is then left out (they are among the rows)."""
    model, traj, reference, start = toy
    cfg = RecipeConfig(seed=3)
    cfg.train.kl_beta, cfg.train.kl_rows = 0.5, "all"
    model.transformer.load_state_dict(start)
    metrics = run_update(model, traj, reference, cfg, step=4)
    after_recipe = copy.deepcopy(model.transformer.state_dict())

    # The oracle: the pair terms as above, one pair per minibatch, then each minibatch's anchor rows.
    model.transformer.load_state_dict(start)
    transformer = model.transformer
    tc = cfg.train
    opt = torch.optim.SGD(transformer.parameters(), lr=LR)
    times, noise = draw_times_and_noise(traj, 2, tc, update_generator(cfg.seed, 4, 0, DRAW_STREAM))
    anchor_t, anchor_eps = draw_times_and_noise(traj, ROWS, replace(tc, timesteps_per_pair=1),
                                                update_generator(cfg.seed, 4, 0, ANCHOR_STREAM))
    x0 = traj.latents[:, -1]
    anchor_mses = []
    for p, (w, lo) in enumerate(HAND_PAIRS):
        for i in range(tc.timesteps_per_pair):
            t, eps = float(times[p, i]), noise[p, i]
            errors = {}
            for name, row in (("w", w), ("l", lo)):
                cond = row_cond(traj, row)
                x_t = (1 - t) * x0[[row]] + t * eps
                with torch.no_grad():
                    ref_error = ((model.velocity(reference, x_t, t, cond) - (eps - x0[[row]])) ** 2).mean()
                errors[name] = ((model.velocity(transformer, x_t, t, cond) - (eps - x0[[row]])) ** 2).mean() - ref_error
            (-torch.log(torch.sigmoid(-tc.beta * (errors["w"] - errors["l"]))) / tc.timesteps_per_pair).backward()
        for row in range(p, ROWS, 2):  # this minibatch's share of the rows
            t, eps = float(anchor_t[row, 0]), anchor_eps[row, 0]
            x_t = (1 - t) * x0[[row]] + t * eps
            cond = row_cond(traj, row)
            with torch.no_grad():
                v_ref = model.velocity(reference, x_t, t, cond)
            mse = ((model.velocity(transformer, x_t, t, cond) - v_ref) ** 2).mean()
            anchor_mses.append(float(mse))
            (tc.kl_beta * mse / ROWS).backward()
        opt.step()
        opt.zero_grad()
    for name, value in transformer.state_dict().items():
        torch.testing.assert_close(after_recipe[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # Logged: the mean over minibatches of each one's mean anchor MSE (4 rows each).
    assert metrics["dpo/anchor_mse"] == pytest.approx((sum(anchor_mses[:4]) / 4 + sum(anchor_mses[4:]) / 4) / 2,
                                                      rel=1e-5)
    assert metrics["dpo/anchor_mse"] > 0


def test_no_pair_takes_no_step_and_says_why(toy):
    model, traj, reference, start = toy
    model.transformer.load_state_dict(start)
    metrics = run_update(model, traj, reference, RecipeConfig(), rewards=torch.full((ROWS,), 0.5))
    assert all(torch.equal(v, start[k]) for k, v in model.transformer.state_dict().items())
    assert not metrics["stepped"] and metrics["train/optimizer_steps"] == 0 and "no preference pair" in metrics["skip_reason"]
    assert metrics["dpo/pairs"] == 0 and metrics["dpo/no_pair"] == 1


def test_one_update_makes_the_policy_prefer_its_winners(toy):
    """The signal end to end: after one update the implicit margin of the same pairs, same (t, eps), is positive."""
    model, traj, reference, start = toy
    model.transformer.load_state_dict(start)
    cfg = RecipeConfig()
    cfg.train.minibatch_size = 2

    def margins():
        times, noise = draw_times_and_noise(traj, 2, cfg.train, update_generator(0, 0, 0, DRAW_STREAM))
        x0 = traj.latents[:, -1]
        out = []
        for p, (w, lo) in enumerate(HAND_PAIRS):
            delta = 0.0
            for row, sign in ((w, 1), (lo, -1)):
                cond = row_cond(traj, row)
                for i in range(2):
                    t, eps = float(times[p, i]), noise[p, i]
                    x_t, u = (1 - t) * x0[[row]] + t * eps, eps - x0[[row]]
                    with torch.no_grad():
                        delta += sign * float(((model.velocity(model.transformer, x_t, t, cond) - u) ** 2).mean()
                                              - ((model.velocity(reference, x_t, t, cond) - u) ** 2).mean())
            out.append(-delta)
        return out

    before = margins()
    run_update(model, traj, reference, cfg)
    after = margins()
    assert all(a > b for a, b in zip(after, before)), (before, after)
