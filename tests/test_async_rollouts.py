"""AsyncCollector: prefetching, the staleness bound, regeneration and the histogram."""

import threading
from types import SimpleNamespace

import pytest

from flywheel.sync.async_rollouts import AsyncCollector


class FakeFlywheel:
    """collect(step) returns a batch stamped with the engine's version at the time it ran."""

    def __init__(self):
        self.version = 0
        self.calls = []
        self.lock = threading.Lock()

    def collect(self, step):
        with self.lock:
            self.calls.append((step, self.version))
            return SimpleNamespace(trajectory=SimpleNamespace(weight_version=self.version), metrics={})


def test_prefetched_batches_lag_by_one_version_and_are_counted():
    fake = FakeFlywheel()
    collector = AsyncCollector(fake.collect, max_staleness=1)
    try:
        for step in range(4):
            batch = collector.get(step, trainer_version=fake.version)
            collector.prefetch(step + 1)  # generated with the weights before this step's update
            collector._pending[step + 1].result()
            fake.version += 1  # the trainer's update, synced into the engine
            assert batch.metrics["staleness"] == (0 if step == 0 else 1)
        assert collector.metrics() == {"staleness/count_0": 1.0, "staleness/count_1": 3.0,
                                       "staleness/regenerated": 0.0}
    finally:
        collector.close()


def test_too_stale_batches_are_generated_again():
    fake = FakeFlywheel()
    collector = AsyncCollector(fake.collect, max_staleness=0)
    try:
        collector.prefetch(0)
        collector._pending[0].result()
        fake.version = 2  # two updates landed while the batch waited
        batch = collector.get(0, trainer_version=2)
        assert batch.trajectory.weight_version == 2 and batch.metrics["staleness"] == 0
        assert collector.regenerated == 1 and fake.calls == [(0, 0), (0, 2)]
    finally:
        collector.close()


def test_negative_staleness_bound_is_an_error():
    with pytest.raises(ValueError, match="rollout.max_staleness"):
        AsyncCollector(lambda s: None, max_staleness=-1)


def test_the_trainer_gives_the_engine_a_core_only_while_a_rollout_runs():
    import torch

    from flywheel.recipe.rollouts import cpu_core_sharing

    release = threading.Event()
    fake = FakeFlywheel()

    def slow_collect(step):
        release.wait(timeout=30)
        return fake.collect(step)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    collector = AsyncCollector(slow_collect, max_staleness=1)
    try:
        share = cpu_core_sharing(collector, SimpleNamespace(device=torch.device("cpu")))
        collector.prefetch(0)
        assert collector.rollout_running()
        share()
        assert torch.get_num_threads() == 1  # the engine process has the other core
        release.set()
        collector.get(0, trainer_version=0)
        assert not collector.rollout_running()
        share()
        assert torch.get_num_threads() == 2  # and gives it back when the rollout is done
    finally:
        release.set()
        collector.close()
        torch.set_num_threads(threads)


def test_the_staleness_counts_survive_a_checkpoint_round_trip():
    import json

    fake = FakeFlywheel()
    collector = AsyncCollector(fake.collect, max_staleness=0)
    resumed = AsyncCollector(fake.collect, max_staleness=0)
    try:
        collector.get(0, trainer_version=0)
        collector.prefetch(1)
        collector._pending[1].result()
        fake.version = 1
        collector.get(1, trainer_version=1)  # one version behind: regenerated
        resumed.load_state_dict(json.loads(json.dumps(collector.state_dict())))  # as a trainer_state.json holds it
        assert resumed.metrics() == collector.metrics() == {"staleness/count_0": 2.0, "staleness/regenerated": 1.0}
        with pytest.raises(ValueError, match="negative"):
            resumed.load_state_dict({"staleness_counts": {"-1": 1}, "regenerated": 0})
    finally:
        collector.close()
        resumed.close()
