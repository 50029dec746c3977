"""A pool of rollout replicas on Ray that looks like one `Engine` to the flywheel and the sync controller.

    ray.init(address="auto")                      # or a local Ray: ray.init(num_cpus=...)
    pool = RayEnginePool("toy-digits", replicas=2, cpus_per_replica=1)
    traj = pool.generate(requests)                # split over the replicas, gathered in request order
    WeightSyncController(pool, transport=RayObjectStoreTransport()).sync(weights)

Each replica is a Ray actor (`EngineReplica`) holding an `Engine` on its card.
`generate` cuts a call's requests into contiguous, balanced chunks (sizes differ
by at most one), one per replica, and joins the answers in request order. A
request's noise comes from its own seed, so the samples are the local engine's:
bitwise when the local engine runs the same batch shapes (`max_batch` equal to
the chunk size), within the engine's batch invariance (<= 1e-5 on the CPU)
otherwise.

Weight sync follows the controller's contract on every replica at once:
`pause` closes the pool's gate (calls that arrive wait here, before anything is
sent); `drain` waits for the calls already sent, then pauses and drains each
engine (not before: a chunk queued at a replica must not wait for a resume);
`write_weights` puts the tensors in the object store once (`ray.put`) and every
replica copies them in, marking itself half-written until `commit_weights` sets
the new version on all of them; `resume` opens the gate. A call is dispatched as
a whole under the gate, so all its chunks run on one version.

Faults: replicas are started with `max_restarts`; a chunk whose replica died
waits for Ray to restart it, the pool re-syncs it to the current version (the
last committed weights, still held in the object store) and checks its
checksums, then sends the chunk again: the call returns the same samples. A
restarted replica refuses to generate until it is re-synced (it knows it was
restarted from Ray's runtime context), so it never serves the card's weights
under a newer version. After `max_failures` failed attempts of one chunk the call
raises an error naming the replica and the last failure.

Under `accelerate launch`, each rank drives its own share of the replicas
(`build_rollout_engine` gives rank r replicas/world of them): the flywheel
already generates each rank's rows on that rank, so nothing gathers or scatters
rollouts across ranks, every rank pushes its (identical, after the DDP/FSDP
step) weights to its replicas in parallel, and one rank's trainer stalling does
not hold the others' replicas. Rank 0 driving a single pool would need the
other ranks' rows sent through rank 0 and back, and a barrier per step.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from collections.abc import Callable

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from engine import Engine, GenerationRequest, Trajectory
from engine.cards import load_model
from flywheel.lora import add_lora
from flywheel.scale.ray_sync import broadcast_bucket, weight_group
from flywheel.sync.transport import plan_buckets, tensor_checksums, unpack_bucket


class ReplicaNotSynced(RuntimeError):
    """A replica refused to generate: it was restarted, or a sync wrote into it and did not commit."""


RESTARTED = "restarted"  # EngineReplica.unsynced of a replica Ray rebuilt and the pool has not restored yet


def balanced_chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges covering range(n) in at most `parts` non-empty pieces whose sizes differ by <= 1
    (the first n % parts pieces get the extra row)."""
    if n < 1 or parts < 1:
        raise ValueError(f"balanced_chunks needs n >= 1 and parts >= 1, got {n} and {parts}")
    parts = min(parts, n)
    base, extra = divmod(n, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def host_trajectory(traj: Trajectory) -> Trajectory:
    """The trajectory with every tensor on the host (what travels back through the object store)."""
    changes = {}
    for f in dataclasses.fields(traj):
        value = getattr(traj, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value.detach().cpu()
        elif isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
            changes[f.name] = {k: v.detach().cpu() for k, v in value.items()}
    return dataclasses.replace(traj, **changes)


def was_restarted() -> bool:
    """Whether Ray rebuilt this actor after it died (Ray 2.60 warns about its own actor_id inside the call)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.get_runtime_context().was_current_actor_reconstructed


def wait_until_alive(actor, timeout_s: float, what: str) -> dict:
    """The actor's `state()` once Ray has restarted it (calls to an actor that is restarting fail or queue)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.state.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except (RayActorError, GetTimeoutError) as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come back within {timeout_s:.0f}s (Ray restarts it at most "
                                   f"max_restarts times); last error: {type(exc).__name__}: {exc}") from exc
            time.sleep(0.1)


def wait_for_start(actors: list, timeout_s: float, what: str, cpus: float, gpus: float) -> None:
    """Wait until every actor is built; past `timeout_s` (most often: the cluster cannot place them), kill them and
    raise an error that gives what they asked for and what Ray has."""
    try:
        ray.get([a.state.remote() for a in actors], timeout=timeout_s)
    except GetTimeoutError as exc:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        have = {k: ray.available_resources().get(k, 0.0) for k in ("CPU", "GPU")}
        total = {k: ray.cluster_resources().get(k, 0.0) for k in ("CPU", "GPU")}
        raise TimeoutError(f"{what} did not start within {timeout_s:.0f}s: they ask for {cpus:g} CPU(s) and {gpus:g} "
                           f"GPU(s) in all; Ray has {have['CPU']:g} CPU(s) and {have['GPU']:g} GPU(s) free of "
                           f"{total['CPU']:g} and {total['GPU']:g}. Ask for less per actor, or add nodes "
                           "(ray start --address=<head>:6379)") from exc


def get_retrying(ref, resend: Callable, recover: Callable, what: str, timeout_s: float, max_failures: int):
    """`ray.get(ref)`; when the actor died (or a restarted replica refused), `recover()` and `resend()`, at most
    `max_failures` times before an error naming `what` and the last failure."""
    attempts = 0
    while True:
        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError as exc:
            raise TimeoutError(f"{what} did not answer within {timeout_s:.0f}s") from exc
        except (RayActorError, ReplicaNotSynced) as exc:
            attempts += 1
            if attempts > max_failures:
                raise RuntimeError(f"{what} failed {attempts} time(s) (max_failures={max_failures}); last error: "
                                   f"{type(exc).__name__}: {exc}") from exc
            recover()
            ref = resend()


class EngineReplica:
    """One rollout replica (run as a Ray actor by `RayEnginePool`): an Engine and the engine side of sync."""

    def __init__(self, index: int, card: str, path: str | None, device: str, weight_version: int,
                 lora: dict | None, model_factory: Callable | None, threads: int):
        torch.set_num_threads(threads)
        model = model_factory() if model_factory is not None else load_model(card, path=path, device=device)
        model.transformer.eval()
        if lora:
            # The trainer's adapter layout, so that a LoRA-only sync carries just the adapter tensors.
            add_lora(model.transformer, lora["rank"], lora["alpha"], list(lora["targets"]))
        self.engine = Engine(model, device=device, weight_version=weight_version)
        self.index = index
        self.restarted = was_restarted()
        # Set by a restart or an uncommitted write: the weights are not those of the version the pool serves.
        self.unsynced = RESTARTED if self.restarted else None
        self.requests = 0
        self.busy_s = 0.0
        self.lock = threading.Lock()

    def generate(self, requests: list[GenerationRequest]) -> Trajectory:
        if self.unsynced:
            raise ReplicaNotSynced(f"rollout replica {self.index} (pid {os.getpid()}) will not generate: "
                                   f"{self.unsynced}; the pool re-syncs it first")
        start = time.perf_counter()
        traj = host_trajectory(self.engine.generate(requests))
        with self.lock:
            self.requests += len(requests)
            self.busy_s += time.perf_counter() - start
        return traj

    def card_id(self) -> str:
        return self.engine.card_id

    def pause(self, mode: str = "drain") -> None:
        self.engine.pause(mode)

    def drain(self, timeout_s: float) -> float:
        return self.engine.drain(timeout_s=timeout_s)

    def resume(self) -> None:
        self.refuse_if_restarted("to resume")  # the pool restores it first, then resumes it
        self.engine.resume()

    def refuse_if_restarted(self, what: str) -> None:
        """A rebuilt replica holds the card's weights: a sync's write, commit or checksums would be about those,
        so it refuses them until the pool has restored it (`restore`)."""
        if self.unsynced == RESTARTED:
            raise ReplicaNotSynced(f"rollout replica {self.index} (pid {os.getpid()}) was restarted and holds the "
                                   f"card's weights: it refuses {what} until the pool restores it")

    def write_weights(self, tensors: dict[str, torch.Tensor], component: str) -> int:
        """Copy the tensors in (the engine paused and drained); the replica refuses to serve until `commit`."""
        self.refuse_if_restarted("a weight write")
        self.unsynced = f"its {component} weights were partly written by a sync that did not commit"
        return self.engine.write_weights(tensors, component)

    def join_group(self, backend: str, host: str, port: int, rank: int, size: int, timeout_s: float) -> int:
        """Join the trainer's weight-broadcast group (flywheel.scale.ray_sync.CollectiveTransport) as `rank`."""
        self.group = weight_group(backend, host, port, rank, size, timeout_s)
        return rank

    def receive_broadcast(self, manifest: list, component: str, bucket_bytes: int) -> int:
        """Receive the trainer's broadcast buckets (the `plan_buckets` layout of `manifest`) into `component`;
        the replica refuses to serve until `commit`."""
        self.refuse_if_restarted("a broadcast sync")
        self.unsynced = f"its {component} weights were partly written by a sync that did not commit"
        like = {name: torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
                for name, dtype, shape in manifest}
        total = 0
        for slots in plan_buckets(like, bucket_bytes):
            buffer = torch.empty(sum(slot.nbytes for slot in slots), dtype=torch.uint8, device=self.engine.device)
            broadcast_bucket(self.group, buffer)
            total += self.engine.write_weights(unpack_bucket(buffer, slots, copy=False), component)  # on its device
        return total

    def commit(self, version: int, component: str) -> int:
        self.refuse_if_restarted(f"the commit of version {version}")
        self.engine.set_weight_version(version, prompt_encoder_changed=self.engine.feeds_prompt_cache(component))
        self.unsynced = None
        return version

    def restore(self, weights: dict[str, ray.ObjectRef], version: int, paused: bool = False) -> int:
        """Bring a restarted replica to `version`: the committed weights of each component, then the version.
        `paused`: leave the engine paused and drained (a sync is under way: it resumes the replica)."""
        self.engine.pause()
        try:
            self.engine.drain()
            for component, ref in weights.items():
                self.engine.write_weights(ray.get(ref), component)
            if version != self.engine.weight_version:
                self.engine.set_weight_version(version, prompt_encoder_changed=True)
            self.unsynced = None
        finally:
            if not paused:
                self.engine.resume()
        return version

    def checksums(self, names: list[str] | None, component: str) -> dict[str, str]:
        self.refuse_if_restarted("checksums")
        state = self.engine.component(component).state_dict()
        return tensor_checksums({n: state[n] for n in (names if names is not None else state)})

    def state(self) -> dict:
        with self.lock:
            return {"version": self.engine.weight_version, "requests": self.requests, "busy_s": self.busy_s,
                    "restarted": self.restarted, "unsynced": self.unsynced, "pid": os.getpid(),
                    "in_group": hasattr(self, "group")}


class RayEnginePool:
    """N rollout replicas behind the Engine interface (generate, card_id, weight_version, pause/drain/resume,
    load_weights, write_weights/commit_weights, checksums, metrics, close). `ray.init` must have run."""

    def __init__(self, card: str, replicas: int = 2, path: str | None = None, cpus_per_replica: float = 1.0,
                 gpus_per_replica: float = 0.0, weight_version: int = 0, lora: dict | None = None,
                 model_factory: Callable | None = None, max_failures: int = 3, max_restarts: int = 3,
                 call_timeout_s: float = 600.0, restart_timeout_s: float = 120.0, start_timeout_s: float = 300.0,
                 max_concurrency: int = 8,
                 threads: int = 1, name: str = "rollout"):
        """`model_factory`: a picklable function returning the FlowModel (instead of loading `card`);
        `max_failures`: attempts of one chunk that may fail before the call raises; `max_restarts`: how often
        Ray restarts one replica; `start_timeout_s`: the wait for every replica to be placed and loaded;
        `max_concurrency`: calls a replica serves at once (sync calls among them)."""
        if not ray.is_initialized():
            raise RuntimeError("RayEnginePool needs a running Ray: call ray.init() (a local Ray) or "
                               "ray.init(address='auto') (a cluster started with `ray start --head`) first")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if max_failures < 0 or max_restarts < 0:
            raise ValueError(f"max_failures and max_restarts must be >= 0, got {max_failures} and {max_restarts}")
        self.max_failures, self.call_timeout_s, self.restart_timeout_s = max_failures, call_timeout_s, restart_timeout_s
        self.name = name
        device = "cuda" if gpus_per_replica > 0 else "cpu"
        # max_task_retries=0: Ray must not re-run a chunk on a restarted replica by itself, since that
        # replica has to be re-synced first; the pool retries.
        actor = ray.remote(EngineReplica).options(num_cpus=cpus_per_replica, num_gpus=gpus_per_replica,
                                                  max_restarts=max_restarts, max_task_retries=0,
                                                  max_concurrency=max_concurrency)
        self.replicas = [actor.remote(i, card, path, device, weight_version, lora, model_factory, threads)
                         for i in range(replicas)]
        wait_for_start(self.replicas, start_timeout_s, f"{replicas} {name} replica(s)", replicas * cpus_per_replica,
                       replicas * gpus_per_replica)
        self._card = ray.get(self.replicas[0].card_id.remote(), timeout=call_timeout_s)
        self._version = weight_version
        self._committed: dict[str, ray.ObjectRef] = {}  # component -> its last committed weights
        self._written: dict[str, ray.ObjectRef] = {}  # written, not yet committed
        self._gate = threading.Condition()
        self._paused = False
        self._in_flight = 0
        self._next = 0  # the replica that takes the next call's first chunk (spreads small calls)
        self._recovery_locks = [threading.Lock() for _ in self.replicas]
        self._replicas_paused = False  # a sync drained the replicas' engines and has not resumed them
        self.failures = 0
        self.resyncs = 0

    # ---- the Engine interface -----------------------------------------------------------------

    @property
    def card_id(self) -> str:
        return self._card

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: list[GenerationRequest]) -> Trajectory:
        """Generate on the replicas (requests of one batch key); one Trajectory in request order."""
        if not requests:
            raise ValueError("generate() needs at least one request")
        with self._gate:
            while self._paused:
                self._gate.wait()
            self._in_flight += 1
            version = self._version
            bounds = balanced_chunks(len(requests), len(self.replicas))
            first = self._next
            self._next = (self._next + len(bounds)) % len(self.replicas)
            # Sent under the gate: a sync cannot start between two chunks of one call.
            jobs = []
            for j, (lo, hi) in enumerate(bounds):
                index = (first + j) % len(self.replicas)
                jobs.append((index, requests[lo:hi], self.replicas[index].generate.remote(requests[lo:hi])))
        try:
            return Trajectory.concat([self._result(index, chunk, ref, version) for index, chunk, ref in jobs])
        finally:
            with self._gate:
                self._in_flight -= 1
                self._gate.notify_all()

    def _result(self, index: int, chunk: list[GenerationRequest], ref, version: int) -> Trajectory:
        def recover() -> None:
            self.failures += 1
            self._recover(index, version)

        return get_retrying(ref, lambda: self.replicas[index].generate.remote(chunk), recover,
                            f"{self.name} replica {index} ({len(chunk)} request(s))", self.call_timeout_s,
                            self.max_failures)

    def _recover(self, index: int, version: int) -> None:
        """Wait for Ray to restart replica `index`, then re-sync it to `version` and check its weights.

        During a sync (the replicas drained) the restored replica stays paused, and the tensors written but
        not committed yet are written into it again, so the sync carries on where the replica died."""
        with self._recovery_locks[index]:  # two calls that saw the same death re-sync once
            replica = self.replicas[index]
            state = wait_until_alive(replica, self.restart_timeout_s, f"{self.name} replica {index}")
            # Restore a replica rebuilt from the card, or one a failed sync left half-written; one that
            # another call restored already, or that holds this sync's write, carries on.
            if state["unsynced"] != RESTARTED and state["version"] == version and (
                    not state["unsynced"] or self._written):
                return
            ray.get(replica.restore.remote(dict(self._committed), version, self._replicas_paused),
                    timeout=self.call_timeout_s)
            for component, ref in self._committed.items():
                # Checked against what the trainer sent (hashed here, only when a replica comes back).
                expected = tensor_checksums(ray.get(ref))
                got = ray.get(replica.checksums.remote(list(expected), component))
                if got != expected:
                    wrong = sorted(n for n in got if got[n] != expected.get(n))
                    raise RuntimeError(f"{self.name} replica {index} was re-synced to version {version} but its "
                                       f"{component} tensors differ from the committed ones: {wrong[:5]}")
            for component, ref in self._written.items():  # a sync under way: its uncommitted write again
                ray.get(replica.write_weights.remote(ref, component), timeout=self.call_timeout_s)
            self.resyncs += 1

    def _on_replicas(self, what: str, call: Callable, timeout_s: float | None = None) -> list:
        """`call(replica)` on every replica at once and their answers in order; a replica that died (or was
        restarted and refuses) is restored by `_recover` to the committed version and asked again, at most
        `max_failures` times. Every call of a sync goes through here, so a replica that dies during one is
        restarted, re-synced, checked and brought into the sync (issue 22: drain/resume used to raise
        ActorUnavailableError)."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        refs = [call(replica) for replica in self.replicas]

        def recover(index: int) -> None:
            self.failures += 1
            self._recover(index, self._version)

        return [get_retrying(ref, lambda i=index: call(self.replicas[i]), lambda i=index: recover(i),
                             f"{self.name} replica {index} ({what})", timeout_s, self.max_failures)
                for index, ref in enumerate(refs)]

    # ---- the engine side of weight sync (WeightSyncController's EngineHandle) -------------------

    def pause(self, mode: str = "drain") -> None:
        """Stop sending calls: those that arrive wait here, before any chunk is sent, and run after `resume`."""
        if mode != "drain":
            raise ValueError(f"pause mode {mode!r} is not supported; valid modes: drain")
        with self._gate:
            self._paused = True

    def drain(self, timeout_s: float = 600.0) -> float:
        """Wait for the calls already sent (every chunk, retries included), then pause and drain every replica's
        engine; returns the seconds waited.

        The engines are paused only now: a chunk sent before the pause but still queued at its replica must
        run, or it would wait for a resume that waits for it."""
        start = time.perf_counter()
        with self._gate:
            if not self._paused:
                raise RuntimeError("drain() needs pause() first, or new calls could keep arriving")
            if not self._gate.wait_for(lambda: self._in_flight == 0, timeout=timeout_s):
                raise TimeoutError(f"{self.name} pool did not drain within {timeout_s:.1f}s: "
                                   f"{self._in_flight} generate() call(s) still running")
        left = max(0.0, timeout_s - (time.perf_counter() - start))
        self._replicas_paused = True  # from here a replica restored by _recover stays paused
        self._on_replicas("pause", lambda r: r.pause.remote("drain"))
        self._on_replicas("drain", lambda r: r.drain.remote(left), timeout_s=left + self.call_timeout_s)
        return time.perf_counter() - start

    def resume(self) -> None:
        self._on_replicas("resume", lambda r: r.resume.remote())
        self._replicas_paused = False
        self._written = {}  # a write no commit ended (a failed sync): never replayed into a restored replica
        with self._gate:
            self._paused = False
            self._gate.notify_all()

    def write_weights(self, tensors, component: str = "transformer") -> int:
        """Put the tensors (a name -> tensor dict, or an ObjectRef of one) in the object store once; every
        replica copies them in. Needs a paused, drained pool; `commit_weights` sets the version."""
        with self._gate:
            if not self._paused or self._in_flight:
                raise RuntimeError(f"write_weights needs a paused, drained pool (paused={self._paused}, "
                                   f"calls running={self._in_flight})")
        ref = tensors if isinstance(tensors, ray.ObjectRef) else ray.put(
            {n: t.detach().to("cpu") for n, t in tensors.items()})
        self._written[component] = ref
        written = self._on_replicas(f"write of {component}", lambda r: r.write_weights.remote(ref, component))
        return sum(written) // len(self.replicas)

    def join_group(self, backend: str, host: str, port: int, timeout_s: float) -> list:
        """Ask every replica to join the weight-broadcast group as ranks 1..N (the trainer is rank 0);
        returns the refs to wait for once the trainer's side has joined too."""
        size = 1 + len(self.replicas)
        return [r.join_group.remote(backend, host, port, 1 + i, size, timeout_s) for i, r in enumerate(self.replicas)]

    def all_in_group(self) -> bool:
        """Whether every replica holds the weight-broadcast group. A restarted one does not: it is restored
        here first (it would refuse the broadcast's receives), then the transport forms the group again."""
        states = self._on_replicas("state", lambda r: r.state.remote())
        for index, state in enumerate(states):
            if state["unsynced"] == RESTARTED:
                self.failures += 1
                self._recover(index, self._version)
        return all(state["in_group"] for state in states)

    def receive_broadcast(self, manifest: list, component: str, bucket_bytes: int, restore_copy) -> Callable:
        """Every replica posts the receives of a broadcast sync (paused, drained pool); returns the wait for them.
        `restore_copy` (an ObjectRef of the same tensors on the host) is what a restarted replica is re-synced from."""
        with self._gate:
            if not self._paused or self._in_flight:
                raise RuntimeError(f"a broadcast sync needs a paused, drained pool (paused={self._paused}, "
                                   f"calls running={self._in_flight})")
        refs = [r.receive_broadcast.remote(manifest, component, bucket_bytes) for r in self.replicas]
        self._written[component] = restore_copy
        return lambda: ray.get(refs, timeout=self.call_timeout_s)

    def commit_weights(self, version: int, component: str = "transformer") -> None:
        """Mark `version` on every replica; from now on a restarted replica is re-synced to these weights."""
        if component not in self._written:
            raise RuntimeError(f"commit_weights({version}, {component!r}) without write_weights first")
        self._on_replicas(f"commit of version {version}", lambda r: r.commit.remote(version, component))
        self._committed[component] = self._written.pop(component)
        self._version = version

    def load_weights(self, tensors, version: int, component: str = "transformer") -> dict:
        """write_weights + commit_weights (for CopyTransport); pauses and drains itself if not paused."""
        was_paused = self._paused
        if not was_paused:
            self.pause()
        try:
            if not was_paused:
                self.drain()
            moved = self.write_weights(tensors, component)
            self.commit_weights(version, component)
            return {"version": version, "component": component, "bytes": moved}
        finally:
            if not was_paused:
                self.resume()

    def checksums(self, names: list[str], component: str = "transformer") -> dict[str, str]:
        """The replicas' checksums of `names`; an error naming the replica if any of them differs from replica 0."""
        per_replica = self._on_replicas("checksums", lambda r: r.checksums.remote(list(names), component))
        for index, got in enumerate(per_replica[1:], start=1):
            wrong = sorted(n for n in got if got[n] != per_replica[0].get(n))
            if wrong:
                raise RuntimeError(f"{self.name} replica {index} holds different {component} tensors than replica 0 "
                                   f"after the transfer: {wrong[:5]}")
        return per_replica[0]

    def metrics(self) -> dict[str, float]:
        """Per replica: requests served, busy seconds, weight version, restarted (0/1); and the pool's counts."""
        out = {f"{self.name}/failures": float(self.failures), f"{self.name}/resyncs": float(self.resyncs)}
        for index, state in enumerate(self._on_replicas("state", lambda r: r.state.remote())):
            prefix = f"{self.name}/replica{index}"
            out.update({f"{prefix}/requests": float(state["requests"]), f"{prefix}/busy_s": state["busy_s"],
                        f"{prefix}/version": float(state["version"]), f"{prefix}/restarted": float(state["restarted"])})
        return out

    def close(self) -> None:
        for replica in self.replicas:
            ray.kill(replica, no_restart=True)
        self.replicas = []
        self._committed, self._written = {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
