"""The flywheel: prompts -> rollouts -> rewards -> group advantages, and evaluation.

An algorithm consumes a `RolloutBatch` (through its own `update(batch)`) and
the recipe calls `Flywheel.sync()` after each optimizer step. The global batch
of a step is prompts_per_step x group_size samples; rank r generates rows
[r·n, (r+1)·n), so a prompt's group may span ranks, and every sample's seed is
a function of (seed, step, global row) alone: the same run on 1 or 2 ranks
draws the same samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine import Engine, GenerationRequest, Trajectory
from flywheel.advantages import distributed_group_advantages
from flywheel.distributed import rank_and_world
from flywheel.prompts import PromptItem, PromptSampler
from flywheel.sync import WeightSyncController
from rewards import RewardBatch, RewardSet


@dataclass
class RolloutBatch:
    """This rank's share of one step: trajectories, their rewards and advantages."""

    trajectory: Trajectory
    rewards: RewardBatch
    advantages: torch.Tensor
    usable: torch.Tensor
    group_ids: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def sample_seed(seed: int, step: int, row: int) -> int:
    """A rollout seed that depends only on the run seed, the step and the global row."""
    return (seed * 1_000_003 + step * 100_003 + row) % (2**63)


def group_diversity(images: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Mean per-pixel std of images within each group (0 = every sample alike)."""
    stds = []
    for g in torch.unique(group_ids):
        members = images[group_ids == g]
        if members.shape[0] > 1:
            stds.append(members.float().std(dim=0, correction=0).mean())
    return float(torch.stack(stds).mean()) if stds else float("nan")


class Flywheel:
    """Generates, scores and ranks the samples of a step on this rank."""

    def __init__(self, engine: Engine, rewards: RewardSet, sampler: PromptSampler, sync: WeightSyncController,
                 group_size: int, request_kwargs: dict, seed: int = 0, adv_clip: float | None = None):
        rank, world = rank_and_world()
        global_batch = sampler.prompts_per_step * group_size
        if global_batch % world:
            raise ValueError(f"prompts_per_step x group_size = {global_batch} must be divisible by the "
                             f"number of processes ({world})")
        self.engine, self.rewards, self.sampler, self.sync_controller = engine, rewards, sampler, sync
        self.group_size, self.request_kwargs, self.seed, self.adv_clip = group_size, request_kwargs, seed, adv_clip
        self.rank, self.world = rank, world
        self.local_batch = global_batch // world

    def set_rewards(self, rewards: RewardSet) -> None:
        """Swap the reward between steps."""
        self.rewards = rewards

    def collect(self, step: int) -> RolloutBatch:
        """Roll out, score and compute advantages for this rank's rows of step `step`."""
        items = self.sampler.batch(step)
        rows = range(self.rank * self.local_batch, (self.rank + 1) * self.local_batch)
        requests = [self._request(items[row // self.group_size], sample_seed(self.seed, step, row)) for row in rows]
        group_ids = torch.tensor([row // self.group_size for row in rows])

        t0 = time.perf_counter()
        trajectory = self.engine.generate(requests)
        t1 = time.perf_counter()
        rewards = self.rewards.score(trajectory.images, trajectory.prompts, trajectory.metadata,
                                     trajectory.weight_version)
        t2 = time.perf_counter()
        advantages, usable = distributed_group_advantages(rewards.total, group_ids, rewards.valid,
                                                          clip=self.adv_clip)
        metrics = {"time/rollout_s": t1 - t0, "time/reward_s": t2 - t1,
                   "diversity": group_diversity(trajectory.images, group_ids),
                   "weight_version": trajectory.weight_version, **rewards.metrics()}
        return RolloutBatch(trajectory, rewards, advantages.to(trajectory.latents.device),
                            usable.to(trajectory.latents.device), group_ids, metrics)

    def _request(self, item: PromptItem, seed: int, **overrides) -> GenerationRequest:
        kwargs = {**self.request_kwargs, **overrides}
        return GenerationRequest(prompt=item.prompt, seed=seed, card=self.engine.card_id,
                                 metadata=item.metadata, **kwargs)

    def sync(self) -> dict[str, float]:
        """Push the trainer's weights to the engine (freeze, drain, transfer, bump, resume)."""
        return self.sync_controller.sync()

    def evaluate(self, items: list[PromptItem], seeds_per_prompt: int, eval_kwargs: dict,
                 judges: dict | None = None) -> tuple[dict[str, float], Trajectory]:
        """Evaluate the engine's current weights with this flywheel's rewards (see `evaluate`)."""
        return evaluate(self.engine, self.rewards, items, seeds_per_prompt, {**self.request_kwargs, **eval_kwargs},
                        judges)


EVAL_SEED_OFFSET = 10_000  # evaluation seeds never coincide with the first training rows


@torch.no_grad()
def evaluate(engine: Engine, rewards: RewardSet, items: list[PromptItem], seeds_per_prompt: int,
             request_kwargs: dict, judges: dict | None = None) -> tuple[dict[str, float], Trajectory]:
    """Samples of `items` at fixed seeds; eval/reward/* and eval/judge/* metrics, and the trajectory.

    The same prompts, seeds and sampler every time, so evaluations at different
    steps (and of the base model by the pretraining script) are comparable.
    """
    requests = [GenerationRequest(prompt=item.prompt, seed=EVAL_SEED_OFFSET + s, card=engine.card_id,
                                  metadata=item.metadata, **request_kwargs)
                for item in items for s in range(seeds_per_prompt)]
    trajectory = engine.generate(requests)
    scored = rewards.score(trajectory.images, trajectory.prompts, trajectory.metadata, trajectory.weight_version)
    metrics = scored.metrics(prefix="eval/reward")
    for name, judge in (judges or {}).items():
        scores = judge(trajectory.images, trajectory.prompts, trajectory.metadata)
        metrics[f"eval/judge/{name}/mean"] = float(torch.nanmean(scores.float()))
    return metrics, trajectory
