"""One-line bugs a mutation audit found the suite let through (issue 23, item 6), each pinned here.

Every test names the mutant it catches; each was checked by applying the
mutant and seeing the test fail. Plus golden values, worked out by hand, for
`transition_std` and `gaussian_kl` (until now pinned only through GRPO's SGD test).
"""

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

from engine.adaptive import RowCache
from engine.sampling import flow_timesteps, gaussian_kl, transition_std
from flywheel.advantages import reward_advantages
from flywheel.recipe.policy import Policy
from flywheel.recipe.update import GradientSteps
from flywheel.sync.transport import tensor_checksums, verify_checksums
from trainers import grpo
from trainers.dpo import preference_pairs


# ---- the adaptive loop: threshold 0 never skips, even when the velocity repeats ------------------------


def test_a_threshold_zero_row_calls_the_model_even_when_its_velocity_repeats():
    """Mutant: `change <= threshold` (a row whose velocity did not change has estimated change 0 <= 0)."""
    row = RowCache()
    row.record_call(1.0, None, None, None)
    row.record_call(0.8, 0.0, 0.0, None)  # the velocity repeated exactly: rate 0
    assert row.estimated_change(0.5) == 0.0
    assert not row.should_skip(0.5, 0.0)  # threshold 0 = never skip
    assert row.should_skip(0.5, 1e-9)  # any positive threshold lets a constant velocity be reused


# ---- sum_of_advantages: the clip applies to the sum -------------------------------------------------------


def test_sum_of_advantages_clips_the_sum_not_each_scorer():
    """Mutant: clip each scorer's advantages before summing them."""
    group_ids = torch.zeros(3, dtype=torch.long)
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([10.0, 20.0, 30.0])
    valid = torch.ones(3, dtype=torch.bool)
    # Each scorer alone: (r - mean) / population std = [-1.2247, 0, 1.2247]; their sum [-2.449, 0, 2.449].
    adv, usable = reward_advantages({"a": a, "b": b}, {"a": 1.0, "b": 1.0}, a + b, valid, group_ids,
                                    mode="sum_of_advantages", clip=2.0)
    # Clip 2: the sum is cut to [-2, 0, 2]; clipping each first would leave each at 1.2247, their sum at 2.449.
    torch.testing.assert_close(adv, torch.tensor([-2.0, 0.0, 2.0]))
    adv, _ = reward_advantages({"a": a, "b": b}, {"a": 1.0, "b": 1.0}, a + b, valid, group_ids,
                               mode="sum_of_advantages", clip=1.0)
    # Clip 1: the sum is cut to [-1, 0, 1], where clipping each first would give [-2, 0, 2].
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0]))
    # Opposed scorers (b reversed, weight 0.5): the sum -1.2247 + 0.5·1.2247 = -0.612 is within clip 1 and stays;
    # clipping each first (to -1 and 1) would give -1 + 0.5 = -0.5, whether or not the sum is clipped again.
    opposed, _ = reward_advantages({"a": a, "b": b.flip(0)}, {"a": 1.0, "b": 0.5}, a + 0.5 * b.flip(0), valid,
                                   group_ids, mode="sum_of_advantages", clip=1.0)
    torch.testing.assert_close(opposed, torch.tensor([-0.6123724, 0.0, 0.6123724]), rtol=1e-4, atol=1e-4)
    unclipped, _ = reward_advantages({"a": a, "b": b}, {"a": 1.0, "b": 1.0}, a + b, valid, group_ids,
                                     mode="sum_of_advantages", clip=None)
    torch.testing.assert_close(unclipped, torch.tensor([-2.0, 0.0, 2.0]) * math.sqrt(1.5), rtol=1e-4, atol=1e-4)
    assert usable.all()


# ---- GRPO: the trained steps are drawn anew each training step -------------------------------------------


class _Drawn(Exception):
    """Raised by the stand-in for trained_mask: the update has drawn its steps, nothing more is needed."""


def test_grpo_draws_a_different_subset_of_steps_at_each_training_step(monkeypatch):
    """Mutant: the draw with timestep_fraction < 1 seeded without the step (every step trains one subset)."""
    drawn = []

    def record(traj, steps):
        drawn.append(tuple(steps))
        raise _Drawn

    monkeypatch.setattr(grpo, "trained_mask", record)
    traj = SimpleNamespace(sampler="sde", timesteps=flow_timesteps(10), row_noise_levels=torch.full((2, 10), 0.7))
    batch = SimpleNamespace(trajectory=traj)
    cfg = SimpleNamespace(seed=0, train=SimpleNamespace(timestep_fraction=0.3, timestep_selection="random"))
    for step in (0, 1, 2, 3, 4, 5, 0):
        with pytest.raises(_Drawn):
            grpo.GRPO(Policy(None, [], None, {}), None, None, cfg, None).update(batch, step)
    assert all(len(d) == 3 for d in drawn)  # round(0.3·10) of the 10 stochastic steps
    assert drawn[-1] == drawn[0]  # a function of (seed, step): a resumed step draws the same
    assert len(set(drawn[:6])) >= 4  # six steps train several different subsets (C(10, 3) = 120 of them)


# ---- DPO: ties at the worst row go to the first one -----------------------------------------------------


def test_best_worst_breaks_ties_at_both_ends_toward_the_first_row():
    """Mutant: the worst row's tie-break reversed (the last of the tied rows)."""
    rewards = torch.tensor([0.5, 0.1, 0.9, 0.1, 0.9])
    pairs = preference_pairs(rewards, torch.ones(5, dtype=torch.bool), torch.zeros(5, dtype=torch.long),
                             "best_worst")
    assert (pairs.winners.tolist(), pairs.losers.tolist()) == ([2], [1])


# ---- gradient accumulation: no all-reduce until the last backward of an optimizer step --------------------


class RecordingAccelerator:
    """Stands in for accelerate's Accelerator and a DDP module: DDP decides at the forward whether the backward
    that follows all-reduces (outside no_sync), so `forward` records that, and `backward` checks that it runs
    in the same context as its forward."""

    def __init__(self):
        self.all_reduced: list[bool] = []
        self._no_sync = False

    @contextlib.contextmanager
    def no_sync(self, model):
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        self.all_reduced.append(not self._no_sync)
        return value

    def backward(self, loss):
        assert self.all_reduced[-1] == (not self._no_sync), "a backward outside its forward's sync context"
        loss.backward()

    def clip_grad_norm_(self, params, max_norm):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


def test_gradients_are_all_reduced_once_per_optimizer_step_under_accumulation():
    """Mutants: no_sync dropped, so DDP all-reduces after every backward (a performance bug); no_sync around the
    backward alone, which DDP ignores (it decided at the forward), so every backward all-reduced too, and ranks
    that ran different numbers of them mismatched their collectives."""
    weight = torch.nn.Parameter(torch.ones(3))
    accelerator = RecordingAccelerator()
    oc = SimpleNamespace(minibatch_size=2, gradient_accumulation_steps=2, updates_per_rollout=None,
                         max_grad_norm=1e9)
    grads = GradientSteps(accelerator, None, torch.optim.SGD([weight], lr=0.1), [("w", weight)], oc, step=0)
    k = 3  # loss terms per minibatch (timesteps, say)
    for m, rows in enumerate(grads.minibatches(8)):  # 4 minibatches, 2 per optimizer step
        for i in range(k):
            with grads.microstep(m, last_of_minibatch=i == k - 1):
                loss = accelerator.forward((weight * (m + i + 1)).sum())
                grads.backward(loss / grads.backwards_per_step(k))
        grads.maybe_step(m)
    # 12 forward-backwards; only the last of each optimizer step's 6 all-reduces.
    assert accelerator.all_reduced == [False] * 5 + [True] + [False] * 5 + [True]
    assert grads.metrics()["train/optimizer_steps"] == 2


# ---- weight sync: the receiver's checksums must name the same tensors -----------------------------------


def test_checksum_verification_refuses_an_unexpected_tensor_name():
    """Mutant: verify_checksums ignoring names the receiver has and the sender did not send."""
    sent = tensor_checksums({"a": torch.ones(2), "b": torch.zeros(3)})
    verify_checksums(sent, dict(sent))
    with pytest.raises(RuntimeError, match=r"1 unexpected \['stray'\]"):
        verify_checksums(sent, {**sent, "stray": sent["a"]})


# ---- transition_std and gaussian_kl: golden values by hand -----------------------------------------------


def test_transition_std_golden_values():
    t = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    # Flow-SDE, a = 0.5, t_cap = t_1 = 0.75: sigma = a·sqrt(t / (1 - min(t, 0.75))), std = sigma·sqrt(t - t_next)
    # step 0: 0.5·sqrt(1 / 0.25) = 1 -> 1·0.5 = 0.5;  step 1: 0.5·sqrt(3) -> 0.4330127
    # step 2: 0.5·1 -> 0.25;                            step 3: 0.5·sqrt(1/3) -> 0.1443376
    sde = transition_std("sde", t, torch.full((4,), 0.5))
    torch.testing.assert_close(sde, torch.tensor([0.5, 0.4330127, 0.25, 0.1443376]))
    # Per row [B, T], a step at noise level 0 (outside the SDE window) is deterministic: std 0.
    rows = transition_std("sde", t, torch.tensor([[0.5, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(rows, torch.tensor([[0.5, 0.4330127, 0.0, 0.1443376], [0.0, 0.0, 0.0, 0.0]]))
    # CPS, eta = 0.5: t_next·sin(pi/4) -> 0.75, 0.5, 0.25, 0 times 0.7071068 (the last step is deterministic).
    cps = transition_std("cps", t, torch.full((4,), 0.5))
    torch.testing.assert_close(cps, torch.tensor([0.5303301, 0.3535534, 0.1767767, 0.0]))
    with pytest.raises(ValueError, match="valid samplers: ode, sde, cps"):
        transition_std("ddim", t, torch.full((4,), 0.5))


def test_gaussian_kl_golden_values():
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    ref = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    # One variance 0.5: row 0 mean((1, 4)) / (2·0.5) = 2.5; row 1 mean((0, 1)) / 1 = 0.5.
    torch.testing.assert_close(gaussian_kl(mean, ref, 0.5), torch.tensor([2.5, 0.5]))
    # Per element [0.5, 2]: row 0 (1 / 1 + 4 / 4) / 2 = 1; row 1 (0 + 1 / 4) / 2 = 0.125.
    torch.testing.assert_close(gaussian_kl(mean, ref, torch.tensor([0.5, 2.0])), torch.tensor([1.0, 0.125]))
    # Per element [0.5, 0]: the deterministic element is left out: row 0 1 / 1 = 1; row 1 0.
    torch.testing.assert_close(gaussian_kl(mean, ref, torch.tensor([0.5, 0.0])), torch.tensor([1.0, 0.0]))
