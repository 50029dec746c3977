"""Async GRPO pays only for the proximal policy it needs (decoupled PPO, trainers/grpo.py).

The proximal log-probs (and Guard's / DPPO's mu_old) are the policy at the start of an
update. A separate no-grad pass computes them only for the minibatches trained after the
update's first optimizer step; before it, the loss's own forward gives them, and a batch
at staleness 0 needs no proximal policy at all (the weights that sampled are the
proximal ones). These tests count the forwards that remain and check that each skip
gives the loss, the gradients and the trained weights as computing it does: bit for bit where a skip and
the pass see the same forwards, within rounding where the pass's forwards are smaller batches.
"""

import copy

import pytest
import torch
from accelerate import Accelerator

from engine import Engine, GenerationRequest, load_model
from engine.denoise import guided_velocity
from flywheel.recipe.policy import Policy
from flywheel.rollout_collector import RolloutBatch
from trainers.grpo import GRPO, Config, grpo_step_loss, start_of_update_steps

STEPS, ROWS = 3, 8
ADV = torch.tensor([1.0, -0.5, 0.3, 0.8, -1.2, 0.7, 0.3, -0.9])
USABLE = torch.ones(ROWS, dtype=torch.bool)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return load_model("toy-digits")


def rollout(model):
    """Rollouts of the model's current weights by a local engine: its recorded log-probs are the trainer's."""
    requests = [GenerationRequest(prompt=["a handwritten three", "the digit seven"][i // 4], seed=100 + i,
                                  steps=STEPS, sampler="sde", noise_level=0.7) for i in range(ROWS)]
    return Engine(model).generate(requests)


def lagged(traj):
    """The same trajectories as if an older policy had sampled them (log-probs off by up to 0.15)."""
    noise = torch.Generator().manual_seed(3)
    traj.log_probs = traj.log_probs + 0.3 * (torch.rand(traj.log_probs.shape, generator=noise) - 0.5)
    return traj


def config(async_rollouts=True, optimizer_steps=1, **train) -> Config:
    cfg = Config()
    cfg.rollout.asynchronous = async_rollouts
    cfg.train.minibatch_size = ROWS if optimizer_steps == 1 else 2
    cfg.train.gradient_accumulation_steps = 1 if optimizer_steps == 1 else ROWS // 2 // optimizer_steps
    cfg.train.kl_beta, cfg.train.clip_range, cfg.train.importance_cap = 0.5, 1e-3, 1.05
    cfg.train.timestep_fraction = 1.0
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def ref_velocity_of(model, reference):
    return lambda x, t, cond, uncond, g: guided_velocity(model, reference, x, t, cond, uncond, g)


def forwards(module):
    """Counts of `module`'s forwards with and without autograd, while the update runs."""
    counts = {"grad": 0, "no_grad": 0}

    def count(*_):
        counts["grad" if torch.is_grad_enabled() else "no_grad"] += 1
    module.register_forward_hook(count)
    return counts


def update(model, traj, cfg, staleness):
    """One GRPO update (SGD) of `model`'s transformer; returns (metrics, weights after, counts of forwards)."""
    reference = copy.deepcopy(model.transformer).requires_grad_(False)
    policy = Policy(model, list(model.transformer.named_parameters()), ref_velocity_of(model, reference), {})
    metrics = {} if staleness is None else {"staleness": staleness}
    batch = RolloutBatch(traj, None, ADV.clone(), USABLE.clone(), torch.arange(ROWS) // 4, metrics)
    counts = forwards(model.transformer)

    def before_each_step():  # where async rollouts hand the trainer the cores a finished rollout freed
        counts["before_each_step"] += 1
    counts["before_each_step"] = 0
    grpo = GRPO(policy, torch.optim.SGD(model.transformer.parameters(), lr=0.5), model.transformer, cfg,
                Accelerator(cpu=True), before_each_step)
    result = grpo.update(batch, step=0)
    assert result.stepped
    return result.metrics, copy.deepcopy(model.transformer.state_dict()), counts


# (async, staleness, optimizer steps per update, train overrides) -> no-grad forwards of the trained module.
# The pass covers the minibatches after the first optimizer step: half of the four 2-row minibatches, at each
# of the 3 steps. Everything else trains from the loss's own forwards (2 optimizer steps: 4 minibatches x 3).
CASES = [
    ((True, 1, 1, {}), 0),                 # lagged, one optimizer step: the loss's forward is the proximal pass
    ((True, None, 1, {}), 0),              # no staleness given counts as lagged; still one step: nothing extra
    ((True, 1, 2, {}), 2 * STEPS),         # lagged, two steps: the proximal log-probs of the later minibatches
    ((True, 0, 2, {}), 0),                 # on-policy: the recorded log-probs are the proximal ones
    ((True, 0, 2, {"guard": True}), 2 * STEPS),  # ...but Guard's mu_old still needs the later minibatches' means
    ((False, None, 2, {}), 0),             # synchronous: no proximal policy
    ((False, None, 2, {"guard": True}), 2 * STEPS),
    ((False, None, 1, {"guard": True}), 0),
]


@pytest.mark.parametrize("case, no_grad", CASES)
def test_the_start_of_update_pass_runs_only_where_the_weights_have_moved(model, case, no_grad):
    async_rollouts, staleness, optimizer_steps, train = case
    cfg = config(async_rollouts, optimizer_steps, **train)
    if train.get("guard"):
        cfg.train.clip_range = 1e-4
    metrics, _, counts = update(model, lagged(rollout(model)), cfg, staleness)
    assert metrics["train/optimizer_steps"] == optimizer_steps
    trained = (ROWS // cfg.train.minibatch_size) * STEPS
    # The threads are checked before every forward of the pass and before each trained step's forward and backward.
    assert counts == {"grad": trained, "no_grad": no_grad, "before_each_step": no_grad + 2 * trained}


def test_the_fused_proximal_log_probs_give_the_separate_pass_loss_and_gradients_bit_for_bit(model):
    """Before any optimizer step, decoupled=True (the forward's own log-probs, detached) is the pass's value."""
    traj = lagged(rollout(model))
    cfg = config()
    reference = copy.deepcopy(model.transformer).requires_grad_(False)
    trained = torch.ones(ROWS, STEPS, dtype=torch.bool)
    proximal, means = start_of_update_steps(model, model.transformer, traj, [list(range(ROWS))], trained, True)
    for j in range(STEPS):
        out = []
        for kwargs in ({"proximal": proximal[:, j], "old_mean": means[:, j]}, {"decoupled": True}):
            model.transformer.zero_grad(set_to_none=True)
            loss, stats = grpo_step_loss(model, model.transformer, ref_velocity_of(model, reference), traj, j, ADV,
                                         USABLE, cfg.train, **kwargs)
            loss.backward()
            out.append((loss.detach(), stats, [p.grad.clone() for p in model.transformer.parameters()]))
        (loss_pass, stats_pass, grads_pass), (loss_fused, stats_fused, grads_fused) = out
        assert torch.equal(loss_pass, loss_fused)
        assert all(torch.equal(stats_pass[k], stats_fused[k]) for k in stats_pass)
        assert all(torch.equal(a, b) for a, b in zip(grads_pass, grads_fused))
        # The lag is real, so the importance weight acts: this equality is not of a trivial loss.
        assert float(stats_fused["is_weight/mean"]) < 0.999 and float(stats_fused["logprob_gap/max"]) > 1e-2


def test_an_on_policy_batch_trains_as_decoupled_ppo_would(model):
    """Staleness 0 skips decoupled PPO: the same weights as computing the proximal pass and importance weights."""
    traj = rollout(model)
    trained = torch.ones(ROWS, STEPS, dtype=torch.bool)
    proximal, _ = start_of_update_steps(model, model.transformer, traj, [list(range(ROWS))], trained, True)
    assert torch.equal(proximal, traj.log_probs)  # the premise: the recorded log-probs are the current weights'
    start = copy.deepcopy(model.transformer.state_dict())
    skipped, after_skip, _ = update(model, traj, config(optimizer_steps=2), staleness=0)
    model.transformer.load_state_dict(start)
    computed, after_computed, _ = update(model, traj, config(optimizer_steps=2), staleness=1)
    # Bit for bit where the pass's 2-row forwards round as the engine's 8-row one did (this machine); some CPUs'
    # kernels round a matmul by its row count, so the bound is rounding's, 3000x under the control's gap below.
    assert weight_gap(after_skip, after_computed) <= 1e-5
    assert skipped.keys() == computed.keys()
    assert all(abs(skipped[k] - computed[k]) <= 1e-5 * max(1.0, abs(computed[k])) for k in skipped), (skipped, computed)
    assert skipped["clipfrac"] > 0  # two optimizer steps: the second's ratios leave the clip range
    assert weight_gap(after_skip, start) > 5e-3  # the update moved the weights: the equality is not of a no-op
    # The control: the same comparison on a lagged batch tells the two losses apart (the gap is 0.03 here).
    model.transformer.load_state_dict(start)
    _, lag_skip, _ = update(model, lagged(rollout(model)), config(optimizer_steps=2), staleness=0)
    model.transformer.load_state_dict(start)
    _, lag_computed, _ = update(model, lagged(rollout(model)), config(optimizer_steps=2), staleness=1)
    assert weight_gap(lag_skip, lag_computed) > 1e-2


def weight_gap(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts' tensors."""
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)
