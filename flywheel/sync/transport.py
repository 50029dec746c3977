"""Moving named tensors from a trainer to an engine: buckets, shared memory, disk, broadcast.

All transports move raw tensor bytes plus a JSON manifest (name, dtype, shape,
offset); nothing is pickled. Large models go in fixed-size buckets so that the
staging memory stays bounded whatever the model size.

Shared-memory segments are named `flywheel_<pid of the creator>_<random>`, so
`ls /dev/shm` says which process made each. Whoever creates a segment unlinks
it: on `close()`, and, when the creator dies without closing, Python's
resource tracker (a helper process that outlives it) unlinks the segments the
creator registered. An engine process also unlinks its own at once when its
trainer dies (`flywheel.sync.engine_process`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Callable

import numpy as np
import torch

DEFAULT_BUCKET_BYTES = 32 * 2**20
SEGMENT_PREFIX = "flywheel_"  # + "<creator pid>_<random>"; kept short: macOS allows 31 characters

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives inside a bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes}

    @staticmethod
    def from_json(d: dict) -> "TensorSlot":
        return TensorSlot(d["name"], d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"])


def plan_buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[TensorSlot]]:
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor gets a bucket of its own)."""
    buckets: list[list[TensorSlot]] = [[]]
    used = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which no transport carries; "
                            f"supported: {', '.join(_DTYPES)}")
        buckets[-1].append(TensorSlot(name, dtype, tuple(t.shape), used, nbytes))
        used += nbytes
    return [b for b in buckets if b]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (CPU, contiguous)."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def pack_bucket(tensors: dict[str, torch.Tensor], slots: list[TensorSlot], buffer: torch.Tensor) -> None:
    """Copy each slot's tensor into `buffer` (a uint8 tensor) at its offset."""
    for s in slots:
        buffer[s.offset:s.offset + s.nbytes].copy_(_byte_view(tensors[s.name]))


def unpack_bucket(buffer: torch.Tensor, slots: list[TensorSlot], copy: bool = True) -> dict[str, torch.Tensor]:
    """Tensors of a bucket read back from `buffer` (copied out unless copy=False)."""
    out = {}
    for s in slots:
        raw = buffer[s.offset:s.offset + s.nbytes]
        if copy:
            raw = raw.clone()
        out[s.name] = raw.view(_DTYPES[s.dtype]).reshape(s.shape)
    return out


def tensor_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """A blake2b digest of every tensor's bytes, for verifying a transfer bit for bit."""
    return {name: hashlib.blake2b(_byte_view(t).numpy().tobytes(), digest_size=16).hexdigest()
            for name, t in tensors.items()}


def verify_checksums(sent: dict[str, str], received: dict[str, str]) -> None:
    """Raise if any tensor differs between sender and receiver (names or bytes)."""
    missing = sorted(set(sent) - set(received))
    extra = sorted(set(received) - set(sent))
    wrong = sorted(n for n in set(sent) & set(received) if sent[n] != received[n])
    if missing or extra or wrong:
        raise RuntimeError("weight sync verification failed: "
                           f"{len(wrong)} tensor(s) differ {wrong[:5]}, {len(missing)} missing {missing[:5]}, "
                           f"{len(extra)} unexpected {extra[:5]}")


# ---- shared memory -------------------------------------------------------------------------


def create_segment(size: int) -> shared_memory.SharedMemory:
    """A new shared-memory block named after this process (see the module docstring).

    Created blocks are registered with this process's resource tracker, which
    unlinks them if the process dies without unlinking them itself.
    """
    while True:
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        try:
            return shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:  # another block drew the same random suffix
            continue


class SharedMemorySender:
    """Stages buckets in two named shared-memory blocks that a receiver process maps.

    `send(tensors, deliver)` packs bucket k into block k % 2 and calls
    `deliver(shm_name, slots_json)`. If `deliver` waits for the receiver, the
    transfer is synchronous; if it returns a callable instead, that callable
    is the rendezvous (it returns once the receiver has copied the bucket
    out), and the sender packs the next bucket into the other block while
    the receiver copies this one: the two copies overlap.
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.bucket_bytes = bucket_bytes
        self._blocks: list[shared_memory.SharedMemory] = []
        self._release = None

    def _ensure_blocks(self, size: int) -> None:
        if len(self._blocks) == 2 and all(b.size >= size for b in self._blocks):
            return
        self.close()
        self._blocks = [create_segment(max(size, 1)) for _ in range(2)]
        # Unlinked by close(), else when the sender is collected or the interpreter exits (a
        # KeyboardInterrupt or sys.exit that skipped close); a killed process leaves them to the tracker.
        self._release = weakref.finalize(self, _unlink_blocks, self._blocks)

    def send(self, tensors: dict[str, torch.Tensor],
             deliver: Callable[[str, list[dict]], Callable[[], None] | None]) -> int:
        buckets = plan_buckets(tensors, self.bucket_bytes)
        self._ensure_blocks(max((sum(s.nbytes for s in b) for b in buckets), default=1))
        buffers = [torch.frombuffer(b.buf, dtype=torch.uint8) for b in self._blocks]
        waiting: deque[Callable[[], None]] = deque()  # rendezvous of blocks in use, oldest first
        total = 0
        try:
            for i, slots in enumerate(buckets):
                if len(waiting) == 2:
                    waiting.popleft()()  # the oldest delivery used the block this bucket goes into
                pack_bucket(tensors, slots, buffers[i % 2])
                wait = deliver(self._blocks[i % 2].name, [s.to_json() for s in slots])
                if wait is not None:
                    waiting.append(wait)
                total += sum(s.nbytes for s in slots)
            while waiting:
                waiting.popleft()()
        finally:
            del buffers
        return total

    def close(self) -> None:
        if self._release is not None:
            self._release()  # runs once
        self._blocks, self._release = [], None


def _unlink_blocks(blocks: list[shared_memory.SharedMemory]) -> None:
    for block in blocks:
        block.unlink()
        try:
            block.close()
        except BufferError:  # a view of the block is still alive; the mapping goes with it
            pass


_ATTACHED: dict[str, shared_memory.SharedMemory] = {}
_CREATED: set[str] = set()  # blocks this process made (and its resource tracker unlinks)


def _attach(shm_name: str) -> shared_memory.SharedMemory:
    """Map a sender's block once and keep it mapped: re-mapping per bucket would fault every page again."""
    shm = _ATTACHED.get(shm_name)
    if shm is None:
        shm = shared_memory.SharedMemory(name=shm_name)
        # Python < 3.13 registers an attached block with this process's resource
        # tracker, which would unlink the sender's block when this process exits.
        if shm_name not in _CREATED:
            resource_tracker.unregister(shm._name, "shared_memory")
        _ATTACHED[shm_name] = shm
    return shm


def receive_shared_memory_bucket(shm_name: str, slots_json: list[dict],
                                 into: dict[str, torch.Tensor] | None = None,
                                 copy: bool = True) -> dict[str, torch.Tensor]:
    """Receiver side: one bucket's tensors out of the sender's block.

    Copied into `into` where given; otherwise copied out, or with copy=False
    views of the block (valid until the sender packs the next bucket there).
    """
    buffer = torch.frombuffer(_attach(shm_name).buf, dtype=torch.uint8)
    slots = [TensorSlot.from_json(s) for s in slots_json]
    if into is None:
        return unpack_bucket(buffer, slots, copy=copy)
    views = unpack_bucket(buffer, slots, copy=False)
    with torch.no_grad():
        for name, view in views.items():
            into[name].copy_(view)
    return {name: into[name] for name in views}


def release_shared_memory(shm_name: str | None = None) -> None:
    """Unmap blocks this process attached (all of them when no name is given)."""
    for name in [shm_name] if shm_name else list(_ATTACHED):
        shm = _ATTACHED.pop(name, None)
        if shm is not None:
            shm.close()


# ---- weights mapped into shared memory ---------------------------------------------------

_ALIGN = 64  # slot alignment: any dtype's view of a slot is aligned, and slots don't share cache lines


class SharedWeights:
    """Engine side: a module's tensors moved into one shared-memory block that a sender writes into.

    Every tensor's storage is rebound (`tensor.data = view`) to its slot in the
    block, so the engine keeps serving the same Parameter objects, and a sender
    process that maps the block updates the weights with one copy and no
    message per tensor. The first `_ALIGN` bytes are a header: byte 0 is set
    by the sender before it writes and cleared by the engine when the sync
    commits, so weights left half-written by a sender that died mid-copy are
    detected instead of served. Tensors that share storage share a slot.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]):
        _refuse_overlapping_views(tensors)
        slots, by_view, offset = {}, {}, _ALIGN
        for name, t in tensors.items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if key in by_view:
                slots[name] = by_view[key]
                continue
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which shared weights cannot carry; "
                                f"supported: {', '.join(_DTYPES)}")
            nbytes = t.numel() * t.element_size()
            slots[name] = by_view[key] = TensorSlot(name, dtype, tuple(t.shape), offset, nbytes)
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.shm = create_segment(offset)
        _CREATED.add(self.shm.name)
        self.slots = slots
        buffer = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        self.header = buffer[:_ALIGN]
        self.header.zero_()
        _rebind_into(buffer, slots, tensors)

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def incomplete(self) -> bool:
        """A sender began writing and the sync has not committed."""
        return bool(self.header[0])

    def commit(self) -> None:
        self.header[0] = 0

    def manifest(self) -> list[dict]:
        return [{**slot.to_json(), "name": name} for name, slot in self.slots.items()]

    def unlink(self) -> None:
        """Remove the block's name from /dev/shm (once; later calls do nothing). The memory stays
        mapped for this process and any that attached it, and is freed when the last one unmaps it."""
        if self.shm.name in _CREATED:
            _CREATED.discard(self.shm.name)
            self.shm.unlink()

    def close(self) -> None:
        """Unlink and unmap. Only once no tensor views the block any more (they were mapped into
        another block, or dropped): torch.frombuffer holds no buffer export, so nothing refuses the
        unmap, and a tensor still viewing the block would read freed memory. A process that keeps
        serving from the block until it exits calls `unlink()` instead."""
        self.unlink()
        self.shm.close()


def _rebind_into(buffer: torch.Tensor, slots: dict[str, TensorSlot], tensors: dict[str, torch.Tensor]) -> None:
    """Copy each tensor into its slot of `buffer` and rebind its storage there (`tensor.data = view`):
    the same tensor objects (Parameters stay Parameters), their bytes now in the buffer."""
    views = unpack_bucket(buffer, list(dict.fromkeys(slots.values())), copy=False)
    with torch.no_grad():
        for name, t in tensors.items():
            view = views[slots[name].name]
            if view.data_ptr() != t.data_ptr():  # a second name for an already rebound tensor
                view.copy_(t)
                t.data = view


def _refuse_overlapping_views(tensors: dict[str, torch.Tensor]) -> None:
    """Two names for one view share a slot; two different views of the same bytes cannot be mapped."""
    extents = {}  # distinct views: (storage, first byte, end byte) -> name
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        size = t.element_size()
        first = t.storage_offset() * size
        last = first + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * size
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        extents.setdefault(view, (t.untyped_storage().data_ptr(), first, last, name))
    previous = None
    for storage, first, last, name in sorted(extents.values()):
        if previous and previous[0] == storage and first < previous[2]:
            raise ValueError(f"tensors {previous[3]!r} and {name!r} are different views of the same bytes; "
                             "shared weights map whole tensors only (sync one of them)")
        if not previous or previous[0] != storage or last > previous[2]:
            previous = (storage, first, last, name)


class SharedWeightsWriter:
    """Sender side of `SharedWeights`: writes named tensors straight into the engine's block.

    Only call `write` while the engine is paused and drained (the controller's
    transfer phase): the engine reads these bytes as its weights.
    """

    def __init__(self, shm_name: str, manifest: list[dict]):
        self._shm = _attach(shm_name)
        buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
        self.shm_name = shm_name
        self.slots = {d["name"]: TensorSlot.from_json(d) for d in manifest}
        self.views = {name: buffer[s.offset:s.offset + s.nbytes].view(_DTYPES[s.dtype]).reshape(s.shape)
                      for name, s in self.slots.items()}
        self._end = max((s.offset + s.nbytes for s in self.slots.values()), default=_ALIGN)
        self._block_body = buffer[_ALIGN:self._end]
        # Set by share_layout: the sender's tensors in the block's layout, and where each must start.
        self._flat_body: torch.Tensor | None = None
        self._layout: tuple[tuple, tuple, int] = ((), (), 0)

    def covers(self, names) -> bool:
        return all(n in self.slots for n in names)

    def share_layout(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Move the sender's own tensors into one private buffer laid out like the engine's block.

        Each tensor's storage is rebound (`tensor.data = view`, pass the
        Parameters themselves), so the trainer keeps training the same
        objects; from then on `write` of those tensors is one memcpy of the
        whole block instead of one copy per tensor. Only for host tensors of
        the engine's dtypes covering every slot; returns whether it applied.
        """
        if set(tensors) != set(self.slots) or any(
                t.device.type != "cpu" or str(t.dtype).removeprefix("torch.") != self.slots[n].dtype
                for n, t in tensors.items()):
            return False
        flat = torch.empty(self._end, dtype=torch.uint8)
        _rebind_into(flat, self.slots, tensors)
        self._flat_body = flat[_ALIGN:]
        self._flat_body_np, self._block_body_np = self._flat_body.numpy(), self._block_body.numpy()
        # What a later write must pass, in this order, for the one-copy path (tuples compare in C). Names
        # and start addresses identify the placed tensors: rebinding one moves its address.
        self._layout = (tuple(tensors), tuple(t.data_ptr() for t in tensors.values()),
                        sum(self.slots[n].nbytes for n in tensors))
        return True

    def _laid_out_like_the_block(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether `tensors` are the tensors `share_layout` placed (the same names, order and addresses)."""
        names, places, _ = self._layout
        return tuple(tensors) == names and tuple(t.data_ptr() for t in tensors.values()) == places

    def write(self, tensors: dict[str, torch.Tensor]) -> int:
        """Check every name and shape first (nothing is written on a mismatch), then copy; returns bytes."""
        if self._flat_body is not None and self._laid_out_like_the_block(tensors):
            self._shm.buf[0] = 1  # the header's "incomplete" byte, cleared by the engine's commit
            # One memcpy of every slot, through numpy: a single-threaded copy. torch's copy_ splits a
            # large copy over its intra-op threads, and waking them costs milliseconds on a busy host.
            np.copyto(self._block_body_np, self._flat_body_np)
            return self._layout[2]
        unknown = [n for n in tensors if n not in self.slots]
        bad = [f"{n}: got {tuple(t.shape)}, expected {self.slots[n].shape}" for n, t in tensors.items()
               if n in self.slots and tuple(t.shape) != self.slots[n].shape]
        if unknown or bad:
            raise ValueError(f"cannot write these tensors into the engine's shared weights: "
                             f"{len(unknown)} unknown name(s) {unknown[:5]}, {len(bad)} wrong shape(s) {bad[:5]}")
        self._shm.buf[0] = 1
        moved = 0
        with torch.no_grad():
            for name, t in tensors.items():
                view = self.views[name]
                view.copy_(t.detach())  # casts when the trainer keeps another dtype
                moved += view.numel() * view.element_size()
        return moved

    def close(self) -> None:
        self.views, self._block_body, self._flat_body, self._shm = {}, None, None, None
        self._block_body_np = self._flat_body_np = None
        release_shared_memory(self.shm_name)


# ---- disk ----------------------------------------------------------------------------------


def save_weights_atomic(tensors: dict[str, torch.Tensor], path: str | os.PathLike, version: int) -> Path:
    """Write tensors as safetensors (with the version in the metadata) atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
              metadata={"weight_version": str(version)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


# ---- torch.distributed -----------------------------------------------------------------------


def broadcast_weights(tensors: dict[str, torch.Tensor], src: int, group=None,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Broadcast named tensors from global rank `src` in flat uint8 buckets.

    Every rank passes tensors of the same names, dtypes and shapes (check with
    `manifest_json` first); the receivers' tensors are overwritten in place.
    """
    import torch.distributed as dist

    sending = dist.get_rank() == src
    total = 0
    for slots in plan_buckets(tensors, bucket_bytes):
        buffer = torch.empty(sum(s.nbytes for s in slots), dtype=torch.uint8)
        if sending:
            pack_bucket(tensors, slots, buffer)
        dist.broadcast(buffer, src=src, group=group)
        if not sending:
            for name, t in unpack_bucket(buffer, slots, copy=False).items():
                tensors[name].copy_(t)
        total += buffer.numel()
    return total


def manifest_json(tensors: dict[str, torch.Tensor]) -> str:
    """Names, dtypes and shapes, to check that two sides agree before a broadcast."""
    return json.dumps([[n, str(t.dtype), list(t.shape)] for n, t in tensors.items()])
