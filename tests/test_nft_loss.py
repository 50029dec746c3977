"""DiffusionNFT (arXiv 2509.16117): the loss, the optimality probability, the soft update and the update.

Golden values are worked out by hand in the comments, from the paper's formulas:
v+ = (1 - beta)·v_old + beta·v_theta, v- = (1 + beta)·v_old - beta·v_theta (Theorem 3.2),
per sample (r·l(v+) + (1 - r)·l(v-)) / beta (Eq. 5, with the public code's 1/beta), l the
adaptive x0 regression ||x_hat - x0||^2 / mean|x_hat - x0| with x_hat = x_t - t·v (Sec. 3.3),
which under rectified flow equals t·mean((v - u)^2) / mean|v - u|: the oracle below uses
that velocity-space form, so it does not share the recipe's x0-space arithmetic.
"""

import copy
import math
from dataclasses import dataclass, field

import pytest
import torch
from accelerate import Accelerator

from engine import Engine, GenerationRequest, PromptEmbeds, load_model
from flywheel.rollout_collector import Flywheel, RolloutBatch
from flywheel.prompts import PromptSampler, load_prompts
from flywheel.recipe.update import update_generator
from rewards import RewardBatch, RewardSet
from flywheel.recipe.policy import Policy
from flywheel.recipe.sections import AdvantageConfig
from trainers.nft import (NFT, UPDATE_STREAM, NFTConfig, SamplingPolicy, eta_schedule, initial_sampling_weights,
                          nft_loss, optimality_from_advantages, optimality_probability, soft_update, update_draws)

# ---- two samples of two elements, worked by hand -------------------------------------------
# Sample A: x0 = [1, -1], noise = [0.5, 0.5], t = 1/2, v_theta = [0, 1], v_old = [-1, 1], r = 3/4.
#   u = noise - x0 = [-0.5, 1.5]; x_t = [0.75, -0.25]; with beta = 1/2:
#   v+ = [-0.5, 1], v- = 1.5·[-1, 1] - 0.5·[0, 1] = [-1.5, 1].
#   uniform: l+ = (0 + 0.25) / 2 = 0.125, l- = (1 + 0.25) / 2 = 0.625.
#   adaptive: x_hat+ = x_t - t·v+ = [1, -0.75], error [0, 0.25]: 0.03125 / 0.125 = 0.25;
#             x_hat- = [1.5, -0.75], error [0.5, 0.25]: 0.15625 / 0.375 = 5/12.
#   per sample: uniform (0.75·0.125 + 0.25·0.625) / 0.5 = 0.5; adaptive (0.75·0.25 + 0.25·5/12) / 0.5 = 7/12.
# Sample B: x0 = [0, 2], noise = [1, 0], t = 1/4, v_theta = [1, -2], v_old = [1, -1], r = 0.2.
#   u = [1, -2]; x_t = [0.25, 1.5]; v+ = [1, -1.5], v- = [1, -0.5].
#   uniform: l+ = 0.25 / 2 = 0.125, l- = 2.25 / 2 = 1.125, per sample (0.2·0.125 + 0.8·1.125) / 0.5 = 1.85.
#   adaptive: x_hat+ = [0, 1.875], error [0, -0.125]: 0.0078125 / 0.0625 = 0.125;
#             x_hat- = [0, 1.625], error [0, -0.375]: 0.0703125 / 0.1875 = 0.375;
#   per sample (0.2·0.125 + 0.8·0.375) / 0.5 = 0.65.
X0 = torch.tensor([[1.0, -1.0], [0.0, 2.0]])
NOISE = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
T = torch.tensor([0.5, 0.25])
V_THETA = torch.tensor([[0.0, 1.0], [1.0, -2.0]])
V_OLD = torch.tensor([[-1.0, 1.0], [1.0, -1.0]])
R = torch.tensor([0.75, 0.2])
BETA = 0.5


def test_nft_loss_equals_the_hand_computed_values():
    loss, stats = nft_loss(V_THETA, V_OLD, X0, NOISE, T, R, BETA, weighting="adaptive")
    assert float(loss) == pytest.approx((7 / 12 + 0.65) / 2, abs=1e-6)
    assert float(stats["nft/positive_loss"]) == pytest.approx((0.25 + 0.125) / 2, abs=1e-6)
    assert float(stats["nft/negative_loss"]) == pytest.approx((5 / 12 + 0.375) / 2, abs=1e-6)
    # mean (v_theta - v_old)^2: A (1 + 0) / 2, B (0 + 1) / 2.
    assert float(stats["nft/old_deviation"]) == pytest.approx(0.5, abs=1e-7)
    loss, _ = nft_loss(V_THETA, V_OLD, X0, NOISE, T, R, BETA, weighting="uniform")
    assert float(loss) == pytest.approx((0.5 + 1.85) / 2, abs=1e-6)


def test_sample_weights_scale_and_kl_enter_as_documented():
    loss, _ = nft_loss(V_THETA, V_OLD, X0, NOISE, T, R, BETA, sample_weight=torch.tensor([1.0, 0.0]), scale=5.0)
    assert float(loss) == pytest.approx(5 * 7 / 12, abs=1e-5)
    # KL: mean (v_theta - v_ref)^2 is (0 + 1) / 2 for A and 0 for B; mean over the batch 0.25, weighed by 2.
    v_ref = torch.tensor([[0.0, 0.0], [1.0, -2.0]])
    loss, stats = nft_loss(V_THETA, V_OLD, X0, NOISE, T, R, BETA, v_ref=v_ref, kl_beta=2.0)
    assert float(stats["ref_mse"]) == pytest.approx(0.25, abs=1e-7) and "kl" not in stats
    assert float(loss) == pytest.approx((7 / 12 + 0.65) / 2 + 2 * 0.25, abs=1e-6)
    with pytest.raises(ValueError, match="v_ref"):
        nft_loss(V_THETA, V_OLD, X0, NOISE, T, R, BETA, kl_beta=1.0)
    with pytest.raises(ValueError, match="beta"):
        nft_loss(V_THETA, V_OLD, X0, NOISE, T, R, 0.0)


def test_beta_one_and_r_one_is_the_papers_weighted_flow_matching_loss():
    """beta = 1 makes the implicit positive policy the trained one (v+ = v_theta); with r = 1 only that branch
    counts: the loss is the adaptive-weighted flow-matching loss of v_theta, whatever v_old is."""
    ones = torch.ones(2)
    # Sample A: v_theta - u = [0.5, -0.5]: t·mean(sq) / mean|.| = 0.5·0.25 / 0.5 = 0.25.
    # Sample B: v_theta - u = [0, 0]: an exact prediction, loss 0 (the weight's floor keeps it finite).
    expected = (0.25 + 0.0) / 2
    for v_old in (V_OLD, torch.zeros_like(V_OLD), 3 * torch.randn(2, 2, generator=torch.Generator().manual_seed(0))):
        loss, _ = nft_loss(V_THETA, v_old, X0, NOISE, T, ones, 1.0)
        assert float(loss) == pytest.approx(expected, abs=1e-6)
    # With w(t) = 1 it is the plain velocity MSE: A (0.25 + 0.25) / 2, B 0.
    loss, _ = nft_loss(V_THETA, V_OLD, X0, NOISE, T, ones, 1.0, weighting="uniform")
    assert float(loss) == pytest.approx(0.25 / 2, abs=1e-7)


@pytest.mark.parametrize("beta", [0.1, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("r, factor", [(0.75, 0.5), (0.2, -0.6), (1.0, 1.0), (0.5, 0.0)])
def test_at_the_sampling_policy_the_gradient_is_the_flow_matching_gradient_times_2r_minus_1(beta, r, factor):
    """v_theta = v_old (the first minibatch of an on-policy step): the two branches' gradients combine to
    (2r - 1) times the gradient of the weighted flow-matching loss, for every beta (the public code's 1/beta).
    Sample A at v = v_old = [-1, 1]: v - u = [-0.5, -0.5], mean|v - u| = 0.5, so the gradient of
    t·mean((v - u)^2) / sg(mean|v - u|) is t·2(v - u) / (2·0.5) = [-0.5, -0.5] at t = 1/2."""
    v = V_OLD[:1].clone().requires_grad_(True)
    loss, _ = nft_loss(v, V_OLD[:1], X0[:1], NOISE[:1], T[:1], torch.tensor([r]), beta)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.full((1, 2), -0.5 * factor), rtol=1e-5, atol=1e-6)


def test_optimality_probability_golden_values():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 2.0, 2.0, 7.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    valid = torch.tensor([True, True, True, True, True, True, True, False])
    # Per-group std: groups 0 and 1 have std 0.5, so A = ±0.5 / 0.5001; r = 1/2 ± A / (2·5).
    a = 0.5 / (0.5 + 1e-4)
    r = optimality_probability(rewards, groups, valid, adv_clip_max=5.0, global_std=False)
    expected = [0.5 - a / 10, 0.5 + a / 10, 0.5 - a / 10, 0.5 + a / 10,
                0.5, 0.5,   # a flat group: nothing to compare, r = 1/2
                0.5, 0.5]   # one valid sample left in group 3, and the masked one
    torch.testing.assert_close(r, torch.tensor(expected), rtol=0, atol=1e-6)
    # A global std: that of the seven valid rewards [1, 2, 3, 4, 2, 2, 7] (mean 3, population variance 24 / 7).
    g = 0.5 / (math.sqrt(24 / 7) + 1e-4)
    r = optimality_probability(rewards, groups, valid, adv_clip_max=5.0, global_std=True)
    torch.testing.assert_close(r[:4], torch.tensor([0.5 - g / 10, 0.5 + g / 10, 0.5 - g / 10, 0.5 + g / 10]),
                               rtol=0, atol=1e-6)
    # c below |A|: clipped to the ends of [0, 1].
    r = optimality_probability(rewards, groups, valid, adv_clip_max=0.25, global_std=False)
    assert r[:4].tolist() == [0.0, 1.0, 0.0, 1.0]
    # From advantages directly: 1/2 + 1/2·clip(A / c, -1, 1).
    r = optimality_from_advantages(torch.tensor([-7.0, -2.5, 0.0, 1.0, 5.0]), 5.0)
    assert r.tolist() == pytest.approx([0.0, 0.25, 0.5, 0.6, 1.0], abs=1e-7)
    with pytest.raises(ValueError, match="adv_clip_max"):
        optimality_from_advantages(torch.zeros(2), 0.0)


def test_eta_schedule_golden_values():
    # The paper's default eta_i = min(0.001·i, 0.5).
    assert [eta_schedule(i) for i in (0, 1, 100, 499, 500, 10_000)] == pytest.approx([0, 0.001, 0.1, 0.499, 0.5, 0.5])
    # The public code's OCR schedule: 0 for 75 steps, then 0.0075 a step up to 0.999.
    ocr = dict(flat_steps=75, rate=0.0075, eta_max=0.999)
    assert [eta_schedule(i, **ocr) for i in (0, 74, 75, 76, 100, 208, 300)] == pytest.approx(
        [0, 0, 0, 0.0075, 0.1875, 0.9975, 0.999])
    with pytest.raises(ValueError):
        eta_schedule(-1)
    with pytest.raises(ValueError):
        eta_schedule(3, eta_max=1.5)


def test_soft_update_golden_values_and_exact_copy_at_zero():
    old = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0]])]
    new = [torch.tensor([3.0, 6.0]), torch.tensor([[0.0]])]
    soft_update(old, new, 0.25)  # 0.25·old + 0.75·new
    assert old[0].tolist() == [2.5, 5.0] and old[1].tolist() == [[1.0]]
    odd = [torch.tensor([0.1, -3.3e-7])]
    soft_update(old[:1], odd, 0.0)
    assert torch.equal(old[0], odd[0])  # eta = 0 is the trained weights bit for bit
    soft_update(old[:1], new[:1], 1.0)
    assert torch.equal(old[0], odd[0])  # eta = 1 leaves the sampling policy alone
    with pytest.raises(ValueError, match="eta"):
        soft_update(old, new, 1.5)
    with pytest.raises(ValueError, match="one sampling-policy tensor"):
        soft_update(old, new[:1], 0.5)
    with pytest.raises(ValueError, match=r"\(2,\)"):
        soft_update([torch.zeros(2)], [torch.zeros(3)], 0.5)


def test_sampling_policy_soft_updates_by_name_on_the_eta_schedule():
    # named_params in another order than the sampling weights: pairing is by name, not position.
    trained = [("b", torch.nn.Parameter(torch.tensor([3.0, 6.0]))), ("a", torch.nn.Parameter(torch.tensor([[0.0]])))]
    weights = {"a": torch.tensor([[4.0]]), "b": torch.tensor([1.0, 2.0])}
    sampling = SamplingPolicy(weights, policy=None, tc=NFTConfig(eta_flat_steps=1, eta_rate=0.25, eta_max=0.6))
    # After step 0 one step is done, and one is flat: eta = 0 copies theta.
    metrics = sampling.follow(trained, step=0)
    assert weights["a"].tolist() == [[0.0]] and weights["b"].tolist() == [3.0, 6.0]
    assert sampling.equals_trained  # eta 0: v_old may come from v_theta's forward
    assert metrics == {"nft/eta": 0.0}  # no sync, no version: the training loop serves theta_old after it
    with torch.no_grad():
        trained[0][1].copy_(torch.tensor([5.0, 2.0]))
        trained[1][1].fill_(8.0)
    # After step 1 (2 done): eta = (2 - 1)·0.25 = 0.25; b = 0.25·[3, 6] + 0.75·[5, 2] = [4.5, 3], a = 0.75·8 = 6.
    metrics = sampling.follow(trained, step=1)
    assert weights["b"].tolist() == [4.5, 3.0] and weights["a"].tolist() == [[6.0]]
    assert not sampling.equals_trained
    assert metrics == {"nft/eta": 0.25}
    # Step 10: (10 - 1)·0.25 is over the ceiling 0.6; b = 0.6·[4.5, 3] + 0.4·[5, 2] = [4.7, 2.6].
    metrics = sampling.follow(trained, step=10)
    assert metrics["nft/eta"] == 0.6
    torch.testing.assert_close(weights["b"], torch.tensor([4.7, 2.6]))
    assert sampling.state_dict() is weights  # what a checkpoint keeps


def test_initial_sampling_weights_are_the_trained_ones_or_the_checkpoints_with_the_same_names():
    named = [("w", torch.nn.Parameter(torch.tensor([1.0, 2.0])))]
    policy = Policy(model=None, named_params=named, ref_velocity=None, card_defaults={})
    fresh = initial_sampling_weights(policy, {})
    assert fresh["w"].tolist() == [1.0, 2.0] and fresh["w"].data_ptr() != named[0][1].data_ptr()
    assert initial_sampling_weights(policy, {"w": torch.tensor([7.0, 8.0])})["w"].tolist() == [7.0, 8.0]
    with pytest.raises(ValueError, match="name different tensors.*'lora_A'"):
        initial_sampling_weights(policy, {"lora_A": torch.zeros(2)})


def test_nft_serves_theta_old_inside_serving_weights_and_checkpoints_it():
    """The algorithm protocol: rollouts and syncs run inside serving_weights(), where the trained module holds
    theta_old; outside it the trained weights are back, bit for bit; state_dict is theta_old, by name."""
    named = [("w", torch.nn.Parameter(torch.tensor([1.0, 2.0])))]
    nft = NFT(Policy(model=None, named_params=named, ref_velocity=None, card_defaults={}), None, None, RecipeKeys(),
              None)
    assert nft.state_dict()["w"].tolist() == [1.0, 2.0]  # a fresh run's theta_old is theta
    assert nft.sampling.equals_trained
    nft.load_state_dict({"w": torch.tensor([1.0, 2.0])})  # a checkpoint of eta 0: still theta, bit for bit
    assert nft.sampling.equals_trained
    nft.load_state_dict({"w": torch.tensor([7.0, 8.0])})
    assert not nft.sampling.equals_trained
    with nft.serving_weights():
        assert named[0][1].tolist() == [7.0, 8.0]
    assert named[0][1].tolist() == [1.0, 2.0]
    assert nft.state_dict()["w"].tolist() == [7.0, 8.0]
    with pytest.raises(ValueError, match="name different tensors"):
        nft.load_state_dict({"v": torch.zeros(2)})


# ---- the update on the toy model ------------------------------------------------------------


@dataclass
class TrainKeys(NFTConfig):
    """NFTConfig (with the shared optimizer keys) set for small hand-checkable updates."""

    minibatch_size: int = 2
    gradient_accumulation_steps: int = 2
    max_grad_norm: float = 1e9  # no clipping: the oracle is plain SGD
    kl_beta: float = 0.0  # the paper's KL-free loss (the recipe's default 0.03 needs a reference; tested on its own)


@dataclass
class RecipeKeys:
    seed: int = 0
    train: TrainKeys = field(default_factory=TrainKeys)
    advantage: AdvantageConfig = field(default_factory=lambda: AdvantageConfig(global_std=True))


ROWS, STEPS, LR = 8, 4, 0.05
ADV = torch.tensor([1.2, -0.4, 0.0, 6.0, -2.0, 0.7, 0.0, -0.9])
USABLE = torch.tensor([True, True, False, True, True, True, False, True])
VALID = torch.tensor([True, True, True, True, True, True, False, True])  # row 6 masked, row 2 a flat group


def toy_rollouts(model, steps=STEPS, guidance=1.0):
    prompts = ["a handwritten three", "the digit seven"]
    requests = [GenerationRequest(prompt=prompts[i // 4], seed=200 + i, steps=steps, sampler="ode",
                                  guidance_scale=guidance) for i in range(ROWS)]
    return Engine(model).generate(requests)


def hand_batch(traj):
    rewards = RewardBatch(scores={}, valid_per_scorer={}, valid=VALID.clone(), total=torch.zeros(ROWS), weights={},
                          scorer_ids=[], weight_version=0)
    return RolloutBatch(traj, rewards, ADV.clone(), USABLE.clone(), torch.arange(ROWS) // 4)


def oracle_update(model, transformer, old, reference, traj, cfg, times, noise, minibatches=None, included=None):
    """SGD on the hand-written loss, in velocity space; the draws are the recipe's. `minibatches` and `included`:
    a down-sampled update's (default: minibatch_size rows in order, the excluded ones at weight 0)."""
    tc = cfg.train
    opt = torch.optim.SGD(transformer.parameters(), lr=LR)
    c, k = cfg.advantage.clip_max, times.shape[1]
    r_all = 0.5 + 0.5 * torch.clamp(ADV / c, -1, 1)
    if included is None:
        included = VALID if tc.keep_flat_groups else USABLE
    if minibatches is None:
        minibatches = [list(range(start, start + tc.minibatch_size)) for start in range(0, ROWS, tc.minibatch_size)]
    for m, rows in enumerate(minibatches):
        w = included[rows].float() / included[rows].float().sum().clamp(min=1)
        mask = None if traj.prompt_mask is None else traj.prompt_mask[rows]
        cond = PromptEmbeds(traj.prompt_embeds[rows], traj.pooled_prompt_embeds[rows], mask)
        x0 = traj.latents[rows, -1]
        for j in range(k):
            t, eps = times[rows, j], noise[rows, j]
            tb = t.view(-1, 1, 1, 1)
            x_t = (1 - tb) * x0 + tb * eps
            u = eps - x0
            v = model.velocity(transformer, x_t, t, cond)
            with torch.no_grad():
                v_old = model.velocity(old, x_t, t, cond)
                v_ref = model.velocity(reference, x_t, t, cond)
            terms = []
            for implicit in ((1 - tc.beta) * v_old + tc.beta * v, (1 + tc.beta) * v_old - tc.beta * v):
                diff = (implicit - u).flatten(1)
                terms.append(t * (diff**2).mean(1) / diff.detach().abs().mean(1))
            r = r_all[rows]
            policy = (w * (r * terms[0] + (1 - r) * terms[1]) / tc.beta).sum()
            kl = (w * ((v - v_ref) ** 2).flatten(1).mean(1)).sum()
            ((c * policy + tc.kl_beta * kl) / (k * tc.gradient_accumulation_steps)).backward()
        if (m + 1) % tc.gradient_accumulation_steps == 0:
            opt.step()
            opt.zero_grad()


def frozen_velocity(model, transformer):
    """old_velocity / ref_velocity for `NFT.update`: a frozen module's conditional velocity."""
    def velocity(x, t, cond):
        with torch.no_grad():
            return model.velocity(transformer, x, t, cond)
    return velocity


def nft_update(batch, model, old_velocity, optimizer, cfg, step, ref_velocity=None):
    """NFT.update on the toy model's trainable weights, with v_old from `old_velocity`: its UpdateResult."""
    policy = Policy(model, [(n, p) for n, p in model.transformer.named_parameters() if p.requires_grad],
                    ref_velocity, {})
    nft = NFT(policy, optimizer, model.transformer, cfg, Accelerator(cpu=True))
    nft.old_velocity = old_velocity
    result = nft.update(batch, step)
    assert result.stepped == (result.metrics["train/optimizer_steps"] > 0)
    return result.metrics


@pytest.fixture
def toy():
    return load_model("toy-digits")


@pytest.mark.parametrize("keep_flat_groups", [True, False])
def test_nft_update_equals_sgd_on_the_hand_written_loss(toy, keep_flat_groups):
    """Two optimizer steps of two accumulated minibatches, K = 2 times per sample from the rollout grid, a KL
    term, a clipped advantage, a masked row and a flat group: the weights must match SGD on the oracle."""
    model = toy
    traj = toy_rollouts(model)
    cfg = RecipeKeys(seed=3, train=TrainKeys(beta=0.7, kl_beta=0.3, timesteps_per_sample=2,
                                             keep_flat_groups=keep_flat_groups))
    old = copy.deepcopy(model.transformer).requires_grad_(False)
    reference = copy.deepcopy(model.transformer).requires_grad_(False)
    with torch.no_grad():  # the reference is elsewhere, so the KL has a gradient
        for p in reference.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    start = copy.deepcopy(model.transformer.state_dict())
    metrics = nft_update(hand_batch(traj), model, frozen_velocity(model, old),
                         torch.optim.SGD(model.transformer.parameters(), lr=LR), cfg, step=5,
                         ref_velocity=frozen_velocity(model, reference))
    after = copy.deepcopy(model.transformer.state_dict())

    times, noise = update_draws(traj, cfg.train, update_generator(cfg.seed, 5, stream=UPDATE_STREAM))
    grid = traj.timesteps[:-1].tolist()
    assert times.shape == (ROWS, 2) and all(float(t) in grid for t in times.flatten())
    assert all(times[i, 0] != times[i, 1] for i in range(ROWS))  # distinct times per sample
    model.transformer.load_state_dict(start)
    oracle_update(model, model.transformer, old, reference, traj, cfg, times, noise)
    moved = 0.0
    for name, value in model.transformer.state_dict().items():
        torch.testing.assert_close(after[name], value, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, float((value - start[name]).abs().max()))
    assert moved > 1e-4  # the update did something the comparison could see
    assert metrics["train/optimizer_steps"] == 2  # two optimizer steps (the loop syncs once, after the update)
    assert metrics["nft/trained_samples"] == (7 if keep_flat_groups else 6)
    assert metrics["ref_mse"] > 0 and math.isfinite(metrics["loss"]) and "kl" not in metrics


def test_a_down_sampled_update_equals_sgd_on_the_kept_rows_and_runs_no_forward_for_the_others(toy):
    """PODS (train.downsample_fraction): half of each group of 4, by the largest variance of the advantages among
    the valid rows, is rows 1 and 3 (-0.4 and 6.0 of 1.2, -0.4, 0, 6.0) and 4 and 5 (-2.0 and 0.7 of -2.0, 0.7,
    -0.9; row 6 is masked, and 2 of 3 are kept). The update keeps its 4 minibatches of 2 rows (2 optimizer steps
    of 2 accumulated), each now one kept row: the weights must match SGD on those rows alone, and the
    transformer sees those rows only."""
    model = toy
    traj = toy_rollouts(model)
    cfg = RecipeKeys(seed=3, train=TrainKeys(beta=0.7, timesteps_per_sample=2, downsample_fraction=0.5))
    old = copy.deepcopy(model.transformer).requires_grad_(False)
    start = copy.deepcopy(model.transformer.state_dict())
    rows_seen = []
    hook = model.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: rows_seen.append(next(iter([*args, *kwargs.values()])).shape[0]),
        with_kwargs=True)
    try:
        metrics = nft_update(hand_batch(traj), model, frozen_velocity(model, old),
                             torch.optim.SGD(model.transformer.parameters(), lr=LR), cfg, step=5)
    finally:
        hook.remove()
    after = copy.deepcopy(model.transformer.state_dict())
    assert metrics["nft/trained_samples"] == 4
    # v_old comes from the frozen copy (its own module); the trained module runs 4 minibatches x 2 times of 1 row.
    assert rows_seen == [1] * 8

    times, noise = update_draws(traj, cfg.train, update_generator(cfg.seed, 5, stream=UPDATE_STREAM))
    model.transformer.load_state_dict(start)
    kept = torch.zeros(ROWS, dtype=torch.bool)
    kept[[1, 3, 4, 5]] = True
    oracle_update(model, model.transformer, old, old, traj, cfg, times, noise, minibatches=[[1], [3], [4], [5]],
                  included=kept)
    moved = 0.0
    for name, value in model.transformer.state_dict().items():
        torch.testing.assert_close(after[name], value, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, float((value - start[name]).abs().max()))
    assert moved > 1e-4
    assert metrics["train/optimizer_steps"] == 2  # as many as without down-sampling


def test_down_sampled_minibatches_keep_the_count_and_fill_an_empty_one_with_an_excluded_row():
    from trainers.nft import down_sampled_minibatches

    included = torch.tensor([True, False, True, True, False, True, True, False])
    assert down_sampled_minibatches(included, 1) == [[0, 2, 3, 5, 6]]
    assert down_sampled_minibatches(included, 2) == [[0, 2, 3], [5, 6]]
    assert down_sampled_minibatches(included, 4) == [[0, 2], [3], [5], [6]]
    # Two kept rows, four minibatches (a process whose share kept fewer): the empty ones run excluded rows.
    few = torch.tensor([False, True, False, False, True, False, False, False])
    assert down_sampled_minibatches(few, 4) == [[1], [4], [0], [2]]


def make_flywheel_batch(model, steps=STEPS):
    engine = Engine(model)
    flywheel = Flywheel(engine, RewardSet("digit_alignment:1.0"), PromptSampler(load_prompts("toy-digits"), 2, 0), 4,
                        request_kwargs=dict(steps=steps, sampler="ode", guidance_scale=1.0), seed=0, adv_clip=5.0,
                        global_std=True)
    return flywheel.collect(0)


def test_nft_update_on_flywheel_rollouts_is_finite_moves_the_weights_and_is_deterministic(toy):
    model = toy
    batch = make_flywheel_batch(model)
    sampling = copy.deepcopy(model.transformer).requires_grad_(False)
    old_velocity = frozen_velocity(model, sampling)
    named = [(n, p) for n, p in model.transformer.named_parameters() if p.requires_grad]
    start = copy.deepcopy(model.transformer.state_dict())
    sampling_start = copy.deepcopy(sampling.state_dict())
    cfg = RecipeKeys(seed=0, train=TrainKeys(minibatch_size=8, gradient_accumulation_steps=1, max_grad_norm=1.0))

    def run(step):
        model.transformer.load_state_dict(start)
        optimizer = torch.optim.AdamW([p for _, p in named], lr=3e-4)
        metrics = nft_update(batch, model, old_velocity, optimizer, cfg, step)
        return metrics, copy.deepcopy(model.transformer.state_dict())

    metrics, first = run(step=3)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["train/optimizer_steps"] == 1
    # One optimizer step, after every forward: the trained and the sampling policy agree bit for bit throughout.
    assert metrics["nft/old_deviation"] == 0.0
    assert any(not torch.equal(first[n], start[n]) for n in start)
    assert all(torch.equal(sampling.state_dict()[n], v) for n, v in sampling_start.items())
    again, second = run(step=3)
    assert again == metrics and all(torch.equal(first[n], second[n]) for n in first)
    _, other = run(step=4)  # another step draws other times and noise
    assert any(not torch.equal(first[n], other[n]) for n in first)


def test_a_sampling_policy_equal_to_the_trained_one_gives_v_old_from_v_thetas_forward_until_theta_moves(toy):
    """theta_old == theta (a fresh run, or eta 0): v_old is v_theta's forward, detached, until the update's first
    optimizer step; after it, the sampling policy's own forward. The weights are those of the update that runs
    every v_old forward on a frozen copy of theta_old."""
    model = toy
    traj = toy_rollouts(model)
    cfg = RecipeKeys(seed=3, train=TrainKeys(beta=0.7, timesteps_per_sample=2))  # 4 minibatches, steps after 2 and 4
    named = [(n, p) for n, p in model.transformer.named_parameters() if p.requires_grad]
    start = copy.deepcopy(model.transformer.state_dict())

    def run(old_forward: bool):
        model.transformer.load_state_dict(start)
        nft = NFT(Policy(model, named, None, {}), torch.optim.SGD([p for _, p in named], lr=LR), model.transformer,
                  cfg, Accelerator(cpu=True))
        if old_forward:
            nft.old_velocity = frozen_velocity(model, copy.deepcopy(model.transformer))
        metrics = nft.update(hand_batch(traj), 5).metrics
        return nft, metrics, copy.deepcopy(model.transformer.state_dict())

    nft, reused, after = run(old_forward=False)
    _, forwarded, reference = run(old_forward=True)
    assert reused.pop("nft/old_forwards_skipped") == 4  # K = 2 times x the 2 minibatches before the first step
    assert forwarded.pop("nft/old_forwards_skipped") == 0
    assert reused == pytest.approx(forwarded, rel=1e-6, abs=1e-9)
    moved = 0.0
    for name, value in reference.items():
        torch.testing.assert_close(after[name], value, rtol=1e-6, atol=1e-7, msg=name)
        moved = max(moved, float((value - start[name]).abs().max()))
    assert moved > 1e-4
    # The soft update after it (eta 0.006 at step 5) leaves theta_old behind theta: the next update forwards v_old.
    assert not nft.sampling.equals_trained and not nft.v_old_is_v_theta()
    assert nft.update(hand_batch(traj), 6).metrics["nft/old_forwards_skipped"] == 0
    # Dropout in training mode: two forwards at the same weights differ, so v_old is forwarded.
    nft.sampling.equals_trained = True
    assert nft.v_old_is_v_theta()
    model.transformer.add_module("noise", torch.nn.Dropout(0.1))
    assert not nft.v_old_is_v_theta()
    model.transformer.noise.eval()
    assert nft.v_old_is_v_theta()


def test_nft_update_refuses_guided_rollouts_missing_reference_and_too_many_times(toy):
    model = toy
    old_velocity = frozen_velocity(model, copy.deepcopy(model.transformer))
    optimizer = torch.optim.SGD(model.transformer.parameters(), lr=0.0)

    def update(traj, **train):
        cfg = RecipeKeys(train=TrainKeys(**train))
        return nft_update(hand_batch(traj), model, old_velocity, optimizer, cfg, 0)

    with pytest.raises(ValueError, match="CFG-free.*guidance_scale=2.0"):
        update(toy_rollouts(model, steps=2, guidance=2.0))
    traj = toy_rollouts(model, steps=2)
    with pytest.raises(ValueError, match="kl_beta=0.5 needs ref_velocity"):
        update(traj, kl_beta=0.5)
    with pytest.raises(ValueError, match="timesteps_per_sample=3.*has 2"):
        update(traj, timesteps_per_sample=3)
    # null: the public code's int(0.99·T) of the T grid times, at least one (the recipe's default is 2).
    assert update_draws(traj, TrainKeys(timesteps_per_sample=None), torch.Generator())[0].shape == (ROWS, 1)
    uniform = update_draws(traj, TrainKeys(time_sampling="uniform", timesteps_per_sample=5), torch.Generator())[0]
    assert uniform.shape == (ROWS, 5) and bool(((uniform > 0) & (uniform <= 1)).all())
