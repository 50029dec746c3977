"""The flywheel: prompts -> rollouts -> rewards -> group advantages, and evaluation.

An algorithm consumes a `RolloutBatch` (through its own `update(batch, step)`); the
training loop owns the WeightSyncController and syncs after an update that stepped. The global batch
of a step is prompts_per_step x group_size samples; rank r generates rows
[r·n, (r+1)·n), so a prompt's group may span ranks, and every sample's seed is
a function of (seed, step, global row) alone: the same run on 1 or 2 ranks
draws the same samples.

With `rollout.overlap_scoring`, a step's rows are generated in chunks and each chunk
is scored on a background thread while the engine generates the next one; the
chunks and their order are the same as with scoring in line, so the results
are identical (only the wall time changes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from engine import Engine, GenerationRequest, Trajectory
from engine.types import overlay_request_fields
from flywheel.advantages import distributed_reward_advantages, flat_group_count
from flywheel.distributed import all_gather_cat, all_reduce_mean, rank_and_world
from flywheel.guards import NonFiniteError
from flywheel.prompts import PromptItem, PromptSampler
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
    """A 63-bit rollout seed that depends only on the run seed, the step and the global row.

    numpy's SeedSequence hashes the three numbers together, so different runs'
    seeds do not collide: a linear mix such as seed·a + step·b + row maps
    (1, 0, 27) and (0, 10, 0) to one seed, and a seed-0 and a seed-1 default
    run then shared 7,070 of their 10,240 noise seeds.
    """
    if min(seed, step, row) < 0:
        raise ValueError(f"sample_seed needs non-negative seed, step and row, got {seed}, {step}, {row}")
    return int(np.random.SeedSequence([seed, step, row]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def generate_in_order(engine, requests: list[GenerationRequest]) -> Trajectory:
    """One Trajectory of `requests` in their order, one engine batch per batch key (the rows of one SDE window
    run together when windows differ by trajectory)."""
    keys: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        keys.setdefault(r.batch_key(), []).append(i)
    if len(keys) == 1:
        return engine.generate(requests)
    groups = list(keys.values())
    joined = Trajectory.concat([engine.generate([requests[i] for i in rows]) for rows in groups])
    position = {i: n for n, i in enumerate(i for rows in groups for i in rows)}
    return joined.select([position[i] for i in range(len(requests))])


def reward_inputs(trajectory: Trajectory) -> dict:
    """What `RewardSet.score` takes beside the images: the rollouts' audio and its sample rate, if any.

    Empty for a trajectory without sound, so a reward set (or a wrapper of one) that takes no
    audio is called exactly as before.
    """
    audio = getattr(trajectory, "audio", None)
    if audio is None:
        return {}
    return {"audio": audio, "sample_rate": getattr(trajectory, "audio_sample_rate", None)}


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

    def __init__(self, engine: Engine, rewards: RewardSet, sampler: PromptSampler,
                 group_size: int, request_kwargs: dict, seed: int = 0, adv_clip: float | None = None,
                 overlap_scoring: bool = False, rollout_chunk_size: int | None = None, global_std: bool = False,
                 same_noise_per_group: bool = False):
        """`rollout_chunk_size`: rows per engine call (None: all rows at once, or half of them when
        `overlap_scoring` is on, so that there is a next chunk to overlap with). `global_std`: normalise
        advantages by the std of the whole step's rewards instead of each group's (Flow-GRPO's option).
        `same_noise_per_group`: every sample of a group starts from its first sample's initial noise (MixGRPO's
        init_same_noise); the SDE noise of each sample stays its own."""
        rank, world = rank_and_world()
        global_batch = sampler.prompts_per_step * group_size
        if global_batch % world:
            raise ValueError(f"prompts_per_step x group_size = {global_batch} must be divisible by the "
                             f"number of processes ({world})")
        self.engine, self.rewards, self.sampler = engine, rewards, sampler
        self.group_size, self.request_kwargs, self.seed, self.adv_clip = group_size, request_kwargs, seed, adv_clip
        self.global_std, self.same_noise_per_group = global_std, same_noise_per_group
        self.rank, self.world = rank, world
        self.local_batch = global_batch // world
        if rollout_chunk_size is not None and rollout_chunk_size < 1:
            raise ValueError(f"rollout_chunk_size must be a positive number of rows or None, got {rollout_chunk_size}")
        self.overlap_scoring = overlap_scoring
        if rollout_chunk_size is None:
            rollout_chunk_size = math.ceil(self.local_batch / 2) if overlap_scoring else self.local_batch
        self.rollout_chunk_size = rollout_chunk_size
        self._executor: ThreadPoolExecutor | None = None
        # Per-step or per-trajectory request fields over `request_kwargs`
        # (step, global row) -> request fields that vary by step or by trajectory (the SDE windows of
        # MixGRPO and Flow-GRPO-Fast); a function of its arguments alone, so async prefetch and resume agree.
        self.request_overrides: Callable[[int, int], dict] | None = None

    def set_rewards(self, rewards: RewardSet | str | dict | list, **kwargs) -> None:
        """Swap the reward between steps: a `RewardSet`, or a spec (plus RewardSet kwargs) to build one.

        `collect` returns only once every score of its step is in, so no scoring
        is in flight here; the next step's metrics carry the new scorers' names.
        """
        # A spec (str/dict/list) is built here; anything else with .score (a RewardSet or a wrapper) is used as is.
        self.rewards = RewardSet(rewards, **kwargs) if isinstance(rewards, (str, dict, list)) else rewards

    def close(self) -> None:
        """Stop the background scoring thread (if rollout.overlap_scoring started one)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _rollout_and_score(self, requests: list[GenerationRequest]) -> tuple[Trajectory, RewardBatch, dict]:
        """Generate in chunks and score each; with overlap, chunk i is scored while chunk i+1 generates."""
        rewards = self.rewards  # one reward set for the whole step, even if set_rewards races with us
        chunks = [requests[i:i + self.rollout_chunk_size] for i in range(0, len(requests), self.rollout_chunk_size)]
        busy = [0.0]

        def score(traj: Trajectory) -> RewardBatch:
            t = time.perf_counter()
            out = rewards.score(traj.images, traj.prompts, traj.metadata, traj.weight_version,
                                **reward_inputs(traj))
            busy[0] += time.perf_counter() - t
            return out

        trajectories, scored, gen_s = [], [], 0.0
        for chunk in chunks:
            t = time.perf_counter()
            traj = generate_in_order(self.engine, chunk)
            gen_s += time.perf_counter() - t
            trajectories.append(traj)
            if self.overlap_scoring:
                if self._executor is None:  # one worker: chunks are scored one at a time, in order
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flywheel-score")
                scored.append(self._executor.submit(score, traj))
            else:
                scored.append(score(traj))
        t = time.perf_counter()
        parts = [s.result() if isinstance(s, Future) else s for s in scored]
        wait_s = time.perf_counter() - t
        timings = {"time/rollout_s": gen_s, "time/reward_s": wait_s if self.overlap_scoring else busy[0],
                   "time/reward_busy_s": busy[0]}
        return Trajectory.concat(trajectories), RewardBatch.concat(parts), timings

    def collect(self, step: int) -> RolloutBatch:
        """Roll out, score and compute advantages for this rank's rows of step `step`."""
        items = self.sampler.batch(step)
        rows = range(self.rank * self.local_batch, (self.rank + 1) * self.local_batch)
        overrides = self.request_overrides or (lambda step, row: {})
        requests = [self._request(items[row // self.group_size], sample_seed(self.seed, step, row),
                                  **overrides(step, row), **self._shared_noise(step, row)) for row in rows]
        group_ids = torch.tensor([row // self.group_size for row in rows])

        trajectory, rewards, timings = self._rollout_and_score(requests)
        # Every rank's count (a collective), so that all stop together: before, NaN images were masked by the
        # rewards and the run said "the rewards masked every sample", blaming the scorer for the model.
        bad = all_reduce_mean({"nonfinite": float(nonfinite_samples(trajectory))})["nonfinite"]
        if bad:
            raise NonFiniteError(f"step {step + 1}: {round(bad * rank_and_world()[1])} of the step's rollout samples "
                                 "hold NaN or inf; the weights are finite (checked after every optimizer "
                                 "step), so the forward overflowed or the sampler diverged (a 16-bit model.dtype, an extreme "
                                 "sampling setting). The run stops here and the checkpoints on disk are the last "
                                 "good ones")
        advantages, usable = distributed_reward_advantages(rewards, group_ids, clip=self.adv_clip,
                                                           global_std=self.global_std)
        metrics = {**timings, "reward/usable": float(usable.sum()),
                   # Every rank counts the same global groups (a group may span ranks).
                   "reward/zero_std_groups": float(flat_group_count(all_gather_cat(group_ids),
                                                                    all_gather_cat(rewards.valid.to(torch.uint8)),
                                                                    all_gather_cat(usable.to(torch.uint8)))),
                   "diversity": group_diversity(trajectory.images, group_ids),
                   "weight_version": trajectory.weight_version, **rewards.metrics()}
        if trajectory.steps_computed is not None and any(r.adaptive for r in requests):
            # sampling.cache_threshold / early_exit: the model calls per rollout the adaptive loop made
            metrics["rollout/model_calls"] = float(trajectory.steps_computed.float().mean())
        return RolloutBatch(trajectory, rewards, advantages.to(trajectory.latents.device),
                            usable.to(trajectory.latents.device), group_ids, metrics)

    def _shared_noise(self, step: int, row: int) -> dict:
        """The request field that gives a group one initial noise: its first row's seed (a function of the step and
        the row alone, so a group split across ranks agrees)."""
        if not self.same_noise_per_group:
            return {}
        return {"noise_seed": sample_seed(self.seed, step, row - row % self.group_size)}

    def _request(self, item: PromptItem, seed: int, **overrides) -> GenerationRequest:
        return item_request(item, seed, self.engine.card_id, overlay_request_fields(self.request_kwargs, overrides))

    def eval_samples(self, items: list[PromptItem], seeds_per_prompt: int, eval_kwargs: dict,
                 judges: dict | None = None) -> tuple[dict[str, float], Trajectory]:
        """Evaluate the engine's current weights with this flywheel's rewards (see `eval_samples`)."""
        return eval_samples(self.engine, self.rewards, items, seeds_per_prompt,
                            overlay_request_fields(self.request_kwargs, eval_kwargs), judges)


EVAL_SEED_OFFSET = 10_000  # evaluation seeds never coincide with the first training rows
# The mean over evaluation prompts of the per-pixel std across that prompt's seeds (`group_diversity`).
EVAL_DIVERSITY_METRIC = "eval/diversity"


def item_request(item: PromptItem, seed: int, card: str, request_kwargs: dict) -> GenerationRequest:
    """The request of a dataset item: its prompt and metadata, and its conditioning image when a .jsonl row
    names one (image-to-video cards), over `request_kwargs`."""
    kwargs = dict(request_kwargs)
    if "image" in item.metadata:
        kwargs.setdefault("image", item.metadata["image"])
    return GenerationRequest(prompt=item.prompt, seed=seed, card=card, metadata=item.metadata, **kwargs)


@torch.no_grad()
def eval_samples(engine: Engine, rewards: RewardSet, items: list[PromptItem], seeds_per_prompt: int,
             request_kwargs: dict, judges: dict | None = None,
             seed_offset: int = EVAL_SEED_OFFSET) -> tuple[dict[str, float], Trajectory]:
    """Samples of `items` at fixed seeds; eval/reward/* and eval/judge/* metrics, and the trajectory.

    The same prompts, seeds and sampler every time, so evaluations at different
    steps (and of the base model by the pretraining script) are comparable.

    When the task has classes (a judge defines `classes(prompts, metadata)`,
    see rewards/judges.py), the metrics also hold, for each class c,
    `eval/judge/<name>/<c>` (the mean judge score of c's samples) and
    `eval/reward/<c>` (the mean total reward of c's valid samples), and
    `eval/judge/<name>/min_class` (the worst class): reward hacking usually
    starts in one class, where the overall mean hides it. With more than one
    seed a prompt, `eval/diversity` is the mean over prompts of the per-pixel
    std across that prompt's seeds (`group_diversity`): the collapse a sample
    grid shows when every seed of a prompt gives the same image. `seed_offset`: the
    first seed (another one draws another evaluation set: benchmarks/watch_noise.py
    measures the judges' noise that way).
    """
    requests = [item_request(item, seed_offset + s, engine.card_id, request_kwargs)
                for item in items for s in range(seeds_per_prompt)]
    # Classes come from the prompts alone: a bad class is reported before anything is generated.
    classes = eval_classes(judges or {}, [r.prompt for r in requests], [r.metadata for r in requests])
    trajectory = engine.generate(requests)
    bad = nonfinite_samples(trajectory)
    if bad:  # the judges and the rewards would mask them, and the evaluation would look like the reward's fault
        raise NonFiniteError(f"the evaluation's samples hold NaN or inf ({bad} of {len(requests)}): the forward "
                             "overflowed or the sampler diverged at these weights; the checkpoints on disk are the "
                             "last good ones")
    scored = rewards.score(trajectory.images, trajectory.prompts, trajectory.metadata, trajectory.weight_version,
                           **reward_inputs(trajectory))
    metrics = scored.metrics(prefix="eval/reward")
    if seeds_per_prompt > 1:
        # The collapse a sample grid shows: how far a prompt's seeds differ (0 = one image per prompt).
        metrics[EVAL_DIVERSITY_METRIC] = group_diversity(
            trajectory.images, torch.arange(len(items)).repeat_interleave(seeds_per_prompt))
    if trajectory.steps_computed is not None and any(r.adaptive for r in requests):
        # The adaptive loop's model calls per sample (of the requested steps), beside the reward it gave.
        metrics["eval/model_calls"] = float(trajectory.steps_computed.float().mean())
    if classes is not None:
        rewards_by_class = class_means(scored.total, classes, valid=scored.valid)
        metrics.update({f"eval/reward/{c}": v for c, v in rewards_by_class.items()})
    for name, judge in (judges or {}).items():
        scores = judge(trajectory.images, trajectory.prompts, trajectory.metadata).float()
        metrics[f"eval/judge/{name}/mean"] = float(torch.nanmean(scores))
        if classes is not None:
            classed = torch.tensor([c is not None for c in classes])
            bad = int((classed & ~torch.isfinite(scores.cpu())).sum())
            if bad:
                # A sample that belongs to a class must be judged: a NaN would drop out of the class
                # mean unseen, and the class could look fine because its worst samples were not scored.
                raise ValueError(f"judge {name!r} gave a non-finite score to {bad} sample(s) that belong to a "
                                 f"class; it must score every sample of a class (NaN only where there is none)")
            judged = class_means(scores, classes)
            metrics.update({f"eval/judge/{name}/{c}": v for c, v in judged.items()})
            if judged:  # no sample in any class: no worst class either
                metrics[f"eval/judge/{name}/min_class"] = min(judged.values())
    return metrics, trajectory


def nonfinite_samples(trajectory: Trajectory) -> int:
    """How many samples' latents (every kept step's) or images hold a NaN or inf (one host read)."""
    rows = [t.flatten(1) for t in (trajectory.latents, trajectory.images)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1]
    if not rows:
        return 0
    finite = torch.stack([torch.isfinite(r).all(dim=1).to(rows[0].device) for r in rows]).all(dim=0)
    return int((~finite).sum())


# Per-class metric keys sit beside these summary keys; a class may not take one of their names.
RESERVED_CLASS_NAMES = ("mean", "std", "invalid", "min_class")


def eval_classes(judges: dict, prompts: list[str], metadata: list[dict]) -> list | None:
    """The class of each evaluation sample, from the judges that define `classes`; None if none does.

    Every judge that defines classes must put the samples in the same ones
    (one partition, so the per-class reward and judges line up). A class is an
    int or a str; it becomes part of a metric key, so it may not contain "/" or
    be one of the summary names (mean, std, invalid, min_class).
    """
    found: list | None = None
    source = None
    for name, judge in judges.items():
        if not callable(getattr(judge, "classes", None)):
            continue
        classes = list(judge.classes(prompts, metadata))
        if len(classes) != len(prompts):
            raise ValueError(f"judge {name!r}: classes() returned {len(classes)} classes for {len(prompts)} samples")
        if found is not None and classes != found:
            raise ValueError(f"judges {source!r} and {name!r} put the evaluation samples in different classes; "
                             f"per-class metrics need one partition")
        found, source = classes, name
    for c in found or []:
        if c is None:
            continue
        if isinstance(c, bool) or not isinstance(c, (int, str)):
            raise ValueError(f"judge {source!r}: class {c!r} is a {type(c).__name__}; a class is an int or a str")
        if "/" in str(c) or str(c) in RESERVED_CLASS_NAMES or not str(c):
            raise ValueError(f"judge {source!r}: class {str(c)!r} cannot name a metric; a class may not be empty, "
                             f"contain '/' or be one of {', '.join(RESERVED_CLASS_NAMES)}")
    return found


def class_means(values: torch.Tensor, classes: list, valid: torch.Tensor | None = None) -> dict[str, float]:
    """Mean of `values` [B] per class (rows whose class is None, or not `valid`, left out), keyed by str(class).

    A class none of whose rows is valid gets NaN, as `RewardBatch.metrics` does for an empty mean.
    """
    values = values.detach().float().cpu()
    keep = torch.ones(len(classes), dtype=torch.bool) if valid is None else valid.detach().cpu().bool()
    out: dict[str, float] = {}
    for c in dict.fromkeys(c for c in classes if c is not None):  # first-seen order: digit-major for the toy task
        rows = torch.tensor([k == c for k in classes]) & keep
        out[str(c)] = float(values[rows].mean()) if rows.any() else math.nan
    return out
