"""Reward scorers on a pool of Ray actors, behind `RewardSet.score`.

    rewards = RayRewardPool("toy_classifier", actors=2, cpus_per_actor=1)
    flywheel.set_rewards(rewards)          # or Flywheel(engine, rewards, ...)

Each actor builds the same `RewardSet` (the spec and its kwargs) once, on its
own resources (a GPU for a large scorer). `score` cuts the batch into contiguous,
balanced chunks, one per actor, and joins the `RewardBatch`es in order; the
scores do not depend on which actor scored a row. The call blocks, so the
flywheel's `rollout.overlap_scoring` thread overlaps it with the next chunk's rollout
exactly as it does for a local RewardSet.

Faults: actors are started with `max_restarts`; a chunk whose actor died is sent
again once Ray has restarted it (a scorer holds no state a retry could miss);
after `max_failures` failed attempts of one chunk the call raises an error
naming the actor and the last failure.
"""

from __future__ import annotations

import os
import threading
import time

import ray
import torch

from flywheel.scale.ray_pool import balanced_chunks, get_retrying, wait_for_start, wait_until_alive, was_restarted
from rewards import RewardBatch, RewardSet
from rewards.registry import import_modules


class RewardWorker:
    """One reward actor: a RewardSet built once, scoring the chunks it is sent."""

    def __init__(self, spec, kwargs: dict, threads: int, modules: list[str]):
        torch.set_num_threads(threads)
        import_modules(modules)  # scorers that the trainer's reward.modules register, registered here too
        self.rewards = RewardSet(spec, **kwargs)
        self.rows = 0
        self.busy_s = 0.0
        self.lock = threading.Lock()

    def score(self, images, prompts, metadata, weight_version, extra: dict) -> RewardBatch:
        start = time.perf_counter()
        out = self.rewards.score(images, prompts, metadata, weight_version, **extra)
        with self.lock:
            self.rows += len(prompts)
            self.busy_s += time.perf_counter() - start
        return out

    def state(self) -> dict:
        with self.lock:
            return {"rows": self.rows, "busy_s": self.busy_s, "pid": os.getpid(),
                    "restarted": was_restarted()}


class RayRewardPool:
    """`score(images, prompts, metadata, weight_version, **extra)` on N reward actors. `ray.init` must have run."""

    def __init__(self, spec, actors: int = 1, cpus_per_actor: float = 1.0, gpus_per_actor: float = 0.0,
                 max_failures: int = 3, max_restarts: int = 3, call_timeout_s: float = 600.0,
                 restart_timeout_s: float = 120.0, start_timeout_s: float = 300.0, threads: int = 1,
                 name: str = "reward_pool", modules: list[str] | tuple = (), **reward_kwargs):
        """`spec` and `reward_kwargs` as for `RewardSet` (mode, scorer_kwargs, ...), built on every actor;
        `modules` are imported on every actor first (they register scorers)."""
        if not ray.is_initialized():
            raise RuntimeError("RayRewardPool needs a running Ray: call ray.init() (a local Ray) or "
                               "ray.init(address='auto') (a cluster) first")
        if actors < 1:
            raise ValueError(f"actors must be >= 1, got {actors}")
        if max_failures < 0:
            raise ValueError(f"max_failures must be >= 0, got {max_failures}")
        self.max_failures, self.call_timeout_s, self.name = max_failures, call_timeout_s, name
        self.restart_timeout_s = restart_timeout_s
        worker = ray.remote(RewardWorker).options(num_cpus=cpus_per_actor, num_gpus=gpus_per_actor,
                                                  max_restarts=max_restarts, max_task_retries=0)
        self.actors = [worker.remote(spec, reward_kwargs, threads, list(modules)) for _ in range(actors)]
        wait_for_start(self.actors, start_timeout_s, f"{actors} {name} actor(s)", actors * cpus_per_actor,
                       actors * gpus_per_actor)
        self.failures = 0

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None,
              weight_version: int = 0, **extra) -> RewardBatch:
        bounds = balanced_chunks(len(prompts), len(self.actors))
        images = images.detach().cpu()
        jobs = []
        for index, (lo, hi) in enumerate(bounds):
            args = (images[lo:hi], prompts[lo:hi], None if metadata is None else metadata[lo:hi], weight_version,
                    {k: (v[lo:hi] if isinstance(v, torch.Tensor) else v) for k, v in extra.items()})
            jobs.append((index, args, self.actors[index].score.remote(*args)))
        return RewardBatch.concat([self._result(index, args, ref) for index, args, ref in jobs])

    def _result(self, index: int, args: tuple, ref) -> RewardBatch:
        def recover() -> None:  # a scorer holds no state: once Ray has restarted the actor, send the chunk again
            self.failures += 1
            wait_until_alive(self.actors[index], self.restart_timeout_s, f"{self.name} actor {index}")

        return get_retrying(ref, lambda: self.actors[index].score.remote(*args), recover,
                            f"{self.name} actor {index} ({len(args[1])} row(s))", self.call_timeout_s,
                            self.max_failures)

    def metrics(self) -> dict[str, float]:
        out = {f"{self.name}/failures": float(self.failures)}
        refs = [a.state.remote() for a in self.actors]
        # An actor that died since the last step answers once Ray has restarted it (as score's retry does).
        states = [get_retrying(ref, lambda i=index: self.actors[i].state.remote(),
                               lambda i=index: wait_until_alive(self.actors[i], self.restart_timeout_s,
                                                                f"{self.name} actor {i}"),
                               f"{self.name} actor {index} (state)", self.call_timeout_s, self.max_failures)
                  for index, ref in enumerate(refs)]
        for index, state in enumerate(states):
            out.update({f"{self.name}/actor{index}/rows": float(state["rows"]),
                        f"{self.name}/actor{index}/busy_s": state["busy_s"],
                        f"{self.name}/actor{index}/restarted": float(state["restarted"])})
        return out

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
