"""WeightSyncController: moves the trainer's weights into the serving engine.

The contract (DESIGN.md): freeze -> drain -> transfer -> bump version +
invalidate caches -> resume. Calls already running finish on the version they
started with; calls that arrive during a sync wait and then run on the new
version; nothing is dropped. Each phase is timed for the metrics, every
rendezvous has a timeout, and `verify=True` compares per-tensor checksums of
sender and receiver after the transfer.

Transports:
- colocated: the engine serves the trainer's own module; nothing is copied.
- copy: the engine holds its own copy in this process (named tensors copied in place).
- disk: safetensors written atomically, then loaded by the engine from the path.
- shm: an engine in another process (`flywheel.sync.engine_process`): tensors written
  straight into the engine's weights mapped in shared memory, or staged in
  shared-memory buckets for an engine on an accelerator.
"""

from __future__ import annotations

import enum
import tempfile
import time
from pathlib import Path
from typing import Protocol

import torch

from flywheel.sync.transport import DEFAULT_BUCKET_BYTES, SharedMemorySender, SharedWeightsWriter, save_weights_atomic, \
    tensor_checksums, verify_checksums

class SyncState(enum.Enum):
    IDLE = "idle"
    FROZEN = "frozen"
    DRAINED = "drained"
    TRANSFERRED = "transferred"


class EngineHandle(Protocol):
    """What the controller needs of an engine, in this process or another."""

    weight_version: int

    def pause(self, mode: str = "drain") -> None: ...
    def drain(self, timeout_s: float = 600.0) -> float: ...
    def resume(self) -> None: ...


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class ColocatedTransport:
    """The engine already serves the trainer's tensors: only the version moves."""

    name = "colocated"

    def transfer(self, engine, tensors, version: int, component: str) -> int:
        engine.set_weight_version(version, prompt_encoder_changed=engine.feeds_prompt_cache(component))
        return 0


class CopyTransport:
    """Copy named tensors into an engine's own module in this process."""

    name = "copy"

    def transfer(self, engine, tensors, version: int, component: str) -> int:
        engine.load_weights(tensors, version, component=component)
        return _nbytes(tensors)


class DiskTransport:
    """Write safetensors atomically into `directory`, then have the engine load the path."""

    name = "disk"

    def __init__(self, directory: str | Path | None = None):
        self.directory = Path(directory or tempfile.mkdtemp(prefix="flywheel-sync-"))
        self.directory.mkdir(parents=True, exist_ok=True)

    def transfer(self, engine, tensors, version: int, component: str) -> int:
        path = save_weights_atomic(tensors, self.directory / f"{component}.safetensors", version)
        engine.load_weights(str(path), version, component=component)
        return _nbytes(tensors)


class SharedMemoryTransport:
    """Tensors for an engine in another process, through shared memory.

    Mapped (the default where the engine's weights are in host memory): the
    engine moves the synced tensors into a shared-memory block once, and each
    sync writes straight into them, one copy and no message per tensor. An
    engine on an accelerator gets buckets instead: staged in two shared blocks,
    packed by this side while the engine copies the previous one out.
    Either way the engine process refuses to generate from weights that a
    transfer began and no commit ended.
    """

    name = "shm"

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, mapped: bool = True):
        self.sender = SharedMemorySender(bucket_bytes)
        self.mapped = mapped
        self._writers: dict[tuple[int, str], SharedWeightsWriter | None] = {}

    def _writer(self, engine, component: str, names: list[str]) -> SharedWeightsWriter | None:
        key = (id(engine), component)
        writer = self._writers.get(key)
        if writer is not None and writer.covers(names):
            return writer
        if key in self._writers and writer is None:
            return None  # this engine cannot map its weights
        reply = engine.map_shared(names, component=component)
        if writer is not None:
            writer.close()
        self._writers[key] = SharedWeightsWriter(reply["shm"], reply["manifest"]) if reply["mapped"] else None
        return self._writers[key]

    def transfer(self, engine, tensors, version: int, component: str) -> int:
        writer = self._writer(engine, component, list(tensors)) if self.mapped else None
        if writer is not None:
            return writer.write(tensors)
        return self.sender.send(tensors, lambda shm, slots: engine.receive_bucket(shm, slots, component))

    def share_layout(self, engine, tensors: dict[str, torch.Tensor], component: str = "transformer") -> bool:
        """Lay the trainer's own tensors (the Parameters) out like the engine's mapped block, so that
        each later sync of them is a single memcpy (`SharedWeightsWriter.share_layout`)."""
        writer = self._writer(engine, component, list(tensors)) if self.mapped else None
        return writer is not None and writer.share_layout(tensors)

    def commit(self, engine, version: int, component: str) -> None:
        engine.commit_weights(version, component=component)

    def close(self) -> None:
        for writer in self._writers.values():
            if writer is not None:
                writer.close()
        self._writers = {}
        self.sender.close()


TRANSPORTS = {"colocated": ColocatedTransport, "copy": CopyTransport, "disk": DiskTransport,
              "shm": SharedMemoryTransport}


def make_transport(name: str, **kwargs):
    if name not in TRANSPORTS:
        raise ValueError(f"weight sync transport {name!r} is not available; valid: {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name](**kwargs)


def engine_checksums(engine, names: list[str], component: str) -> dict[str, str]:
    """Checksums of the engine's tensors (a remote handle computes them where the tensors live)."""
    if hasattr(engine, "checksums"):
        return engine.checksums(names, component=component)
    state = engine.component(component).state_dict()
    return tensor_checksums({n: state[n] for n in names})


class WeightSyncController:
    """Runs the sync protocol against one engine and counts versions."""

    def __init__(self, engine: EngineHandle, mode: str = "colocated", timeout_s: float = 600.0,
                 verify: bool = False, transport=None):
        self.engine = engine
        self.transport = transport if transport is not None else make_transport(mode)
        self.mode = self.transport.name
        self.timeout_s = timeout_s
        self.verify = verify
        self.state = SyncState.IDLE

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def close(self) -> None:
        """Release the transport's staging memory (shared-memory blocks)."""
        if hasattr(self.transport, "close"):
            self.transport.close()

    def sync(self, tensors: dict[str, torch.Tensor] | None = None, component: str = "transformer",
             prompt_encoder_changed: bool = False) -> dict[str, float]:
        """Push `tensors` (named like the engine's `component`; None when colocated) and bump the version.

        Returns the phase timings, the bytes moved and the new version.
        """
        if self.state is not SyncState.IDLE:
            raise RuntimeError(f"a weight sync is already in progress (state {self.state.value})")
        if tensors is None and self.mode != "colocated":
            raise ValueError(f"transport {self.mode!r} needs the tensors to send")
        if prompt_encoder_changed:
            component = "prompt_encoder"
        start = time.perf_counter()
        self.engine.pause()
        self.state = SyncState.FROZEN
        try:
            drain_s = self.engine.drain(timeout_s=self.timeout_s)
            self.state = SyncState.DRAINED
            version = self.engine.weight_version + 1
            transfer_start = time.perf_counter()
            moved = self.transport.transfer(self.engine, tensors, version, component)
            transfer_s = time.perf_counter() - transfer_start
            self.state = SyncState.TRANSFERRED
            if self.verify and tensors:
                # Before the commit: an engine process keeps refusing to serve weights that failed it.
                verify_checksums(tensor_checksums(tensors), engine_checksums(self.engine, list(tensors), component))
            commit_start = time.perf_counter()
            if hasattr(self.transport, "commit"):  # transports whose transfer leaves the version to a commit
                self.transport.commit(self.engine, version, component)
            commit_s = time.perf_counter() - commit_start
        finally:
            self.engine.resume()
            self.state = SyncState.IDLE
        return {
            "sync/drain_s": drain_s,
            "sync/transfer_s": transfer_s,
            "sync/commit_s": commit_s,
            "sync/total_s": time.perf_counter() - start,
            "sync/bytes": float(moved),
            "weight_version": self.engine.weight_version,
        }
