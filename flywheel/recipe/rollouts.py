"""Where a recipe's samples come from: the rollout layouts, and what every layout shares.

The first half is the layouts: where the engine that rolls out runs, and how trained weights reach it. One
class per layout, behind one factory (`make_layout`), and one table of the options that do not combine
(`INCOMPATIBLE`), checked once, with the config (`check_layout_options`, which every recipe's validate_config
calls):

- `Colocated` (default): the engine serves the trainer's own module; a sync only bumps the version.
- `SwappedIn` (serve="swapped"): the engine serves the trainer's own module, with the recipe's sampling weights
  swapped in around each rollout and sync by the algorithm's `serving_weights()` (DiffusionNFT's theta_old: the
  trained tensors only, no second transformer; flywheel/recipe/policy.py `swapped_in`); a sync copies
  the weights the recipe serves into it (DiffusionNFT's theta_old). Evaluation samples the trained module.
- `EngineProcess` (`rollout.asynchronous=true`): the engine in its own process, fed through shared memory; step s+1
  rolls out while step s trains (one trainer process).
- `RayPool` (`rollout.backend=ray`): engine replicas in Ray actors (flywheel/scale), synced together.

A workflow (`workflow.name`) is a stage around the layout's engine, not a layout of its own: `WorkflowStage`
runs the whole workflow for rollouts and keeps weight sync on the trained card's engine.

The second half is `Rollouts`, which every layout shares: the engine, weight sync, rewards and the rollout
collector (`collect(step)`, `sync()`, `eval_samples(...)`, `close()`).
"""

from __future__ import annotations

import torch

from engine import Engine
from engine.types import overlay_request_fields
from flywheel.config.sections import rollout_request_kwargs
from flywheel.prompts import PromptSampler, load_prompts
from flywheel.recipe.policy import Policy, lora_targets
from flywheel.recipe.workflow import workflow_stage_engine
from flywheel.rollout_collector import Flywheel, RolloutBatch, eval_samples
from flywheel.scale.config import build_rewards
from flywheel.sync.async_rollouts import AsyncCollector
from flywheel.sync.controller import CopyTransport, SharedMemoryTransport, WeightSyncController
from flywheel.video import MiddleFrameRewards


SERVE_MODES = ("colocated", "swapped")

# Options that do not combine: (option, other option, why). `active_options` says which are on.
INCOMPATIBLE: tuple[tuple[str, str, str], ...] = (
    ("rollout.asynchronous=true", "serve=swapped", "the engine process serves the trained weights, not a sampling policy "
                                          "apart from them; set rollout.asynchronous=false"),
    ("rollout.backend=ray", "serve=swapped", "Ray replicas serve the trained weights, not a sampling policy apart "
                                          "from them; set rollout.backend=local"),
    ("rollout.backend=ray", "rollout.asynchronous=true", "Ray replicas roll out synchronously; set "
                                                   "rollout.asynchronous=false or rollout.backend=local"),
    ("rollout.backend=ray", "workflow.name", "Ray replicas serve one card, not a workflow; set "
                                              "rollout.backend=local or unset workflow.name"),
    ("workflow.name", "serve=swapped", "a workflow stage runs the trained module, not a sampling policy apart "
                                     "from it; unset workflow.name"),
    ("rollout.asynchronous=true", "workflow.name", "the engine process serves one card, not a workflow; set "
                                              "rollout.asynchronous=false"),
    ("train.flash_compress", "rollout.asynchronous=true", "the engine process has no Flash solver; set "
                                                    "rollout.asynchronous=false or train.flash_compress=null"),
)


def active_options(cfg, serve: str = "colocated") -> set[str]:
    """The names (as `INCOMPATIBLE` spells them) of the layout options this config and recipe turn on."""
    on = set()
    if cfg.rollout.asynchronous:
        on.add("rollout.asynchronous=true")
    if cfg.rollout.backend == "ray":
        on.add("rollout.backend=ray")
    if cfg.workflow.name:
        on.add("workflow.name")
    if serve == "swapped":
        on.add("serve=swapped")
    if getattr(cfg.train, "flash_compress", None) is not None:
        on.add("train.flash_compress")
    return on


def layout_refusals(cfg, serve: str = "colocated") -> list[str]:
    """One line for each pair of `INCOMPATIBLE` that this config turns on together (none: the layout is valid)."""
    if serve not in SERVE_MODES:
        return [f"serve={serve!r}: valid layouts are {', '.join(SERVE_MODES)}"]
    on = active_options(cfg, serve)
    return [f"{a} with {b}: {why}" for a, b, why in INCOMPATIBLE if a in on and b in on]


def check_layout_options(cfg, checks, serve: str = "colocated") -> None:
    """The config check of the layout options (a recipe whose engine serves other weights than the trained ones passes serve="swapped")."""
    for refusal in layout_refusals(cfg, serve):
        checks.fail(refusal.replace("serve=swapped", "this recipe (its engine serves a policy other than the trained "
                                    "one)", 1))


# --- the layouts -------------------------------------------------------------------------------------


class Colocated:
    """The engine serves the trainer's own module: a sync bumps the version and moves nothing."""

    name = "colocated"

    @staticmethod
    def evaluates_served(cfg) -> bool:
        """The served module is the trained one: evaluation uses the rollout engine (ema.enabled swaps in place)."""
        return True

    def build(self, cfg, accelerator, policy: Policy, version: int):
        engine = Engine(policy.model, device=accelerator.device, weight_version=version,
                        time_shift=cfg.sampling.time_shift, compile=cfg.model.compile)
        return engine, WeightSyncController(engine, mode="colocated")


class SwappedIn:
    """The engine serves the trainer's own module; the algorithm swaps its sampling weights in around every
    rollout and sync (`serving_weights()`), so no copy of the transformer exists. A sync copies the weights it
    is given (the swapped-in ones: a copy onto themselves) and reports their bytes, as the engine's own copy
    once did; evaluation runs outside the swap, on the trained weights."""

    name = "swapped"

    @staticmethod
    def evaluates_served(cfg) -> bool:
        """Rollouts sample the recipe's sampling policy: evaluation gets an engine of its own (same module)."""
        return False

    def build(self, cfg, accelerator, policy: Policy, version: int):
        engine = Engine(policy.model, device=accelerator.device, weight_version=version,
                        time_shift=cfg.sampling.time_shift, compile=cfg.model.compile)
        return engine, WeightSyncController(engine, transport=CopyTransport())


class EngineProcess:
    """The engine in its own process, fed the trainer's weights through shared memory (async rollouts)."""

    name = "engine_process"

    @staticmethod
    def evaluates_served(cfg) -> bool:
        """The process holds only synced weights, never the EMA average: with it, evaluate the trained module."""
        return not cfg.ema.enabled

    def build(self, cfg, accelerator, policy: Policy, version: int):
        from flywheel.sync.engine_process import EngineProcess as Process

        if accelerator.num_processes > 1:
            raise ValueError("rollout.asynchronous=true needs a single trainer process (the engine takes the other cores); "
                             f"this run has {accelerator.num_processes}")
        # The engine starts one version below the trainer's: the first sync below, which gives it the
        # trainer's weights, lands on the trainer's version, so that a version names the same weights in a
        # resumed run as in one that never stopped (a fresh run: the card's weights 0, the trainer's 1).
        engine = Process.start(cfg.model.card, path=cfg.model.path, device=str(accelerator.device), threads=1,
                               lora=_lora(cfg), weight_version=max(version - 1, 0), compile=cfg.model.compile,
                               timeout_s=cfg.rollout.call_timeout_s, start_timeout_s=cfg.rollout.start_timeout_s)
        # The drain before each sync waits for the rollouts in flight: as long as one call may take, no longer.
        controller = WeightSyncController(engine, transport=SharedMemoryTransport(),
                                          timeout_s=cfg.rollout.call_timeout_s)
        # The engine process starts from the card's weights: give it the trainer's (LoRA init, resume), checked once.
        controller.verify = True
        controller.sync({n: p.detach() for n, p in policy.named_params})
        controller.verify = False
        # The trained Parameters move into one buffer laid out like the engine's: each sync is one memcpy.
        controller.transport.share_layout(engine, dict(policy.named_params))
        return engine, controller


class RayPool:
    """Engine replicas in Ray actors, synced together (flywheel/scale); the pool is its own engine."""

    name = "ray"

    @staticmethod
    def evaluates_served(cfg) -> bool:
        """The replicas hold only synced weights, as the engine process does."""
        return not cfg.ema.enabled

    def build(self, cfg, accelerator, policy: Policy, version: int):
        from flywheel.scale.config import build_rollout_engine

        return build_rollout_engine(
            cfg.rollout, cfg.model.card, path=cfg.model.path, weight_version=max(version - 1, 0), lora=_lora(cfg),
            initial_weights=policy.pushed_weights(), rank=accelerator.process_index,
            world=accelerator.num_processes, device=str(accelerator.device))


class WorkflowStage:
    """workflow.name: the flywheel rolls out the whole workflow through the layout's engine (the trained stage's
    log-probs, the final outputs); weight sync stays on that engine, so only the trained card's version moves."""

    @staticmethod
    def wrap(cfg, engine, device):
        return workflow_stage_engine(cfg, engine, device) if cfg.workflow.name else engine


def make_layout(cfg, serve: str = "colocated"):
    """The layout of this config and recipe; ValueError naming the options that do not combine."""
    refusals = layout_refusals(cfg, serve)
    if refusals:
        raise ValueError("; ".join(refusals))
    if cfg.rollout.backend == "ray":
        return RayPool()
    if cfg.rollout.asynchronous:
        return EngineProcess()
    return SwappedIn() if serve == "swapped" else Colocated()


def _lora(cfg) -> dict | None:
    """The LoRA an engine outside this process builds to receive the trained adapter (None: full weights)."""
    if cfg.model.finetune != "lora":
        return None
    return {"rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha, "targets": lora_targets(cfg)}


# ---- what every layout shares ----


class Rollouts:
    """The engine and the flywheel of a run; `sync()` moves weights into serving and bumps the version."""

    def __init__(self, cfg, accelerator, policy: Policy, version: int, trainer_state: dict,
                 serve: str = "colocated"):
        """serve="swapped": the engine serves the trained module with the recipe's sampling weights swapped in
        by its `serving_weights()` (a recipe whose sampling policy is not the trained one; `SwappedIn`)."""
        self.policy = policy
        self.collector: AsyncCollector | None = None
        self.pools = []  # Ray actor pools (flywheel.scale): their per-replica metrics go into each row
        self.layout = make_layout(cfg, serve)  # refuses options that do not combine (INCOMPATIBLE)
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
        """Push weights into serving (default: the trainer's trainable weights) and bump the version.

        The trainer's weights are copied out (to an engine process, Ray replicas) whole
        (`Policy.pushed_weights`: FSDP holds them as flat shards); a colocated engine reads the module itself,
        inside the rollouts' own gather."""
        if weights is None and self.controller.mode == "colocated":
            return self.controller.sync()
        return self.controller.sync(self.policy.pushed_weights() if weights is None else weights)

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
                            overlay_request_fields(fw.request_kwargs, eval_kwargs), judges)

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
