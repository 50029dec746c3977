"""`build_rollout_engine`: a local engine or a Ray pool, for the recipes' `rollout` section (`RolloutConfig`,
defined in flywheel/config/sections.py and importable from here).

The recipe keeps its engine and its `WeightSyncController`; with backend "ray"
both come from here: a `RayEnginePool` (which serves as the engine) and a
controller over `RayObjectStoreTransport`, after one verified sync that gives
every replica the trainer's weights.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from flywheel.config.sections import BACKENDS, SYNC_BACKENDS, RolloutConfig  # noqa: F401 (its old home)


def _ray(cfg: RolloutConfig):
    """Ray, started (a local instance) or joined (cfg.address) if this process has not done so yet."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("rollout.backend=ray and rollout.reward_actors > 0 need Ray: pip install -e '.[ray]'") from exc
    if not ray.is_initialized():
        ray.init(address=cfg.address, include_dashboard=False)
    return ray


def build_rewards(cfg: RolloutConfig, spec, reward_args: dict | None = None, modules: list[str] | tuple = (),
                  **reward_kwargs):
    """The run's scorer: a RewardSet here, or a RayRewardPool of cfg.reward_actors actors (the same `score`).

    `modules` are imported first (here and in every reward actor: they register scorers); `reward.args`
    (the config's, see rewards.registry.resolve_args) become each scorer's constructor arguments."""
    from rewards.registry import import_modules, resolve_args

    import_modules(list(modules))
    if reward_args:
        reward_kwargs["scorer_kwargs"] = resolve_args(spec, reward_args)
    if cfg.reward_actors == 0:
        from rewards import RewardSet

        return RewardSet(spec, **reward_kwargs)
    _ray(cfg)
    from flywheel.scale.ray_rewards import RayRewardPool

    return RayRewardPool(spec, actors=cfg.reward_actors, cpus_per_actor=cfg.cpus_per_reward_actor,
                         gpus_per_actor=cfg.gpus_per_reward_actor, max_failures=cfg.max_failures,
                         call_timeout_s=cfg.call_timeout_s, start_timeout_s=cfg.start_timeout_s,
                         modules=list(modules), **reward_kwargs)


def ray_launch_problems(cfg: RolloutConfig, world: int) -> list[str]:
    """What keeps a Ray replica pool from serving `world` trainer processes (each drives replicas/world of
    them, in one cluster): checked before work (flywheel.config.validation) and again at the pool's build."""
    problems = []
    if world > 1 and cfg.address is None:
        problems.append(f"rollout.backend=ray with {world} trainer processes needs one Ray cluster for all of "
                        "them: start it with `ray start --head` and set rollout.address=auto")
    share = _share_problem(cfg, world)
    if share:
        problems.append(share)
    if cfg.sync_backend == "nccl" and not torch.cuda.is_available():
        problems.append("rollout.sync_backend=nccl needs CUDA GPUs (NCCL) in the trainer and every replica; this "
                        "machine has none: use object_store (the default) or gloo")
    problems += _local_ray_resource_problems(cfg)
    return problems


def _local_ray_resource_problems(cfg: RolloutConfig) -> list[str]:
    """A local Ray instance (no rollout.address, none started in this process) has this machine's CPUs and
    GPUs: actors that ask for more are never placed, and the pool waited rollout.start_timeout_s (600 s by
    default) for them after the run dir was written."""
    ray = sys.modules.get("ray")
    if cfg.address is not None or (ray is not None and ray.is_initialized()):
        return []  # a cluster's resources are its own: the pool's start timeout names what it lacks
    cpus, gpus = os.cpu_count() or 1, torch.cuda.device_count()
    want_cpus = cfg.replicas * cfg.cpus_per_replica + cfg.reward_actors * cfg.cpus_per_reward_actor
    want_gpus = cfg.replicas * cfg.gpus_per_replica + cfg.reward_actors * cfg.gpus_per_reward_actor
    if want_cpus <= cpus and want_gpus <= gpus:
        return []
    return [f"rollout.replicas={cfg.replicas} x cpus_per_replica={cfg.cpus_per_replica:g}, "
            f"gpus_per_replica={cfg.gpus_per_replica:g} (and {cfg.reward_actors} reward actor(s)) ask a local Ray "
            f"instance for {want_cpus:g} CPU(s) and {want_gpus:g} GPU(s); this machine has {cpus} and {gpus}: lower "
            "them, or join a cluster with rollout.address"]


def _share_problem(cfg: RolloutConfig, world: int) -> str | None:
    if isinstance(cfg.replicas, int) and cfg.replicas >= 1 and cfg.replicas % world:
        return (f"rollout.replicas={cfg.replicas} must be divisible by the number of trainer processes ({world}): "
                "each rank drives replicas/world of them")
    return None


def replicas_of_rank(cfg: RolloutConfig, world: int) -> int:
    """How many replicas each trainer rank drives (rank r generates its own rows on its own replicas)."""
    share = _share_problem(cfg, world)
    if share:
        raise ValueError(share)
    return cfg.replicas // world


def build_rollout_engine(cfg: RolloutConfig, card: str, *, path: str | None = None,
                         model_factory: Callable | None = None, weight_version: int = 0, lora: dict | None = None,
                         initial_weights: dict[str, torch.Tensor] | None = None, rank: int = 0, world: int = 1,
                         device: str = "cpu"):
    """(engine, WeightSyncController) for `cfg`: a local Engine with a copy transport, or a RayEnginePool.

    `rank`/`world`: the trainer's process and their number; each rank drives replicas/world replicas of its own.
    `device`: the trainer's device (a collective sync packs its buckets there).
    `initial_weights` (the trainer's weights, e.g. a LoRA init or a resumed checkpoint) are synced once,
    verified on every replica, so the first version served is the trainer's (`weight_version` + 1).
    """
    from flywheel.sync.controller import CopyTransport, WeightSyncController

    if cfg.backend == "local":
        from engine import Engine
        from engine.cards import load_model

        model = model_factory() if model_factory is not None else load_model(card, path=path, device=device)
        engine = Engine(model, device=device, weight_version=weight_version)
        controller = WeightSyncController(engine, transport=CopyTransport())
    else:
        problems = ray_launch_problems(cfg, world)
        if problems:
            raise ValueError("; ".join(problems))
        _ray(cfg)
        from flywheel.scale.ray_pool import RayEnginePool
        from flywheel.scale.ray_sync import CollectiveTransport, RayObjectStoreTransport

        engine = RayEnginePool(card, replicas=replicas_of_rank(cfg, world), path=path,
                               cpus_per_replica=cfg.cpus_per_replica, gpus_per_replica=cfg.gpus_per_replica,
                               weight_version=weight_version, lora=lora, model_factory=model_factory,
                               max_failures=cfg.max_failures, call_timeout_s=cfg.call_timeout_s,
                               start_timeout_s=cfg.start_timeout_s)
        if cfg.sync_backend == "object_store":
            transport = RayObjectStoreTransport()
        else:
            import ray

            transport = CollectiveTransport(cfg.sync_backend, host=ray.util.get_node_ip_address(),
                                            port=cfg.sync_port + rank, device=device)
            transport.connect(engine)
        controller = WeightSyncController(engine, transport=transport)
    if initial_weights is not None:
        controller.verify = True
        controller.sync(initial_weights)
        controller.verify = False
    return engine, controller
