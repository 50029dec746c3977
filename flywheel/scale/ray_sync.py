"""Weight sync to every replica of a `RayEnginePool`, through the `WeightSyncController` contract.

On the CPU (and across machines without a GPU interconnect), `RayObjectStoreTransport`:
the controller pauses and drains the pool, the tensors (the full transformer, or the
LoRA tensors only when the trainer passes only those) are put in Ray's object store
once, every replica reads that one object and copies it into its engine, the
checksums of every replica are compared when `verify=True`, and the version is
committed on all replicas together before the pool resumes. A replica holding a
write that was not committed refuses to generate.

On GPUs (the design, not yet code: see the report of issue 16), a collective transport: the trainer (rank 0 of a group of its own) and
the replicas (ranks 1..N) form a torch.distributed group, NCCL on GPUs (gloo on
CPUs, to exercise it without a GPU), created from a `TCPStore`
on the trainer's host, apart from accelerate's default group (so the trainer's
DDP/FSDP group is untouched and the replicas never join it). A sync is then:
pause + drain the pool (as above), each replica posts a receive of the same
flat uint8 buckets (`plan_buckets`, the same layout on both sides), the trainer
broadcasts them from its GPU, the replicas unpack into their engine's weights
(device to device, nothing passes through host memory or the object store), and
the commit bumps every replica's version. Checksums (`verify=True`) are
compared exactly as on the CPU path. A replica that Ray restarts cannot rejoin
the group mid-run, so its re-sync goes through the object store as here (the
pool keeps the last committed weights there for that). Multi-node: the store's host must be
reachable from the replicas' nodes (the trainer's address), and NCCL uses the
GPU interconnect (set NCCL_SOCKET_IFNAME where a machine has several networks).
"""

from __future__ import annotations


class RayObjectStoreTransport:
    """The weights put once in Ray's object store, read by every replica; the version committed on all."""

    name = "ray"

    def transfer(self, pool, tensors, version: int, component: str) -> int:
        return pool.write_weights(tensors, component)

    def commit(self, pool, version: int, component: str) -> None:
        pool.commit_weights(version, component)
