"""Weight sync to every replica of a `RayEnginePool`, through the `WeightSyncController` contract.

CPU, or machines without a GPU interconnect: `RayObjectStoreTransport`. The
controller pauses and drains the pool; the tensors (the whole transformer, or
only the LoRA tensors when the trainer passes only those) are put in Ray's
object store once; every replica reads that one object and copies it into its
engine; with `verify=True` the checksums of every replica are compared with the
trainer's; the version is committed on all replicas before the pool resumes. A
replica holding a write that no commit ended refuses to generate.

GPUs: `CollectiveTransport`. The trainer (rank 0) and the replicas (ranks
1..N) form a torch.distributed process group of their own, NCCL between GPUs
(gloo between CPUs, which is how the CPU tests run the same code), built from a
`TCPStore` on the trainer's host and not from torch.distributed's default group,
so accelerate's DDP/FSDP group is untouched and the replicas never join it. A
sync: pause and drain the pool as above; every replica posts the receives of the
same flat uint8 buckets (`plan_buckets` of the same manifest on both sides); the
trainer packs and broadcasts each bucket from its device; each replica copies
it into its engine (on the GPU, nothing crosses the host or the object store);
`verify=True` compares checksums as above; the commit bumps every replica's
version. A replica that Ray restarts cannot rejoin a running group, so each
sync also puts one host copy of the tensors in the object store, which is what
a restarted replica is re-synced from, and the next sync forms the group anew
(trainer and every replica) before it broadcasts. Across machines the store's host (the
trainer's address) must be reachable from the replicas' nodes, and NCCL picks
the network (set NCCL_SOCKET_IFNAME where a machine has several).
"""

from __future__ import annotations

import datetime

import ray
import torch

from flywheel.sync.transport import DEFAULT_BUCKET_BYTES, pack_bucket, plan_buckets

GROUP_BACKENDS = ("nccl", "gloo")


class RayObjectStoreTransport:
    """The weights put once in Ray's object store, read by every replica; the version committed on all."""

    name = "ray"

    def transfer(self, pool, tensors, version: int, component: str) -> int:
        return pool.write_weights(tensors, component)

    def commit(self, pool, version: int, component: str) -> None:
        pool.commit_weights(version, component)


def weight_group(backend: str, host: str, port: int, rank: int, size: int, timeout_s: float):
    """A process group of `size` ranks over a TCPStore at host:port (rank 0 hosts the store), apart from
    torch.distributed's default group."""
    import torch.distributed as dist

    if backend not in GROUP_BACKENDS:
        raise ValueError(f"weight broadcast backend {backend!r} is not supported; valid: {', '.join(GROUP_BACKENDS)}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def broadcast_bucket(group, buffer: torch.Tensor) -> None:
    """Broadcast `buffer` from rank 0 of `group` (in place on the other ranks)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([buffer], options).wait()


class CollectiveTransport:
    """Trainer -> replicas by a torch.distributed broadcast in flat buckets (NCCL on GPUs, gloo on CPUs).

    `connect(pool)` forms the group once (the replicas join as ranks 1..N); then pass it to the controller.
    """

    name = "collective"

    def __init__(self, backend: str = "nccl", host: str = "127.0.0.1", port: int = 29555,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: str = "cpu", timeout_s: float = 300.0):
        """`host`: the trainer's address as the replicas reach it; `device`: where the trainer's buckets are
        packed (its GPU with NCCL)."""
        if backend not in GROUP_BACKENDS:
            raise ValueError(f"backend {backend!r} is not supported; valid: {', '.join(GROUP_BACKENDS)}")
        self.backend, self.host, self.port = backend, host, port
        self.bucket_bytes, self.device, self.timeout_s = bucket_bytes, torch.device(device), timeout_s
        self.group = None

    def connect(self, pool) -> None:
        joining = pool.join_group(self.backend, self.host, self.port, self.timeout_s)
        self.group = weight_group(self.backend, self.host, self.port, 0, 1 + len(joining), self.timeout_s)
        ray.get(joining, timeout=self.timeout_s)

    def transfer(self, pool, tensors: dict[str, torch.Tensor], version: int, component: str) -> int:
        if self.group is None:
            raise RuntimeError("CollectiveTransport.connect(pool) must run before the first sync")
        if not pool.all_in_group():
            # A replica Ray restarted cannot rejoin the running group: everyone forms a new one.
            self.group = None
            self.connect(pool)
        host = {n: t.detach().to("cpu") for n, t in tensors.items()}
        manifest = [(n, str(t.dtype), list(t.shape)) for n, t in host.items()]
        received = pool.receive_broadcast(manifest, component, self.bucket_bytes, ray.put(host))
        total = 0
        for slots in plan_buckets(host, self.bucket_bytes):
            buffer = torch.empty(sum(s.nbytes for s in slots), dtype=torch.uint8, device=self.device)
            pack_bucket(host, slots, buffer)  # packs through host memory (pack_bucket's byte views are on the host)
            broadcast_bucket(self.group, buffer)
            total += buffer.numel()
        received()
        return total

    def commit(self, pool, version: int, component: str) -> None:
        pool.commit_weights(version, component)
