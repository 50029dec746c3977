"""Where a recipe's samples come from: the engine, weight sync, rewards and the flywheel.

Three layouts, one interface (`collect(step)`, `sync(weights)`, `close()`):

- "colocated" (default): the engine serves the trainer's own module; a sync only bumps the version.
- "swapped": the engine serves the trainer's own module with the weights of the last sync swapped in
  for every rollout (a recipe whose sampling policy is not the trained one: DiffusionNFT), so there is
  no second copy of the model; a sync hands the weights over (SwappedTransport). Evaluation samples the
  trained weights, from a second engine over the same module.
- `async_rollouts=true`: the engine in its own process, fed through shared memory; step s+1 rolls
  out while step s trains (one trainer process).
"""

from __future__ import annotations

import contextlib

import torch

from engine import Engine
from flywheel.loop import Flywheel, RolloutBatch, evaluate
from flywheel.prompts import PromptSampler, load_prompts
from flywheel.recipe.policy import Policy, lora_targets
from flywheel.recipe.sections import rollout_request_kwargs
from flywheel.recipe.swapped_weights import SwappedTransport
from flywheel.recipe.workflow import workflow_stage_engine
from flywheel.scale.config import build_rewards, build_rollout_engine
from flywheel.sync.async_rollouts import AsyncCollector
from flywheel.sync.controller import SharedMemoryTransport, WeightSyncController
from flywheel.sync.engine_process import EngineProcess
from flywheel.video import MiddleFrameRewards

SERVE_MODES = ("colocated", "swapped")


class Rollouts:
    """The engine and the flywheel of a run; `sync(weights)` moves weights into serving and bumps the version."""

    def __init__(self, cfg, accelerator, policy: Policy, version: int, trainer_state: dict,
                 serve: str = "colocated", served_weights: dict[str, torch.Tensor] | None = None):
        """serve="swapped" serves `served_weights` (named like the trained parameters) until the first sync."""
        if serve not in SERVE_MODES:
            raise ValueError(f"serve={serve!r}: valid layouts are {', '.join(SERVE_MODES)}")
        if (serve == "swapped") != (served_weights is not None):
            raise ValueError("serve='swapped' takes the weights it serves first (served_weights), and only it does")
        self.policy = policy
        self.collector: AsyncCollector | None = None
        self.pools = []  # Ray actor pools (flywheel.scale): their per-replica metrics go into each row
        if cfg.model.workflow and serve != "colocated":
            raise ValueError(f"model.workflow is not supported by this recipe (its engine serves a policy other "
                             f"than the trained one); unset model.workflow={cfg.model.workflow!r}")
        if cfg.rollout.backend == "ray":
            if serve != "colocated" or cfg.async_rollouts or cfg.model.workflow:
                raise ValueError("rollout.backend=ray serves the trained card's policy, synchronously: set "
                                 "rollout.backend=local for this recipe, async_rollouts=false, or no model.workflow")
            lora = None
            if cfg.model.finetune == "lora":
                lora = {"rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha, "targets": lora_targets(cfg)}
            self.engine, self.controller = build_rollout_engine(
                cfg.rollout, cfg.model.card, path=cfg.model.path, weight_version=max(version - 1, 0), lora=lora,
                initial_weights={n: p.detach() for n, p in policy.named_params}, rank=accelerator.process_index,
                world=accelerator.num_processes, device=str(accelerator.device))
            self.pools.append(self.engine)
        elif cfg.async_rollouts:
            if serve != "colocated":
                raise ValueError("async_rollouts=true is not supported by this recipe (its engine serves a "
                                 "policy other than the trained one); set async_rollouts=false")
            self.engine, self.controller = _engine_process(cfg, accelerator, policy, version)
        elif serve == "swapped":
            self.engine = Engine(policy.model, device=accelerator.device, weight_version=version,
                                 time_shift=cfg.sampling.time_shift, compile=cfg.model.compile)
            transport = SwappedTransport(policy.named_params, served_weights)
            self.controller = WeightSyncController(self.engine, transport=transport)
        else:
            self.engine = Engine(policy.model, device=accelerator.device, weight_version=version,
                                 time_shift=cfg.sampling.time_shift, compile=cfg.model.compile)
            self.controller = WeightSyncController(self.engine, mode="colocated")
        rewards = build_rewards(cfg.rollout, cfg.rewards, mode=cfg.rewards_mode, remote_timeout_s=cfg.reward_timeout_s,
                                remote_budget_s=cfg.reward_budget_s, reward_args=cfg.reward_args,
                                modules=cfg.reward_modules)
        if cfg.rollout.reward_actors:
            self.pools.append(rewards)
        if policy.card_defaults.get("video") or cfg.model.workflow:
            # Image scorers see each video's middle frame (a workflow's output may be videos whatever card is
            # trained: image_video.t2i_i2v); images pass through unchanged.
            rewards = MiddleFrameRewards(rewards)
        # The flywheel's engine: the trained card's, or the workflow run through it (trained stage's log-probs,
        # final images). Weight sync stays on self.engine, so only the trained card's version moves.
        rollout_engine = self.engine
        if cfg.model.workflow:
            rollout_engine = workflow_stage_engine(cfg, self.engine, accelerator.device)
        self.flywheel = Flywheel(
            rollout_engine, rewards, PromptSampler(load_prompts(cfg.data.prompts), cfg.data.prompts_per_step, cfg.seed),
            cfg.data.group_size, request_kwargs=rollout_request_kwargs(cfg.sampling), seed=cfg.seed,
            adv_clip=cfg.train.adv_clip_max, overlap_scoring=cfg.overlap_scoring, global_std=cfg.train.global_std,
            same_noise_per_group=cfg.sampling.same_noise_per_group)
        self.eval_engine = rollout_engine
        if serve == "swapped" or ((cfg.async_rollouts or cfg.rollout.backend == "ray") and cfg.train.ema):
            # The served weights are not the ones to evaluate (swapped in: the sampling policy; the engine
            # process holds only synced weights, never train.ema's average): evaluate the trained module here.
            self.eval_engine = Engine(policy.model, device=accelerator.device, weight_version=version,
                                      time_shift=cfg.sampling.time_shift)
        if cfg.async_rollouts:
            self.collector = AsyncCollector(self.flywheel.collect, cfg.max_staleness)
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

    def serving(self) -> contextlib.AbstractContextManager:
        """The context rollouts run in: the served weights swapped into the trained module ("swapped"), or none."""
        if isinstance(self.controller.transport, SwappedTransport):
            return self.controller.transport.serving()
        return contextlib.nullcontext()

    def collect(self, step: int, trainer_version: int) -> RolloutBatch:
        """The rollouts of `step`: generated now, or (async) while the previous step trained."""
        if self.collector is None:
            with self.serving():
                return self.flywheel.collect(step)
        batch = self.collector.get(step, trainer_version=trainer_version)
        if step + 1 < self.total_steps:
            self.collector.prefetch(step + 1)
        return batch

    def evaluate(self, items: list, seeds_per_prompt: int, eval_kwargs: dict, judges: dict):
        """Evaluation samples of the trained policy at fixed seeds: (metrics, trajectory), see flywheel.loop.evaluate."""
        fw = self.flywheel
        return evaluate(self.eval_engine, fw.rewards, items, seeds_per_prompt, {**fw.request_kwargs, **eval_kwargs},
                        judges)

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


def _engine_process(cfg, accelerator, policy: Policy, version: int):
    """Async rollouts: the engine in its own process, fed the trainer's weights through shared memory."""
    if accelerator.num_processes > 1:
        raise ValueError("async_rollouts=true needs a single trainer process (the engine takes the other cores); "
                         f"this run has {accelerator.num_processes}")
    lora = None
    if cfg.model.finetune == "lora":
        lora = {"rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha, "targets": lora_targets(cfg)}
    # The engine starts one version below the trainer's: the first sync below, which gives it the
    # trainer's weights, lands on the trainer's version, so that a version names the same weights in a
    # resumed run as in one that never stopped (a fresh run: the card's weights 0, the trainer's 1).
    engine = EngineProcess.start(cfg.model.card, path=cfg.model.path, device=str(accelerator.device), threads=1,
                                 lora=lora, weight_version=max(version - 1, 0), compile=cfg.model.compile)
    controller = WeightSyncController(engine, transport=SharedMemoryTransport())
    # The engine process starts from the card's weights: give it the trainer's (LoRA init, resume), checked once.
    controller.verify = True
    controller.sync({n: p.detach() for n, p in policy.named_params})
    controller.verify = False
    # The trained Parameters move into one buffer laid out like the engine's: each sync is one memcpy.
    controller.transport.share_layout(engine, dict(policy.named_params))
    return engine, controller
