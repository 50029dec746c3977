"""Swapping rewards in a running flywheel, scoring that overlaps rollout, and a reward chosen on the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flywheel.rollout_collector import Flywheel
from flywheel.prompts import PromptItem, PromptSampler
from rewards import RewardSet

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [PromptItem("zero", {"digit": 0}), PromptItem("one", {"digit": 1}), PromptItem("two", {"digit": 2})]


def make_flywheel(engine, reward_set, **kwargs) -> Flywheel:
    return Flywheel(engine, reward_set, PromptSampler(PROMPTS, prompts_per_step=3, seed=0),
                    4,
                    request_kwargs=dict(steps=3, sampler="sde", noise_level=0.7), seed=1, **kwargs)


def test_set_rewards_between_steps_and_metrics_follow_the_new_scorers(toy_engine):
    wheel = make_flywheel(toy_engine, RewardSet("digit_alignment:1.0"))
    first = wheel.collect(0)
    assert "reward/digit_alignment/mean" in first.metrics
    wheel.set_rewards("jpeg_compressibility:1.0,jpeg_incompressibility:0.5", mode="sum_of_advantages")
    second = wheel.collect(1)
    assert second.rewards.scorer_ids == ["jpeg_compressibility", "jpeg_incompressibility"]
    assert second.rewards.mode == "sum_of_advantages"
    assert "reward/jpeg_compressibility/mean" in second.metrics
    assert not any(k.startswith("reward/digit_alignment") for k in second.metrics)
    sizes = second.rewards.scores["jpeg_incompressibility"]
    assert second.metrics["reward/jpeg_incompressibility/mean"] == pytest.approx(sizes.mean().item())
    # A RewardSet object works too, and evaluation scores with the current set.
    wheel.set_rewards(RewardSet("digit_alignment"))
    metrics, _ = wheel.eval_samples(PROMPTS[:1], 2, {"sampler": "ode"})
    assert "eval/reward/digit_alignment/mean" in metrics and "eval/reward/jpeg_compressibility/mean" not in metrics


def test_overlapped_scoring_is_identical_to_scoring_in_line(toy_engine):
    spec = "digit_alignment:1.0,jpeg_compressibility:0.1"
    inline = make_flywheel(toy_engine, RewardSet(spec), rollout_chunk_size=4).collect(2)
    overlapped_wheel = make_flywheel(toy_engine, RewardSet(spec), overlap_scoring=True, rollout_chunk_size=4)
    overlapped = overlapped_wheel.collect(2)
    overlapped_wheel.close()
    assert torch.equal(inline.trajectory.images, overlapped.trajectory.images)
    assert torch.equal(inline.trajectory.log_probs, overlapped.trajectory.log_probs)
    for name in inline.rewards.scorer_ids:
        assert torch.equal(inline.rewards.scores[name], overlapped.rewards.scores[name])
    assert torch.equal(inline.rewards.total, overlapped.rewards.total)
    assert torch.equal(inline.advantages, overlapped.advantages) and torch.equal(inline.usable, overlapped.usable)
    # And the same samples as one unchunked engine call (up to batch-size rounding of the matmuls).
    whole = make_flywheel(toy_engine, RewardSet(spec)).collect(2)
    assert whole.trajectory.seeds == overlapped.trajectory.seeds
    torch.testing.assert_close(whole.rewards.total, overlapped.rewards.total, atol=1e-4, rtol=1e-4)


def test_scoring_really_runs_while_the_next_chunk_generates(toy_engine):
    generating = [threading.Event() for _ in range(3)]
    seen: list[tuple[bool, str]] = []

    class Watcher:
        """Scores chunk k only after seeing whether chunk k+1's generation has started."""

        def __init__(self):
            self.calls = 0
            self.seconds = 0.0  # the time spent inside this scorer, measured by itself

        def __call__(self, images, prompts, metadata):
            start = time.perf_counter()
            k, self.calls = self.calls, self.calls + 1
            nxt = generating[k + 1] if k + 1 < len(generating) else None
            seen.append((nxt.wait(timeout=10) if nxt else True, threading.current_thread().name))
            time.sleep(0.05)  # every call takes a clearly measurable time, the last one too
            self.seconds += time.perf_counter() - start
            return images.float().mean(dim=(1, 2, 3))

    wheel = make_flywheel(toy_engine, RewardSet("jpeg_compressibility"), overlap_scoring=True, rollout_chunk_size=4)
    watcher = Watcher()
    wheel.rewards.scorers["jpeg_compressibility"] = watcher
    original, chunk = toy_engine.generate, [0]

    def generate(requests):
        generating[chunk[0]].set()
        chunk[0] += 1
        return original(requests)

    toy_engine.generate = generate
    try:
        start = time.perf_counter()
        batch = wheel.collect(0)
        collect_s = time.perf_counter() - start
    finally:
        del toy_engine.generate
        wheel.close()
    assert len(seen) == 3 and all(overlapped for overlapped, _ in seen)
    assert all(name.startswith("flywheel-score") for _, name in seen)
    assert batch.rewards.valid.all()
    # reward_busy_s is the scorer's own time over all three chunks, plus RewardSet.score's small
    # bookkeeping (the 0.5 s allowance is for a loaded machine), and never more than the whole collect.
    busy = batch.metrics["time/reward_busy_s"]
    assert watcher.calls == 3 and watcher.seconds >= 3 * 0.05
    assert watcher.seconds <= busy <= min(watcher.seconds + 0.5, collect_s), (busy, watcher.seconds, collect_s)


def test_rollout_chunk_size_is_checked(toy_engine):
    with pytest.raises(ValueError, match="rollout_chunk_size"):
        make_flywheel(toy_engine, RewardSet("digit_alignment"), rollout_chunk_size=0)


def test_cli_reward_choice_trains_the_toy_flywheel_to_raise_it(tmp_path):
    """`python trainers/grpo.py reward.scorers=jpeg_compressibility:1.0 ...` raises the JPEG-compressibility reward."""
    run_dir = tmp_path / "jpeg"
    cmd = [sys.executable, str(ROOT / "trainers" / "grpo.py"), "reward.scorers=jpeg_compressibility:1.0",
           f"run_dir={run_dir}", "tracker=none", "steps=10", "data.prompts_per_step=4", "data.group_size=8",
           "train.timestep_fraction=0.5", "sampling.steps=6", "train.learning_rate=3e-3", "train.kl_beta=0", "train.log_kl=false",
           "eval.seeds=1", "eval.every=1000", "sample_every=1000", "save_every=1000",
           "rollout.overlap_scoring=true"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward/jpeg_compressibility/mean" in r]
    assert len(train) == 10 and not any("reward/digit_alignment/mean" in r for r in rows)
    curve = torch.tensor([r["reward/jpeg_compressibility/mean"] for r in train], dtype=torch.float64)
    # Smaller JPEG files: the step-mean reward trends up. The trend is slow on this toy (about 1e-3 a
    # step, within-step spread 3e-3), so the test asks for a least-squares slope that is positive at
    # more than 3 standard errors, not for a fixed jump that depends on the rollout seeds' luck.
    x = torch.arange(len(curve), dtype=torch.float64)
    x = x - x.mean()
    slope = float((x * (curve - curve.mean())).sum() / (x * x).sum())
    residual = curve - curve.mean() - slope * x
    stderr = float(torch.sqrt((residual**2).sum() / (len(curve) - 2) / (x * x).sum()))
    assert slope > 3 * stderr, (slope, stderr, curve.tolist())
