"""The GRPO update against a hand computation of Flow-GRPO's loss (arXiv 2505.05470, Eq. 8 and 9).

The oracle below is written from the formulas, not from the recipe's helpers: the
Flow-SDE mean, std and Gaussian log-density; the PPO-clip term
max(-A·r, -A·clip(r, 1 - eps, 1 + eps)); the exact Gaussian KL |mu - mu_ref|^2 / (2 std^2);
the mean over usable samples of each minibatch; the gradient averaged over the
chosen steps and the accumulated minibatches of one optimizer step. The tiny case
has minibatch < batch (two optimizer steps per rollout, so later ratios leave the
clip range), kl_beta > 0, a masked row and accumulation, and the weights after the
update must agree with plain SGD on the oracle's loss.
"""

import copy
import math

import pytest
import torch
from accelerate import Accelerator

from engine import Engine, GenerationRequest, PromptEmbeds, load_model
from engine.denoise import guided_velocity
from flywheel.rollout_collector import RolloutBatch
from flywheel.recipe.policy import Policy
from trainers.grpo import GRPO, Config, chosen_steps, grpo_step_loss, trained_fraction

STEPS, NOISE, ROWS = 3, 0.7, 8
ADV = torch.tensor([1.0, -0.5, 0.0, 0.8, -1.2, 0.7, 0.3, -0.9])
USABLE = torch.tensor([True, True, False, True, True, True, True, True])
LR = 0.5


def rollout(model, sampler="sde", guidance=1.0, steps=STEPS, noise=NOISE):
    engine = Engine(model)
    prompts = ["a handwritten three", "the digit seven"]
    requests = [GenerationRequest(prompt=prompts[i // 4], seed=100 + i, steps=steps, sampler=sampler,
                                  noise_level=noise, guidance_scale=guidance) for i in range(ROWS)]
    return engine.generate(requests)


def recipe_config(**train) -> Config:
    cfg = Config()
    cfg.train.minibatch_size = 2
    cfg.train.gradient_accumulation_steps = 2
    cfg.train.kl_beta = 0.5
    cfg.train.clip_range = 1e-3
    cfg.train.max_grad_norm = 1e9  # no clipping: the oracle is plain SGD
    cfg.train.timestep_fraction = 1.0  # every step, as the oracle trains (the default leaves the last one out)
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


# ---- the oracle ---------------------------------------------------------------------------


def oracle_velocity(model, transformer, x, t, traj, rows, guidance):
    mask = None if traj.prompt_mask is None else traj.prompt_mask[rows]
    cond = PromptEmbeds(traj.prompt_embeds[rows], traj.pooled_prompt_embeds[rows], mask)
    v_cond = model.velocity(transformer, x, t, cond)
    if guidance == 1.0:
        return v_cond
    neg_mask = None if traj.negative_prompt_mask is None else traj.negative_prompt_mask[rows]
    uncond = PromptEmbeds(traj.negative_prompt_embeds[rows], traj.negative_pooled_prompt_embeds[rows], neg_mask)
    v_uncond = model.velocity(transformer, x, t, uncond)  # a separate forward, not the batched one
    return v_uncond + guidance * (v_cond - v_uncond)


def oracle_sde(x, x_next, v, t, t_next, a, t1):
    """Flow-SDE Eq. 9: sigma_t = a·sqrt(t / (1 - t)), 1 - t floored at 1 - t_1; (log-prob, mean, std)."""
    dt = t_next - t
    sigma = a * math.sqrt(t / (1 - min(t, t1)))
    mean = x + dt * (v + sigma**2 / (2 * t) * (x + (1 - t) * v))
    std = sigma * math.sqrt(-dt)
    log_density = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return log_density.flatten(1).mean(1), mean, std


def oracle_step_terms(model, transformer, reference, traj, rows, j):
    ts = traj.timesteps.tolist()
    x, x_next = traj.latents[rows, j], traj.latents[rows, j + 1]
    v = oracle_velocity(model, transformer, x, traj.timesteps[j], traj, rows, traj.guidance_scale)
    lp, mean, std = oracle_sde(x, x_next, v, ts[j], ts[j + 1], NOISE, ts[1])
    with torch.no_grad():
        v_ref = oracle_velocity(model, reference, x, traj.timesteps[j], traj, rows, traj.guidance_scale)
        _, mean_ref, _ = oracle_sde(x, x_next, v_ref, ts[j], ts[j + 1], NOISE, ts[1])
    kl = ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * std**2)
    return lp, kl


def oracle_update(model, transformer, reference, traj, steps, cfg, behaviour=None, cap=None):
    """SGD on the hand-written loss; returns (clip fractions, KLs) seen. `behaviour` set = decoupled PPO."""
    tc = cfg.train
    opt = torch.optim.SGD(transformer.parameters(), lr=LR)
    minibatches = [list(range(i, i + tc.minibatch_size)) for i in range(0, ROWS, tc.minibatch_size)]
    proximal = {}
    if behaviour is not None:  # log-probs under the weights at the start of the update
        with torch.no_grad():
            for rows in minibatches:
                for j in steps:
                    proximal[tuple(rows), j] = oracle_step_terms(model, transformer, reference, traj, rows, j)[0]
    clipfracs, kls, max_dev, is_ws = [], [], 0.0, []
    for m, rows in enumerate(minibatches):
        adv, usable = ADV[rows], USABLE[rows].float()
        w = usable / usable.sum()
        for j in steps:
            lp, kl = oracle_step_terms(model, transformer, reference, traj, rows, j)
            if behaviour is None:
                ratio, is_w = torch.exp(lp - traj.log_probs[rows, j]), torch.ones(len(rows))
            else:
                prox = proximal[tuple(rows), j]
                ratio = torch.exp(lp - prox)
                is_w = torch.minimum(torch.exp(prox - behaviour[rows, j]), torch.tensor(cap))
            ppo = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - tc.clip_range, 1 + tc.clip_range))
            loss = (is_w * ppo * w).sum() + tc.kl_beta * (kl * w).sum()
            (loss / (len(steps) * tc.gradient_accumulation_steps)).backward()
            clipfracs.append(float((((ratio.detach() - 1).abs() > tc.clip_range).float() * w).sum()))
            max_dev = max(max_dev, float(((ratio.detach() - 1).abs() * usable).max()))
            is_ws.append(float((is_w * w).sum()))
            kls.append(float((kl.detach() * w).sum()))
        if (m + 1) % tc.gradient_accumulation_steps == 0:
            opt.step()
            opt.zero_grad()
    return {"clipfrac": sum(clipfracs) / len(clipfracs), "kl": sum(kls) / len(kls), "ratio/max_dev": max_dev,
            "is_weight/mean": sum(is_ws) / len(is_ws)}


# ---- the recipe, on the same case ---------------------------------------------------------


def recipe_update(model, transformer, reference, traj, cfg):
    def ref_velocity(x, t, cond, uncond_cond, g):
        return guided_velocity(model, reference, x, t, cond, uncond_cond, g)

    policy = Policy(model, list(transformer.named_parameters()), ref_velocity, {})
    batch = RolloutBatch(traj, None, ADV.clone(), USABLE.clone(), torch.arange(ROWS) // 4)
    grpo = GRPO(policy, torch.optim.SGD(transformer.parameters(), lr=LR), transformer, cfg, Accelerator(cpu=True))
    result = grpo.update(batch, step=0)
    assert result.stepped and result.skip_reason is None
    return result.metrics


@pytest.fixture
def fresh_model():
    return load_model("toy-digits")


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_grpo_update_equals_sgd_on_the_hand_written_loss(fresh_model, guidance):
    model = fresh_model
    traj = rollout(model, guidance=guidance)
    cfg = recipe_config()
    steps = chosen_steps(traj, 1.0, torch.Generator().manual_seed(0))
    assert steps == [0, 1, 2]
    start = copy.deepcopy(model.transformer.state_dict())
    reference = copy.deepcopy(model.transformer).requires_grad_(False)

    metrics = recipe_update(model, model.transformer, reference, traj, cfg)
    after_recipe = copy.deepcopy(model.transformer.state_dict())

    model.transformer.load_state_dict(start)
    expected = oracle_update(model, model.transformer, reference, traj, steps, cfg)
    for name, value in model.transformer.state_dict().items():
        torch.testing.assert_close(after_recipe[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # The case really exercises clipping and the KL: both are neither off nor everywhere.
    assert 0.05 < expected["clipfrac"] < 0.95 and expected["kl"] > 0 and expected["ratio/max_dev"] > 1e-3
    assert metrics["clipfrac"] == pytest.approx(expected["clipfrac"], abs=1e-6)
    assert metrics["kl"] == pytest.approx(expected["kl"], rel=1e-4)
    assert metrics["ratio/max_dev"] == pytest.approx(expected["ratio/max_dev"], rel=1e-4)
    assert metrics["is_weight/mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["train/optimizer_steps"] == 2  # minibatch < batch: two optimizer steps (the loop syncs once)


def test_decoupled_ppo_clips_against_the_proximal_policy(fresh_model):
    """Async rollouts: r = pi / pi_prox is clipped, min(pi_prox / pi_behaviour, cap) weights the term."""
    model = fresh_model
    traj = rollout(model)
    lag = torch.Generator().manual_seed(3)
    traj.log_probs = traj.log_probs + 0.3 * (torch.rand(traj.log_probs.shape, generator=lag) - 0.5)
    behaviour = traj.log_probs.clone()
    cfg = recipe_config(importance_cap=1.05)
    cfg.rollout.asynchronous = True
    start = copy.deepcopy(model.transformer.state_dict())
    reference = copy.deepcopy(model.transformer).requires_grad_(False)

    metrics = recipe_update(model, model.transformer, reference, traj, cfg)
    after_recipe = copy.deepcopy(model.transformer.state_dict())
    model.transformer.load_state_dict(start)
    expected = oracle_update(model, model.transformer, reference, traj, [0, 1, 2], cfg, behaviour=behaviour,
                             cap=1.05)
    for name, value in model.transformer.state_dict().items():
        torch.testing.assert_close(after_recipe[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # A trust region exists: the log-prob gap exceeds the clip range and later minibatches are clipped.
    assert metrics["logprob_gap/max"] > 100 * cfg.train.clip_range
    assert metrics["clipfrac"] == pytest.approx(expected["clipfrac"], abs=1e-6) and expected["clipfrac"] > 0.05
    assert metrics["is_weight/mean"] == pytest.approx(expected["is_weight/mean"], rel=1e-5)
    assert expected["is_weight/mean"] < 0.99  # the cap and the lag both act


def test_flow_grpo_kl_form_is_the_exact_kl_times_dt(fresh_model):
    model = fresh_model
    traj = rollout(model)
    reference = copy.deepcopy(model.transformer).requires_grad_(False)
    with torch.no_grad():  # move the policy away from the reference
        for p in model.transformer.parameters():
            p.add_(0.01 * torch.randn_like(p))

    def ref_velocity(x, t, cond, uncond_cond, g):
        return guided_velocity(model, reference, x, t, cond, uncond_cond, g)

    usable = torch.ones(ROWS, dtype=torch.bool)
    for j in range(STEPS):
        exact = grpo_step_loss(model, model.transformer, ref_velocity, traj, j, ADV, usable,
                               recipe_config(kl_form="exact").train)[1]["kl"]
        flow_grpo = grpo_step_loss(model, model.transformer, ref_velocity, traj, j, ADV, usable,
                                   recipe_config(kl_form="flow_grpo").train)[1]["kl"]
        dt = float(traj.timesteps[j] - traj.timesteps[j + 1])
        assert float(exact) > 0
        assert float(flow_grpo) == pytest.approx(float(exact) * dt, rel=1e-5)


def test_cps_last_step_is_deterministic_and_never_trained(fresh_model):
    """CPS's std t_next·sin(eta·pi/2) is 0 at the last step: no log-prob, so no loss and no 0/0 KL."""
    model = fresh_model
    traj = rollout(model, sampler="cps", steps=4, noise=0.5)
    assert chosen_steps(traj, 1.0, torch.Generator().manual_seed(0)) == [0, 1, 2]
    assert chosen_steps(traj, 1.0, torch.Generator(), selection="first") == [0, 1, 2]
    cfg = recipe_config(kl_beta=0.0)
    reference = copy.deepcopy(model.transformer).requires_grad_(False)
    metrics = recipe_update(model, model.transformer, reference, traj, cfg)
    assert all(math.isfinite(v) for v in metrics.values())


def test_first_steps_selection_follows_flow_grpo(fresh_model):
    traj = rollout(fresh_model, steps=10)
    # Flow-GRPO trains the first int(T·f) steps: 9 of 10 at f = 0.99.
    assert chosen_steps(traj, 0.99, torch.Generator(), selection="first") == list(range(9))
    assert chosen_steps(traj, 0.3, torch.Generator(), selection="first") == [0, 1, 2]
    picked = chosen_steps(traj, 0.3, torch.Generator().manual_seed(1))
    assert len(picked) == 3 and picked == sorted(picked)


def test_default_trains_flow_grpos_first_nine_of_ten_steps(fresh_model):
    """Flow-GRPO's train.timestep_fraction 0.99 trains the first int(0.99·10) = 9 steps of a 10-step rollout, the
    last one untrained: the default does the same (issue 23, 5g); the windowed variants train their whole window."""
    traj = rollout(fresh_model, steps=10)
    reference = copy.deepcopy(fresh_model.transformer).requires_grad_(False)
    metrics = recipe_update(fresh_model, fresh_model.transformer, reference, traj,
                            recipe_config(kl_beta=0.0, timestep_fraction=None))
    assert (metrics["trained_steps/first"], metrics["trained_steps/count"]) == (0.0, 9.0)
    assert trained_fraction(Config().train) == (0.99, "first")
    assert trained_fraction(recipe_config(variant="mixgrpo", timestep_fraction=None).train) == (1.0, "first")
    # An explicit fraction keeps its own selection.
    assert trained_fraction(recipe_config(timestep_fraction=0.5).train) == (0.5, "random")
    every = recipe_update(fresh_model, fresh_model.transformer, reference, traj,
                          recipe_config(kl_beta=0.0, timestep_fraction=1.0))
    assert every["trained_steps/count"] == 10.0
