"""Weight transports: bucketing, shared memory across processes, disk, broadcast, checksums."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flywheel.sync.transport import (SharedMemorySender, SharedWeights, SharedWeightsWriter, TensorSlot, pack_bucket,
                                plan_buckets,
                                save_weights_atomic, tensor_checksums, unpack_bucket,
                                verify_checksums)

ROOT = Path(__file__).resolve().parents[1]


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 32, generator=g),
        "a.bias": torch.randn(64, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(300, 300, generator=g).half(),
        "steps": torch.tensor([3, 4, 5]),
        "flag": torch.tensor([True, False]),
        "empty": torch.empty(0, 4),
    }


def test_buckets_respect_the_size_and_keep_every_tensor():
    tensors = sample_tensors()
    buckets = plan_buckets(tensors, bucket_bytes=16 * 1024)
    assert [s.name for b in buckets for s in b] == list(tensors)
    for b in buckets:
        size = sum(s.nbytes for s in b)
        assert size <= 16 * 1024 or len(b) == 1  # an oversized tensor travels alone
    assert any(len(b) == 1 and b[0].name == "b.weight" for b in buckets)


def test_pack_unpack_round_trip_is_bitwise():
    tensors = sample_tensors()
    for slots in plan_buckets(tensors, bucket_bytes=1 << 20):
        buffer = torch.empty(sum(s.nbytes for s in slots), dtype=torch.uint8)
        pack_bucket(tensors, slots, buffer)
        for name, t in unpack_bucket(buffer, slots).items():
            assert t.dtype == tensors[name].dtype and torch.equal(t, tensors[name])
    assert TensorSlot.from_json(slots[0].to_json()) == slots[0]


def test_checksums_catch_a_single_changed_element():
    tensors = sample_tensors()
    sent = tensor_checksums(tensors)
    verify_checksums(sent, tensor_checksums({k: v.clone() for k, v in tensors.items()}))
    changed = {k: v.clone() for k, v in tensors.items()}
    changed["a.weight"][3, 4] += 1e-6
    with pytest.raises(RuntimeError, match="1 tensor\\(s\\) differ \\['a.weight'\\]"):
        verify_checksums(sent, tensor_checksums(changed))
    with pytest.raises(RuntimeError, match="missing"):
        verify_checksums(sent, {k: v for k, v in tensor_checksums(tensors).items() if k != "flag"})


RECEIVER = r"""
import json, sys
from flywheel.sync.transport import receive_shared_memory_bucket, tensor_checksums
got = {}
for line in sys.stdin:
    msg = json.loads(line)
    got.update(receive_shared_memory_bucket(msg["shm"], msg["slots"]))
    print("ack", flush=True)
print(json.dumps(tensor_checksums(got)), flush=True)
"""


@pytest.mark.parametrize("pipelined", [False, True])
def test_shared_memory_moves_buckets_to_another_process(pipelined):
    tensors = sample_tensors()
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    sender = SharedMemorySender(bucket_bytes=32 * 1024)

    def wait():
        assert proc.stdout.readline().strip() == "ack"  # the receiver copied the bucket out

    def deliver(shm_name, slots):
        proc.stdin.write(json.dumps({"shm": shm_name, "slots": slots}) + "\n")
        proc.stdin.flush()
        if pipelined:
            return wait  # the sender packs the next bucket into the other block meanwhile
        wait()

    try:
        sent = sender.send(tensors, deliver)
        proc.stdin.close()
        received = json.loads(proc.stdout.readline())
    finally:
        sender.close()
        proc.wait(timeout=30)
    assert sent == sum(t.numel() * t.element_size() for t in tensors.values())
    verify_checksums(tensor_checksums(tensors), received)


def test_disk_transport_is_atomic_safetensors_with_the_version(tmp_path):
    tensors = sample_tensors()
    path = save_weights_atomic(tensors, tmp_path / "w.safetensors", version=7)
    assert not list(tmp_path.glob(".*.tmp"))
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["weight_version"] == "7"


BROADCAST = r"""
import json, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
from flywheel.sync.transport import broadcast_weights, tensor_checksums
rank = dist.get_rank()
g = torch.Generator().manual_seed(1)
shapes = {"w1": (128, 64), "w2": (1000,), "w3": (7, 7)}
if rank == 0:
    tensors = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
else:
    tensors = {k: torch.zeros(s) for k, s in shapes.items()}  # the receiver starts from junk
sent = broadcast_weights(tensors, src=0, bucket_bytes=8 * 1024)
with open(f"rank{rank}.json", "w") as f:
    json.dump({"bytes": sent, "sums": tensor_checksums(tensors)}, f)
dist.destroy_process_group()
"""


def test_broadcast_in_buckets_reaches_the_other_rank(tmp_path):
    script = tmp_path / "bcast.py"
    script.write_text(BROADCAST)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29541",
                    str(script)], env=env, cwd=tmp_path, timeout=120, capture_output=True, check=True)
    sender, receiver = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert sender["bytes"] == receiver["bytes"] == (128 * 64 + 1000 + 49) * 4
    verify_checksums(sender["sums"], receiver["sums"])


def test_shared_weights_let_a_writer_update_a_module_in_place():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    module[2].weight = module[0].weight  # tied: one tensor under two names
    state = module.state_dict(keep_vars=True)
    weight_object, before = module[0].weight, {k: v.detach().clone() for k, v in state.items()}
    block = SharedWeights(state)
    writer = SharedWeightsWriter(block.name, block.manifest())
    try:
        assert module[0].weight is weight_object and module[2].weight is weight_object  # same Parameter
        assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
        assert block.slots["0.weight"] is block.slots["2.weight"]  # the tie survives: one slot
        assert block.slots["0.weight"].offset != block.slots["0.bias"].offset
        new = {k: torch.randn(v.shape).to(v.dtype) for k, v in before.items() if k != "2.weight"}
        with pytest.raises(ValueError, match="1 wrong shape"):
            writer.write({"0.weight": torch.zeros(5, 5)})
        assert not block.incomplete  # a rejected write touches nothing
        moved = writer.write(new)
        assert block.incomplete and moved == sum(t.numel() * t.element_size() for t in new.values())
        for k, v in new.items():  # the module sees every write, buffers included
            assert torch.equal(module.state_dict()[k], v)
        assert torch.equal(module[2].weight, new["0.weight"])
        block.commit()
        assert not block.incomplete
        assert writer.write({"0.bias": new["0.bias"].double()}) == 4 * 4  # cast to the engine's dtype
    finally:
        writer.close()
        block.close()


def test_shared_weights_refuse_two_different_views_of_one_storage():
    weight = torch.randn(4, 3)
    with pytest.raises(ValueError, match="different views of the same bytes"):
        SharedWeights({"a": weight, "b": weight.t()})


def test_shared_weights_map_tensors_that_share_a_storage_without_overlapping():
    flat = torch.arange(10.0)
    block = SharedWeights({"a": flat[:4].view(2, 2), "b": flat[4:]})  # one storage, disjoint bytes
    try:
        assert block.slots["a"].offset != block.slots["b"].offset
        flat.zero_()  # the mapped tensors no longer view `flat`
        assert block.slots["a"].nbytes == 16 and block.slots["b"].nbytes == 24
    finally:
        block.close()


def test_a_sender_laid_out_like_the_block_writes_it_in_one_copy_with_the_same_result():
    torch.manual_seed(0)
    engine_side = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    trainer = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    block = SharedWeights(engine_side.state_dict(keep_vars=True))
    writer = SharedWeightsWriter(block.name, block.manifest())
    try:
        params = dict(trainer.named_parameters())
        weight_object, before = params["0.weight"], {k: v.detach().clone() for k, v in params.items()}
        assert writer.share_layout(params)
        assert trainer[0].weight is weight_object  # the same Parameters, now in one flat buffer
        assert all(torch.equal(params[k], v) for k, v in before.items())
        optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
        trainer(torch.randn(4, 5)).sum().backward()
        optimizer.step()  # updates the flat buffer in place
        sent = {k: v.detach() for k, v in trainer.named_parameters()}
        assert writer._laid_out_like_the_block(sent)  # the one-copy path
        assert writer.write(sent) == sum(t.numel() * 4 for t in sent.values())
        for k, v in sent.items():
            assert torch.equal(engine_side.state_dict()[k], v)
        assert not writer._laid_out_like_the_block({k: v.clone() for k, v in sent.items()})  # copies: per tensor
        assert not writer.share_layout({"0.weight": params["0.weight"]})  # must cover every slot
    finally:
        writer.close()
        block.close()


def shm_path(name: str) -> Path:
    return Path("/dev/shm") / name


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory shows in /dev/shm on Linux")
def test_segments_are_named_after_their_creator_and_unlinked_by_whoever_made_them():
    block = SharedWeights({"w": torch.randn(8)})
    assert block.name.startswith(f"flywheel_{os.getpid()}_") and shm_path(block.name).exists()
    block.unlink()
    block.unlink()  # once is enough; a second call (a watchdog, then close) is no error
    assert not shm_path(block.name).exists()
    block.close()

    sender = SharedMemorySender(bucket_bytes=1024)
    sender.send(sample_tensors(), lambda shm, slots: None)
    names = [b.name for b in sender._blocks]
    assert len(names) == 2 and all(n.startswith(f"flywheel_{os.getpid()}_") and shm_path(n).exists() for n in names)
    del sender  # dropped without close(): its blocks go with it, not at some later tracker cleanup
    gc.collect()
    assert not any(shm_path(n).exists() for n in names)
