"""`AsyncEngine`: a serving front end over one or more hosted models, with dynamic batching.

It hosts models by card id: GENERATORS (an `Engine`) and SCORERS (any object
with `score(images [B,C,H,W] in [0,1], prompts, metadata) -> Tensor[B]`, or a
callable with that signature, such as a `rewards` scorer). Models can be
added or replaced while the engine runs; a batch uses the model that was
hosted when the batch started.

Requests go into one lane per (card, batch key). A lane's batcher takes the
first waiting request, collects more of the same key for up to `max_wait_ms`
(or until `max_batch` rows), waits for one of `max_concurrency` pool slots
and runs the batch in a worker thread (torch releases the GIL). Every
request is admitted through an `AdmissionController` (memory budget):
queued when it does not fit now, refused when it never can, refunded when
`submit`/`score` returns, raises or is cancelled. (A request cancelled while
its batch runs is refunded at once and its row discarded, so the budget can
briefly undercount that batch.)

Weight sync (DESIGN.md): `await pause(mode="drain")` stops starting batches
and waits for the running ones (which finish on the version they started
with); requests arriving meanwhile wait in their lanes; `await
load_weights(...)` copies the new tensors in place and bumps the version;
`await resume()` lets the waiting requests run on the new version. Nothing is
dropped.

Workflows (engine.workflows) are hosted beside the cards: `add_workflow(id)`
checks that every card it requires is hosted as a generator (naming the
missing ones), `models()` lists it with its kind and requires, and a request
whose `card` is a workflow id runs the workflow on the hosted engines
(`run_workflow`; `submit` returns its WorkflowOutput). A workflow call runs its
stages one after the other in one pool slot (so pause/drain covers it); its
rows batch together per stage, not with other callers' requests.

Use it from a running event loop (`await engine.submit(...)`), or start it on
a background loop with `start_background()` and call `run_sync(coro)` from
ordinary threads (that is how `rewards.served.ServedRewardScorer` calls it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from engine.admission import AdmissionController, estimate_generation_bytes
from engine.engine import PAUSE_MODES, Engine
from engine.types import GenerationRequest, Trajectory
from engine.workflows import (WorkflowOutput, WorkflowRegistry, WorkflowRunner, default_registry, stage_plan,
                              stage_requests)

DEFAULT_BUDGET_BYTES = 8 * 1024**3


class UnknownCardError(KeyError):
    """A request named a card id the engine does not host."""

    def __str__(self) -> str:  # KeyError's default repr-quotes the message
        return str(self.args[0])


@dataclass
class _Hosted:
    card_id: str
    kind: str  # "generator" | "scorer"
    model: Any

    def describe(self) -> dict:
        info = {"id": self.card_id, "kind": self.kind}
        if self.kind == "generator":
            info["weight_version"] = self.model.weight_version
        else:
            info["weight_version"] = getattr(self.model, "weight_version", 0)
        return info


@dataclass
class _Item:
    payload: Any
    rows: int
    future: asyncio.Future


@dataclass
class _Lane:
    card_id: str
    items: deque = field(default_factory=deque)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class AsyncEngine:
    """Dynamic batching, a bounded pool and admission control over hosted models."""

    def __init__(self, models: Engine | dict[str, Any] | None = None, *, max_batch: int = 32,
                 max_wait_ms: float = 5.0, max_concurrency: int = 2,
                 admission: AdmissionController | None = None,
                 estimate: Callable[[GenerationRequest, Engine], int] | None = None,
                 workflows: list[str] | None = None, workflow_registry: WorkflowRegistry | None = None,
                 drain_timeout_s: float = 600.0):
        if not (max_batch >= 1 and max_concurrency >= 1 and 0 <= max_wait_ms < math.inf
                and 0 < drain_timeout_s < math.inf):  # written so that NaN fails too
            raise ValueError(f"need max_batch >= 1, max_concurrency >= 1, finite max_wait_ms >= 0 and finite "
                             f"drain_timeout_s > 0; got {max_batch}, {max_concurrency}, {max_wait_ms}, "
                             f"{drain_timeout_s}")
        self.drain_timeout_s = float(drain_timeout_s)
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_concurrency = max_concurrency
        self.admission = admission or AdmissionController(DEFAULT_BUDGET_BYTES)
        self._estimate = estimate or _default_estimate
        self._models: dict[str, _Hosted] = {}
        self._workflow_registry = workflow_registry
        self._workflows: list[str] = []
        self._lanes: dict[tuple, _Lane] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrency,
                                                               thread_name_prefix="engine-pool")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._changed: asyncio.Condition | None = None
        self._paused = False
        self._running = 0
        self._thread: threading.Thread | None = None
        self.batches = 0
        self.rows = 0
        if isinstance(models, Engine):
            self.add_model(models.card_id, models)
        elif models:
            for card_id, model in models.items():
                self.add_model(card_id, model)
        for workflow_id in workflows or []:
            self.add_workflow(workflow_id)

    # ---- hosted models ----------------------------------------------------------------

    def add_model(self, card_id: str, model: Any, replace: bool = False) -> None:
        """Host `model` (an Engine, or a scorer) under `card_id`; `replace=True` swaps a hosted one.

        Batches already running finish with the old model; later ones use the new one.
        """
        if isinstance(model, Engine):
            kind = "generator"
            if model.card_id != card_id:
                raise ValueError(f"engine serves card {model.card_id!r}, cannot host it as {card_id!r}")
        elif hasattr(model, "score") or callable(model):
            kind = "scorer"
        else:
            raise TypeError(f"cannot host {type(model).__name__}: expected an Engine or an object with "
                            f"score(images, prompts, metadata)")
        if card_id in self._models and not replace:
            raise ValueError(f"card {card_id!r} is already hosted; pass replace=True to swap it")
        self._models[card_id] = _Hosted(card_id, kind, model)

    def replace_model(self, card_id: str, model: Any) -> None:
        """Swap the model hosted as `card_id` without a restart."""
        self.hosted(card_id)
        self.add_model(card_id, model, replace=True)

    def remove_model(self, card_id: str) -> None:
        self.hosted(card_id)
        del self._models[card_id]

    def hosted(self, card_id: str, kind: str | None = None) -> _Hosted:
        """The hosted entry of `card_id`; UnknownCardError listing the known cards (and workflows) otherwise."""
        entry = self._models.get(card_id)
        if entry is None or (kind is not None and entry.kind != kind):
            known = sorted(k for k, v in self._models.items() if kind is None or v.kind == kind)
            what = f"{kind} card" if kind else "card"
            workflows = f"; workflows: {', '.join(self._workflows)}" if kind != "scorer" and self._workflows else ""
            raise UnknownCardError(f"unknown {what} {card_id!r}; known: {', '.join(known) or '(none)'}{workflows}")
        return entry

    @property
    def workflow_registry(self) -> WorkflowRegistry:
        if self._workflow_registry is None:
            self._workflow_registry = default_registry()
        return self._workflow_registry

    def add_workflow(self, workflow_id: str) -> None:
        """Serve a registered workflow; every card it requires must already be hosted as a generator."""
        workflow = self.workflow_registry.get(workflow_id)
        workflow.validate(k for k, v in self._models.items() if v.kind == "generator")
        if workflow_id in self._models:
            raise ValueError(f"{workflow_id!r} is hosted as a card: workflows and cards share one namespace")
        if workflow_id not in self._workflows:
            self._workflows.append(workflow_id)

    def is_workflow(self, workflow_id: str) -> bool:
        return workflow_id in self._workflows

    def _describe_workflow(self, workflow_id: str) -> dict:
        info = self.workflow_registry.get(workflow_id).describe()
        info["weight_versions"] = {card: self._models[card].model.weight_version for card in info["requires"]
                                   if card in self._models}
        return info

    def models(self) -> list[dict]:
        """The hosted cards, then the served workflows (kind "workflow", with what they require)."""
        return ([self._models[k].describe() for k in sorted(self._models)]
                + [self._describe_workflow(w) for w in sorted(self._workflows)])

    def engine(self, card_id: str) -> Engine:
        return self.hosted(card_id, "generator").model

    # ---- requests -----------------------------------------------------------------------

    async def submit(self, request: GenerationRequest) -> Trajectory | WorkflowOutput:
        """Generate one request; its single-row Trajectory (a WorkflowOutput when `card` names a workflow)."""
        if request.card in self._workflows:
            return await self.run_workflow(request.card, [request])
        engine = self.engine(request.card)
        nbytes = self._estimate(request, engine)
        async with self.admission.reserve(nbytes):
            return await self._enqueue((request.card, "generate", request.batch_key()), request, 1)

    async def generate(self, requests: list[GenerationRequest]) -> list[Trajectory]:
        """Submit many requests concurrently; results in request order."""
        return list(await asyncio.gather(*(self.submit(r) for r in requests)))

    async def run_workflow(self, workflow_id: str, requests: list[GenerationRequest],
                           intermediates: bool = False) -> WorkflowOutput:
        """Run a served workflow on the hosted engines (engine.workflows.WorkflowRunner), its stages in one
        pool slot; admitted for the largest stage's memory (stages run one after another)."""
        if workflow_id not in self._workflows:
            self.hosted(workflow_id, "generator")  # UnknownCardError listing cards and workflows
        registry = self.workflow_registry
        workflow = registry.get(workflow_id)
        engines = {card: self.engine(card) for card in workflow.requires}
        nbytes = max(sum(self._estimate(r, engines[stage.target]) for r in stage_requests(stage, requests))
                     for stage in stage_plan(registry, workflow_id).values())
        runner = WorkflowRunner(engines, registry=registry)
        async with self.admission.reserve(nbytes):
            self._bind_loop()
            await self._start_slot()
            try:
                return await self._loop.run_in_executor(self._executor, runner.run, workflow_id, list(requests),
                                                        intermediates)
            finally:
                self._finish_slot()

    async def score(self, card_id: str, images: torch.Tensor, prompts: list[str],
                    metadata: list[dict] | None = None) -> torch.Tensor:
        """Scores [B] of the hosted scorer `card_id`, batched with other callers' images."""
        self.hosted(card_id, "scorer")
        if images.ndim < 2 or images.shape[0] != len(prompts):
            raise ValueError(f"images must be [B, ...] with B = len(prompts) = {len(prompts)}, "
                             f"got shape {tuple(images.shape)}")
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        if len(metadata) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(metadata)} metadata dicts; they must match")
        nbytes = images.numel() * images.element_size()
        async with self.admission.reserve(nbytes):
            key = (card_id, "score", tuple(images.shape[1:]), str(images.dtype), str(images.device))
            return await self._enqueue(key, (images, list(prompts), metadata), len(prompts))

    async def _enqueue(self, key: tuple, payload: Any, rows: int):
        self._bind_loop()
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(key[0])
            lane.task = asyncio.create_task(self._batcher(key, lane))
        item = _Item(payload, rows, self._loop.create_future())
        lane.items.append(item)
        lane.arrived.set()
        return await item.future

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._slots = asyncio.Semaphore(self.max_concurrency)
            self._changed = asyncio.Condition()
        elif self._loop is not loop:
            raise RuntimeError("this AsyncEngine is bound to another event loop; use one loop "
                               "(or start_background() and run_sync()) per engine")

    async def _take(self, lane: _Lane) -> _Item:
        while True:
            while lane.items:
                item = lane.items.popleft()
                if not item.future.cancelled():
                    return item
            lane.arrived.clear()
            await lane.arrived.wait()

    def _take_ready(self, lane: _Lane, batch: list[_Item], rows: int) -> int:
        """Move waiting items into the batch while they fit in max_batch rows."""
        while lane.items and rows + lane.items[0].rows <= self.max_batch:
            item = lane.items.popleft()
            if not item.future.cancelled():
                batch.append(item)
                rows += item.rows
        return rows

    async def _batcher(self, key: tuple, lane: _Lane) -> None:
        loop = self._loop
        while True:
            first = await self._take(lane)
            batch, rows = [first], first.rows
            deadline = loop.time() + self.max_wait_s
            while True:
                rows = self._take_ready(lane, batch, rows)
                remaining = deadline - loop.time()
                next_overflows = bool(lane.items) and rows + lane.items[0].rows > self.max_batch
                if rows >= self.max_batch or remaining <= 0 or next_overflows:
                    break
                lane.arrived.clear()
                try:
                    await asyncio.wait_for(lane.arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
            await self._start_slot()
            # Whatever arrived while we waited for a slot rides along.
            rows = self._take_ready(lane, batch, rows)
            batch = [i for i in batch if not i.future.cancelled()]
            if not batch:
                self._finish_slot()
                continue
            asyncio.create_task(self._run(key, batch))

    async def _start_slot(self) -> None:
        """Wait until not paused and a pool slot is free; count the batch as running."""
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: not self._paused)
            await self._slots.acquire()
            if not self._paused:  # no await between this check and the count: drain sees it
                self._running += 1
                return
            self._slots.release()

    def _finish_slot(self) -> None:
        self._running -= 1
        self._slots.release()
        asyncio.create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _run(self, key: tuple, batch: list[_Item]) -> None:
        try:
            hosted = self.hosted(key[0])
            run = _run_generation if hosted.kind == "generator" else _run_scoring
            results = await self._loop.run_in_executor(self._executor, run, hosted.model,
                                                       [i.payload for i in batch])
            self.batches += 1
            self.rows += sum(i.rows for i in batch)
            for item, result in zip(batch, results):
                if not item.future.done():
                    item.future.set_result(result)
        except Exception as exc:  # every caller of the batch gets the error
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
        finally:
            self._finish_slot()

    # ---- weight sync ----------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self, mode: str = "drain", timeout_s: float | None = None) -> float:
        """Stop starting batches and wait for the running ones; returns the seconds waited.

        `timeout_s` defaults to the engine's drain_timeout_s. On a timeout the pause is undone and
        TimeoutError says so.
        """
        timeout_s = self.drain_timeout_s if timeout_s is None else timeout_s
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not supported; valid modes: {', '.join(PAUSE_MODES)}")
        self._bind_loop()
        loop = asyncio.get_running_loop()
        start = loop.time()
        was_paused, self._paused = self._paused, True
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._running == 0), timeout_s)
            except asyncio.TimeoutError:
                # A pause that failed must not stay in force: waiting requests would hang with no error.
                self._paused = was_paused
                self._changed.notify_all()
                raise TimeoutError(f"AsyncEngine did not drain within {timeout_s:.1f}s: "
                                   f"{self._running} batch(es) still running; "
                                   f"{'still paused as before' if was_paused else 'not paused, serving goes on'}"
                                   ) from None
        return loop.time() - start

    async def resume(self) -> None:
        """Start batches again; requests that waited run on the current weights."""
        self._bind_loop()
        self._paused = False
        await self._notify()

    async def load_weights(self, tensors: dict[str, torch.Tensor] | str | Path, version: int,
                           component: str = "transformer", card: str | None = None) -> dict:
        """Copy tensors into a hosted generator (the only one if `card` is None); see Engine.load_weights.

        If the engine is not paused this pauses (draining), loads and resumes itself.
        """
        if card is None:
            generators = [k for k, v in self._models.items() if v.kind == "generator"]
            if len(generators) != 1:
                raise ValueError(f"name the card to load into; hosted generators: {', '.join(generators) or '(none)'}")
            card = generators[0]
        engine = self.engine(card)
        was_paused = self._paused
        if not was_paused:
            await self.pause()
        try:
            return await asyncio.to_thread(engine.load_weights, tensors, version, component)
        finally:
            if not was_paused:
                await self.resume()

    def weight_version(self, card: str) -> int:
        return self.engine(card).weight_version

    def stats(self) -> dict[str, float]:
        out = {"pool/running": self._running, "pool/batches": self.batches, "pool/rows": self.rows,
               "pool/mean_batch": self.rows / self.batches if self.batches else 0.0,
               "pool/queued": sum(len(lane.items) for lane in self._lanes.values())}
        out.update(self.admission.stats())
        # Model calls over the hosted generators (the adaptive loop skips some): totals, and the hit rate of them.
        engines = [h.model for h in self._models.values() if h.kind == "generator" and hasattr(h.model, "stats")]
        steps = sum(e.stats()["engine/steps"] for e in engines)
        computed = sum(e.stats()["engine/steps_computed"] for e in engines)
        out.update({"engine/steps": steps, "engine/steps_computed": computed,
                    "engine/cache_hit_rate": 1.0 - computed / steps if steps else 0.0})
        return out

    # ---- lifecycle ------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Cancel the batchers and fail whatever still waits; running batches finish first."""
        for lane in self._lanes.values():
            if lane.task is not None:
                lane.task.cancel()
            while lane.items:
                item = lane.items.popleft()
                if not item.future.done():
                    item.future.set_exception(RuntimeError("AsyncEngine closed before the request ran"))
        self._lanes.clear()
        if self._changed is not None:
            async with self._changed:
                await self._changed.wait_for(lambda: self._running == 0)
        self._executor.shutdown(wait=False)

    def start_background(self) -> "AsyncEngine":
        """Run the engine on its own event loop in a daemon thread (for callers without a loop)."""
        if self._thread is not None:
            return self
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="async-engine-loop", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(_bind(self), loop).result()
        return self

    def run_sync(self, coro, timeout_s: float | None = None):
        """Run a coroutine of this engine on its background loop from an ordinary thread; its result."""
        if self._loop is None or self._thread is None:
            coro.close()
            raise RuntimeError("run_sync() needs start_background() first")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coro.close()
            raise RuntimeError("run_sync() called on the engine's own loop would deadlock; await the coroutine")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:  # concurrent.futures' (an alias since 3.11): the wait ended, not the coroutine
            future.cancel()  # else it would go on holding the engine's batch slot for a caller that left
            raise TimeoutError(f"no result within {timeout_s:g} s; the call was cancelled") from None

    def close_background(self) -> None:
        """Close the engine and stop its background loop."""
        if self._thread is None:
            return
        self.run_sync(self.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._thread = None


async def _bind(engine: AsyncEngine) -> None:
    engine._bind_loop()


def _default_estimate(request: GenerationRequest, engine: Engine) -> int:
    shape = engine.model.latent_shape(request.height, request.width, request.frames)
    return estimate_generation_bytes(request, shape)


def _run_generation(engine: Engine, requests: list[GenerationRequest]) -> list[Trajectory]:
    traj = engine.generate(requests)
    return [traj.select([i]) for i in range(len(requests))]


def _run_scoring(scorer: Any, payloads: list[tuple]) -> list[torch.Tensor]:
    images = torch.cat([p[0] for p in payloads])
    prompts = [x for p in payloads for x in p[1]]
    metadata = [x for p in payloads for x in p[2]]
    fn = scorer.score if hasattr(scorer, "score") else scorer
    scores = torch.as_tensor(fn(images, prompts, metadata))
    if scores.shape != (images.shape[0],):
        raise ValueError(f"scorer returned shape {tuple(scores.shape)}, expected [{images.shape[0]}]")
    return list(scores.split([len(p[1]) for p in payloads]))
