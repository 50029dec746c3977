"""DRaFT-K / DRaFT-LV / ReFL (trainers/draft.py): golden gradients on a tiny case, the loss, config checks (the
non-differentiable reward refused before the run dir exists), learning and its negated control, exact resume,
two ranks."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from flywheel.runs.config import ConfigError, parse_config
from flywheel.runs.rundir import read_metrics
from trainers.draft import (Config, DraftConfig, draft_loss, grad_paths, one_step_x0, truncated_ode, validate_config,
                            velocity_distance)
from trainers.draft import main

from recipe_kill import checkpoint, without_timings
from launched import run_process_group

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["tracker=none", "eval.seeds=2", "save_every=1000", "sample_every=1000"]
# A small batch (4 prompts x 8) and few denoising steps: about a second a step on one thread.
SMALL = ["data.prompts_per_step=4", "data.group_size=8", "sampling.steps=6"]
GRID = torch.tensor([1.0, 0.6, 0.3, 0.0], dtype=torch.float64)  # a 3-step rollout's times


def run(tmp_path, name, *overrides):
    result = main([f"run_dir={tmp_path / name}", *QUICK, *overrides])
    return result, read_metrics(tmp_path / name / "metrics.jsonl")


def config_problems(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(parse_config(Config, list(overrides)))
    return str(err.value)


class Linear(torch.nn.Module):
    """v_a(x, t) = a·x: the Euler chain is then a product of (1 + dt·a) factors, differentiable by hand."""

    def __init__(self, a: float):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a, dtype=torch.float64))

    def forward(self, x, t):
        return self.a * x


# ---- golden gradients on a tiny case --------------------------------------------------------------------


@pytest.mark.parametrize("checkpointed", [True, False])
def test_draft_1_and_2_gradients_are_the_hand_derived_ones(checkpointed):
    # Loss mean (x_T - c)^2 (a reward r = -(x - c)^2, scale 1), x_T from the rollout's state by K Euler steps.
    x, c, a = torch.tensor([[0.5], [-1.2]], dtype=torch.float64), 0.3, 0.7
    model = Linear(a)
    # K = 1 from x_2 (t = 0.3): x_3 = x·(1 - 0.3a), d x_3 / da = -0.3·x.
    x3, visited = truncated_ode(model, x, GRID, first=2, checkpointed=checkpointed)
    assert len(visited) == 1 and torch.allclose(x3, x * (1 - 0.3 * a))
    ((x3 - c) ** 2).mean().backward()
    expected = (2 * (x * (1 - 0.3 * a) - c) * (-0.3 * x)).mean()
    assert model.a.grad == pytest.approx(float(expected), rel=1e-12)
    # K = 2 from x_1 (t = 0.6): x_3 = x·(1 - 0.3a)^2, d x_3 / da = -0.6·x·(1 - 0.3a).
    model.a.grad = None
    x3, visited = truncated_ode(model, x, GRID, first=1, checkpointed=checkpointed)
    assert len(visited) == 2 and torch.allclose(x3, x * (1 - 0.3 * a) ** 2)
    ((x3 - c) ** 2).mean().backward()
    expected = (2 * (x * (1 - 0.3 * a) ** 2 - c) * (-0.6 * x * (1 - 0.3 * a))).mean()
    assert model.a.grad == pytest.approx(float(expected), rel=1e-12)


def test_checkpointing_gives_the_same_gradient_and_finite_differences_agree():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()

    def velocity(x, t):
        return net(torch.cat([x, t.expand(x.shape[0], 1)], dim=1))

    x = torch.randn(4, 2, dtype=torch.float64)
    target = torch.tensor([0.5, -0.5], dtype=torch.float64)

    def loss(checkpointed: bool):
        out, _ = truncated_ode(velocity, x, GRID, first=1, checkpointed=checkpointed)  # K = 2
        return ((out - target) ** 2).sum(1).mean()

    grads = []
    for checkpointed in (True, False):
        net.zero_grad()
        loss(checkpointed).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for g_on, g_off in zip(*grads):
        assert torch.equal(g_on, g_off)
    # Central differences on one weight: the chain's gradient is the real one.
    w = net[0].weight
    h = 1e-6
    with torch.no_grad():
        w[1, 0] += h
        up = loss(False)
        w[1, 0] -= 2 * h
        down = loss(False)
        w[1, 0] += h
    assert float(grads[0][0][1, 0]) == pytest.approx(float((up - down) / (2 * h)), rel=1e-6)


def test_checkpointed_steps_hold_a_latent_each_not_the_forwards_activations():
    # What the forward keeps for backward, counted by a saved-tensors hook: with checkpointing each extra step adds
    # its input latent (and t) only, however wide the velocity network; without it, the whole forward's activations.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(9, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))
    grid = torch.linspace(1, 0, 9)

    def saved_bytes(k: int, checkpointed: bool) -> int:
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            truncated_ode(lambda x, t: net(torch.cat([x, t.expand(x.shape[0], 1)], 1)), torch.randn(16, 8), grid,
                          8 - k, checkpointed)
        return total[0]

    latent = 16 * 8 * 4
    per_step_on = (saved_bytes(8, True) - saved_bytes(1, True)) / 7
    per_step_off = (saved_bytes(8, False) - saved_bytes(1, False)) / 7
    assert per_step_on <= 1.1 * latent  # the step's input latent (512 bytes) and its time
    assert per_step_off > 50 * latent  # the 16 x 512 hidden activations and more


def test_refl_and_lv_predict_x0_in_one_step_with_per_row_times():
    model = Linear(0.5)
    x_t = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    t = torch.tensor([0.3, 0.6], dtype=torch.float64)
    x0, visited = one_step_x0(model, x_t, t)
    assert torch.allclose(x0, torch.tensor([[1 - 0.15], [2 * (1 - 0.3)]], dtype=torch.float64))
    x0.sum().backward()  # d/da of x·(1 - t·a) = -t·x
    assert float(model.a.grad) == pytest.approx(-(0.3 * 1.0 + 0.6 * 2.0))
    assert len(visited) == 1 and torch.equal(visited[0][1], t)


class Traj:
    """The parts of a Trajectory the grad paths read."""

    def __init__(self, latents, timesteps):
        self.latents, self.timesteps = latents, timesteps

    def __len__(self):
        return self.latents.shape[0]


def test_grad_paths_start_where_each_mode_says():
    latents = torch.arange(2 * 4, dtype=torch.float64).reshape(2, 4, 1) + 1.0  # [B, T+1, 1], distinct states
    traj = Traj(latents, GRID)
    seen = []

    def velocity(x, t):
        seen.append((x.clone(), t.clone()))
        return torch.zeros_like(x)

    generator = torch.Generator().manual_seed(0)
    (x, visited, _), = grad_paths(traj, velocity, DraftConfig(truncation_steps=2), generator)
    assert torch.equal(seen[0][0], latents[:, 1]) and torch.equal(x, latents[:, 1])  # v = 0: stays
    assert [float(t) for _, t, _ in visited] == [0.6, 0.3]
    seen.clear()
    paths = grad_paths(traj, velocity, DraftConfig(lv_samples=3), torch.Generator().manual_seed(5))
    twin = torch.Generator().manual_seed(5)
    assert len(paths) == 3 and all(float(t) == 0.3 for _, t in seen)
    for x_t, _ in seen:  # x_t = (1 - t)·x_T + t·eps, a fresh eps per draw, t the last step's time
        eps = torch.randn(latents[:, -1].shape, generator=twin, dtype=torch.float32).double()
        assert torch.allclose(x_t, 0.7 * latents[:, -1] + 0.3 * eps)
    seen.clear()
    grad_paths(traj, velocity, DraftConfig(mode="refl", refl_window=(0.5, 1.0)), generator)
    (x_j, t_j), = seen
    for row in range(2):  # steps int(0.5·3) = 1 .. 2: the row's own stored state at its drawn step
        index = [k for k in (1, 2) if torch.equal(latents[row, k], x_j[row])]
        assert index and float(t_j[row]) == float(GRID[index[0]])


def test_loss_is_minus_the_scaled_mean_valid_reward_plus_the_regularisers():
    reward = torch.tensor([0.2, 0.6, float("nan")])
    valid = torch.isfinite(reward)
    loss, stats = draft_loss(reward, valid, reward_scale=2.0)
    assert float(loss) == pytest.approx(-0.8) and float(stats["draft/reward"]) == pytest.approx(0.4)
    assert float(stats["draft/valid_samples"]) == 2 and "ref_mse" not in stats
    loss, stats = draft_loss(reward, valid, 1.0, kl=torch.tensor(0.5), kl_beta=0.1, anchor=torch.tensor(2.0),
                             anchor_beta=0.01)
    assert float(loss) == pytest.approx(-0.4 + 0.05 + 0.02)
    assert float(stats["ref_mse"]) == 0.5 and float(stats["anchor_mse"]) == 2.0
    v = torch.tensor([[1.0, 2.0]], requires_grad=True)
    distance = velocity_distance([(None, None, v)], lambda x, t: torch.tensor([[0.0, 4.0]]))
    assert float(distance.detach()) == pytest.approx((1 + 4) / 2)


# ---- config -------------------------------------------------------------------------------------------


class SqrtOfMinusForSevens:
    """A differentiable scorer NaN, with a NaN derivative, on the rows that prompt a 7: sqrt of a negative."""

    differentiable = True

    def __call__(self, images, prompts, metadata):
        s = images.flatten(1).mean(1)
        sevens = torch.tensor(["7" in p for p in prompts])
        return torch.sqrt(torch.where(sevens, -1 - s, s))


def test_a_row_scored_nan_gives_no_gradient_and_the_others_train_as_without_it():
    from trainers.draft import DifferentiableReward

    reward = DifferentiableReward({"sqrt": SqrtOfMinusForSevens()}, {"sqrt": 2.0})
    base = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0)) + 0.1
    images = base.clone().requires_grad_(True)
    total, valid, _ = reward(images, ["a 1", "a 7", "a 3", "a 7"], [{}] * 4)
    loss, stats = draft_loss(total, valid, reward_scale=1.0)
    loss.backward()
    assert valid.tolist() == [True, False, True, False] and stats["draft/valid_samples"] == 2
    assert torch.isfinite(images.grad).all()  # was NaN on the sevens' rows: a NaN gradient norm stopped the run
    assert not images.grad[[1, 3]].any()
    kept = base[[0, 2]].clone().requires_grad_(True)  # the valid rows alone
    total, valid, _ = reward(kept, ["a 1", "a 3"], [{}] * 2)
    draft_loss(total, valid, reward_scale=1.0)[0].backward()
    torch.testing.assert_close(images.grad[[0, 2]], kept.grad, rtol=0, atol=0)


@pytest.mark.parametrize("override, named", [
    ("train.truncation_steps=0", "train.truncation_steps=0: must be in [1, sampling.steps=10]"),
    ("train.truncation_steps=11", "train.truncation_steps=11"),
    ("train.lv_samples=2 train.truncation_steps=2", "DRaFT-LV is a variant of DRaFT-1"),
    ("train.reward_scale=0", "train.reward_scale=0.0: must be a finite number other than 0"),
    ("train.kl_beta=-1", "train.kl_beta=-1.0: must be >= 0"),
    ("train.anchor_decay=1", "train.anchor_decay=1.0: must be in [0, 1)"),
    ("train.anchor_beta=0.5 train.anchor_decay_ramp=0", "train.anchor_decay_ramp=0 with train.anchor_beta=0.5 and "
                                                        "one optimizer step a rollout"),
    ("train.mode=refl train.refl_window=[0.95,0.99]", "holds no step of a 10-step rollout"),
    ("sampling.sampler=sde", "sampling.sampler='sde': must be ode"),
    ("reward.aggregation=gdpo", "reward.aggregation='gdpo': must be weighted_sum"),
    ("rollout.asynchronous=true", "rollout.asynchronous=true: not supported by DRaFT"),
])
def test_each_bad_field_is_named_with_what_is_valid(override, named):
    assert named in config_problems(*override.split())


def test_a_non_differentiable_reward_is_refused_in_one_line_before_the_run_dir_exists(tmp_path):
    message = config_problems("reward.scorers=digit_alignment:1.0,jpeg_compressibility:0.1")
    line = next(line for line in message.splitlines() if "jpeg_compressibility" in line)
    assert "jpeg_compressibility is not differentiable" in line
    assert "differentiable scorers: aesthetic, clip_score, digit_alignment, number_alignment, pickscore" in line
    assert "digit_alignment is" not in line  # only the offending one is named as such
    with pytest.raises(ConfigError, match="ocr is not differentiable"):
        main([f"run_dir={tmp_path / 'r'}", "tracker=none", "reward.scorers=ocr:1.0"])
    assert not (tmp_path / "r").exists()
    assert "remote:http://127.0.0.1:9/score) is not differentiable" in config_problems(
        "reward.scorers=judge=remote:http://127.0.0.1:9/score")


class DetachingScorer:
    """A plugin that claims differentiable = True and breaks the graph."""

    name = "claims_grad"
    differentiable = True

    def __call__(self, images, prompts, metadata):
        return images.detach().flatten(1).mean(1)


def test_a_scorer_that_claims_gradients_and_detaches_is_named(tmp_path):
    from rewards.registry import register, unregister

    register("claims_grad", DetachingScorer)
    try:
        with pytest.raises(RuntimeError, match="'claims_grad' declares differentiable = True but its scores carry no"):
            main([f"run_dir={tmp_path / 'r'}", *QUICK, *SMALL, "steps=1", "reward.scorers=claims_grad:1.0"])
    finally:
        unregister("claims_grad")


class FlatValuedScorer:
    """0.5 for every sample, with digit_alignment's gradient: every group is flat, every sample has a gradient."""

    name = "flat_value"
    differentiable = True

    def __init__(self):
        from rewards import get

        self.alignment = get("digit_alignment")

    def __call__(self, images, prompts, metadata):
        s = self.alignment(images, prompts, metadata)
        return s - s.detach() + 0.5


def test_flat_groups_train_since_draft_uses_no_advantages(tmp_path):
    from rewards.registry import register, unregister

    register("flat_value", FlatValuedScorer)
    # Skipped as "flat groups: no advantage to learn from" before, and reward.max_flat_steps ended the run (the key
    # is refused for DRaFT now: tests/test_checks_before_work.py).
    try:
        result, rows = run(tmp_path, "flat", *SMALL, "steps=2", "eval.every=1000", "reward.scorers=flat_value:1.0")
    finally:
        unregister("flat_value")
    steps = [r for r in rows if "train/optimizer_steps" in r]
    assert [r["train/optimizer_steps"] for r in steps] == [1.0, 1.0]
    assert all(r["reward/zero_std_groups"] == 4 and r["train/update_rel"] > 0 for r in steps)
    assert steps[-1]["train/skipped_steps"] == 0


def test_the_shipped_configs_parse_and_the_default_run_is_configs_toy_draft():
    defaults = parse_config(Config, [])
    assert parse_config(Config, ["--config", str(ROOT / "configs" / "toy_draft.yaml")]) == defaults
    validate_config(defaults)
    numbers = parse_config(Config, ["--config", str(ROOT / "configs" / "toy_numbers_draft.yaml")])
    validate_config(numbers)
    assert numbers.model.card == "toy-numbers" and numbers.reward.scorers.startswith("number_alignment")


# ---- the run --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_grad_path_lands_on_the_rollouts_samples_and_every_mode_trains(tmp_path):
    # One minibatch: the update re-runs the rollout's last step with the weights that made it, so the reward of
    # the grad path is the rollout's own reward (the same chain, bit for bit), before any optimizer step.
    _, rows = run(tmp_path, "k1", *SMALL, "steps=1", "eval.every=1")
    assert rows[1]["draft/reward"] == rows[1]["reward/mean"]
    assert rows[1]["loss"] == -rows[1]["draft/reward"] and rows[1]["grad_norm"] > 0
    assert rows[1]["draft/valid_samples"] == 32.0 and rows[1]["weight_version"] == 0
    assert json.loads((tmp_path / "k1" / "run.json").read_text())["recipe"] == "draft"
    # K = 3 through checkpointed steps and the same without checkpointing: the same numbers.
    _, on = run(tmp_path, "k3", *SMALL, "steps=1", "eval.every=1", "train.truncation_steps=3")
    _, off = run(tmp_path, "k3off", *SMALL, "steps=1", "eval.every=1", "train.truncation_steps=3",
                 "train.step_checkpointing=false")
    assert on[1]["draft/reward"] == on[1]["reward/mean"]
    assert without_timings(on) == without_timings(off)
    _, refl = run(tmp_path, "refl", *SMALL, "steps=1", "eval.every=1", "train.mode=refl", "train.kl_beta=0.1")
    assert refl[1]["grad_norm"] > 0 and refl[1]["ref_mse"] == 0.0  # the first forward is the reference's weights
    assert 0 < refl[1]["t/mean"] < 0.35  # late steps of the 6-step grid
    _, lv = run(tmp_path, "lv", *SMALL, "steps=1", "eval.every=1", "train.lv_samples=2", "train.anchor_beta=1")
    assert lv[1]["grad_norm"] > 0 and lv[1]["anchor_mse"] == 0.0 and "anchor/decay" in lv[1]


@pytest.mark.slow
def test_reward_and_judge_rise_and_the_negated_reward_falls(tmp_path):
    """An honest control: the same run minimising the reward (reward_scale = -1) goes the other way."""
    # No KL (the default's 0.1 slows a 10-step run): the control is about the reward's sign, measured without one.
    args = ["steps=10", "eval.every=10", "data.prompts_per_step=4", "train.learning_rate=2e-3", "train.kl_beta=0"]
    real, _ = run(tmp_path, "real", *args)
    control, _ = run(tmp_path, "negated", *args, "train.reward_scale=-1")
    base, base_judge = real["base"]["eval/reward/mean"], real["base"]["eval/judge/digit_svc/mean"]
    assert control["base"]["eval/reward/mean"] == base
    # Measured on one thread: reward 0.53 -> 0.85 (judge 0.58 -> 0.86), and 0.53 -> 0.09 with the sign flipped.
    assert real["final"]["eval/reward/mean"] > base + 0.2
    assert real["final"]["eval/judge/digit_svc/mean"] > base_judge + 0.15
    assert control["final"]["eval/reward/mean"] < base - 0.2


@pytest.mark.slow
def test_lora_trains_only_the_adapter(tmp_path):
    _, rows = run(tmp_path, "lora", *SMALL, "model.finetune=lora", "steps=2", "eval.every=2", "save_every=2",
                  "train.kl_beta=0.01", "train.truncation_steps=2")
    saved = checkpoint(tmp_path / "lora", 2)
    assert saved and all("lora_" in k for k in saved)
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in saved.items())
    assert rows[1]["ref_mse"] == 0.0 and rows[2]["ref_mse"] > 0.0  # B = 0 at first: the adapted model is the reference


@pytest.mark.slow
def test_two_processes_train_as_one(tmp_path):
    args = ["steps=2", "eval.every=1000", *SMALL]
    _, single = run(tmp_path, "one", *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29537",
           str(ROOT / "trainers" / "draft.py"), f"run_dir={tmp_path / 'two'}", *QUICK, *args]
    out = run_process_group(cmd, cwd=ROOT, env=env, timeout=300, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    double = read_metrics(tmp_path / "two" / "metrics.jsonl")
    # Step 1 rolls out the same weights on the same seeds; each rank's grad path reward is its half's.
    assert double[1]["reward/mean"] == pytest.approx(single[1]["reward/mean"], abs=1e-6)
    assert double[1]["draft/reward"] == pytest.approx(single[1]["draft/reward"], abs=1e-6)
    # After one DDP update (gradients averaged over the ranks) the weights agree to float rounding.
    assert double[2]["reward/mean"] == pytest.approx(single[2]["reward/mean"], abs=1e-3)
    assert double[2]["weight_version"] == 1
