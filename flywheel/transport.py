"""Moving named tensors from a trainer to an engine: buckets, shared memory, disk, broadcast.

All transports move raw tensor bytes plus a JSON manifest (name, dtype, shape,
offset); nothing is pickled. Large models go in fixed-size buckets so that the
staging memory stays bounded whatever the model size.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Callable

import torch

DEFAULT_BUCKET_BYTES = 64 * 2**20

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


class SharedMemorySender:
    """Stages buckets in one named shared-memory block that a receiver process maps.

    `send(tensors, deliver)` fills the block one bucket at a time and calls
    `deliver(shm_name, slots_json)` for each; `deliver` must return only after
    the receiver has copied the bucket out (it is the rendezvous).
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.bucket_bytes = bucket_bytes
        self._shm: shared_memory.SharedMemory | None = None

    def _block(self, size: int) -> shared_memory.SharedMemory:
        if self._shm is None or self._shm.size < size:
            self.close()
            self._shm = shared_memory.SharedMemory(create=True, size=max(size, 1))
        return self._shm

    def send(self, tensors: dict[str, torch.Tensor], deliver: Callable[[str, list[dict]], None]) -> int:
        buckets = plan_buckets(tensors, self.bucket_bytes)
        largest = max((sum(s.nbytes for s in b) for b in buckets), default=1)
        shm = self._block(largest)
        buffer = torch.frombuffer(shm.buf, dtype=torch.uint8)
        total = 0
        for slots in buckets:
            pack_bucket(tensors, slots, buffer)
            deliver(shm.name, [s.to_json() for s in slots])
            total += sum(s.nbytes for s in slots)
        del buffer
        return total

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None


def receive_shared_memory_bucket(shm_name: str, slots_json: list[dict]) -> dict[str, torch.Tensor]:
    """Receiver side: copy one bucket's tensors out of the sender's shared-memory block."""
    shm = shared_memory.SharedMemory(name=shm_name)
    # Python < 3.13 registers an attached block with this process's resource
    # tracker, which would unlink the sender's block when this process exits.
    resource_tracker.unregister(shm._name, "shared_memory")
    try:
        buffer = torch.frombuffer(shm.buf, dtype=torch.uint8)
        tensors = unpack_bucket(buffer, [TensorSlot.from_json(s) for s in slots_json], copy=True)
        del buffer
        return tensors
    finally:
        shm.close()


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
