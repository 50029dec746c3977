"""Where a recipe's samples come from: the engine, weight sync, rewards and the rollout collector.

The layout (colocated, a served copy, an engine process, a Ray pool; a workflow stage around any of them) is a
class of flywheel/recipe/layouts.py, chosen by its factory; this module holds what every layout shares
(`collect(step)`, `sync()`, `eval_samples(...)`, `close()`).
"""

from __future__ import annotations

import torch

from engine import Engine
from flywheel.prompts import PromptSampler, load_prompts
from flywheel.recipe.layouts import RayPool, WorkflowStage, make_layout
from flywheel.recipe.policy import Policy
from flywheel.config.sections import rollout_request_kwargs
from flywheel.rollout_collector import Flywheel, RolloutBatch, eval_samples
from flywheel.scale.config import build_rewards
from flywheel.sync.async_rollouts import AsyncCollector
from flywheel.video import MiddleFrameRewards


class Rollouts:
    """The engine and the flywheel of a run; `sync()` moves weights into serving and bumps the version."""

    def __init__(self, cfg, accelerator, policy: Policy, version: int, trainer_state: dict,
                 serve: str = "colocated"):
        """serve="swapped": the engine serves the trained module with the recipe's sampling weights swapped in
        by its `serving_weights()` (a recipe whose sampling policy is not the trained one; `layouts.SwappedIn`)."""
        self.policy = policy
        self.collector: AsyncCollector | None = None
        self.pools = []  # Ray actor pools (flywheel.scale): their per-replica metrics go into each row
        self.layout = make_layout(cfg, serve)  # refuses options that do not combine (layouts.INCOMPATIBLE)
        self.engine, self.controller = self.layout.build(cfg, accelerator, policy, version)
        if isinstance(self.layout, RayPool):
            self.pools.append(self.engine)
        rewards = build_rewards(cfg.rollout, cfg.reward.scorers, mode=cfg.reward.aggregation, remote_timeout_s=cfg.reward.timeout_s,
                                remote_budget_s=cfg.reward.budget_s, reward_args=cfg.reward.args,
                                modules=cfg.reward.modules)
        if cfg.rollout.reward_actors:
            self.pools.append(rewards)
        if policy.card_defaults.get("video") or cfg.workflow.name:
            # Image scorers see each video's middle frame (a workflow's output may be videos whatever card is
            # trained: image_video.t2i_i2v); images pass through unchanged.
            rewards = MiddleFrameRewards(rewards)
        # The flywheel's engine: the trained card's, or the workflow run through it (trained stage's log-probs,
        # final images). Weight sync stays on self.engine, so only the trained card's version moves.
        rollout_engine = WorkflowStage.wrap(cfg, self.engine, accelerator.device)
        self.flywheel = Flywheel(
            rollout_engine, rewards, PromptSampler(load_prompts(cfg.data.prompts), cfg.data.prompts_per_step, cfg.seed),
            cfg.data.group_size, request_kwargs=rollout_request_kwargs(cfg.sampling), seed=cfg.seed,
            adv_clip=cfg.advantage.clip_max, overlap_scoring=cfg.rollout.overlap_scoring, global_std=cfg.advantage.global_std,
            same_noise_per_group=cfg.sampling.same_noise_per_group)
        self.eval_engine = rollout_engine
        if not self.layout.evaluates_served(cfg):
            # The served weights are not the ones to evaluate (the copy samples the sampling policy; the engine
            # process and Ray hold only synced weights, never the EMA average): evaluate the trained module.
            self.eval_engine = Engine(policy.model, device=accelerator.device, weight_version=version,
                                      time_shift=cfg.sampling.time_shift)
        if cfg.rollout.asynchronous:
            self.collector = AsyncCollector(self.flywheel.collect, cfg.rollout.max_staleness)
            if "async_collector" in trainer_state:
                self.collector.load_state_dict(trainer_state["async_collector"])  # the staleness counts continue
        self.total_steps = cfg.steps

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def sync(self, weights: dict[str, torch.Tensor] | None = None) -> dict:
        """Push weights into serving (default: the trainer's trainable weights) and bump the version."""
        if weights is None and self.controller.mode == "colocated":
            return self.controller.sync()
        if weights is None:
            weights = {n: p.detach() for n, p in self.policy.named_params}
        return self.controller.sync(weights)

    def collect(self, step: int, trainer_version: int) -> RolloutBatch:
        """The rollouts of `step`: generated now, or (async) while the previous step trained."""
        if self.collector is None:
            return self.flywheel.collect(step)
        batch = self.collector.get(step, trainer_version=trainer_version)
        if step + 1 < self.total_steps:
            self.collector.prefetch(step + 1)
        return batch

    def eval_samples(self, items: list, seeds_per_prompt: int, eval_kwargs: dict, judges: dict):
        """Evaluation samples of the trained policy at fixed seeds: (metrics, trajectory); see
        flywheel.rollout_collector.eval_samples."""
        fw = self.flywheel
        return eval_samples(self.eval_engine, fw.rewards, items, seeds_per_prompt,
                            {**fw.request_kwargs, **eval_kwargs}, judges)

    def metrics(self) -> dict:
        out = self.collector.metrics() if self.collector is not None else {}
        for pool in self.pools:
            out.update(pool.metrics())
        return out

    def state_dict(self) -> dict:
        return {"async_collector": self.collector.state_dict()} if self.collector is not None else {}

    def close(self) -> None:
        if self.collector is not None:
            self.engine.close()  # first: a rollout still in flight then ends at once instead of being waited for
            self.collector.close()
            self.controller.close()
        self.flywheel.close()
        for pool in self.pools:
            pool.close()


def cpu_core_sharing(collector: AsyncCollector | None, accelerator):
    """Async rollouts on a CPU: train on one thread while the engine process rolls out on the other
    core, and on every core once it is done (oversubscribing the cores instead makes the threads of
    a parallel op wait for each other). Returns a function the update calls before each forward."""
    if collector is None or accelerator.device.type != "cpu":
        return lambda: None
    cores = torch.get_num_threads()

    def share() -> None:
        wanted = max(1, cores - 1) if collector.rollout_running() else cores
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
    return share
