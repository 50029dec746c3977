"""ServedRewardScorer: a reward model hosted as an AsyncEngine card, a drop-in for an in-process scorer."""

import threading

import pytest
import torch

import rewards
from engine import AsyncEngine, Engine, GenerationRequest
from rewards.served import ServedRewardScorer
from rewards.types import Scorer


@pytest.fixture
def served(toy_model):
    engine = AsyncEngine({"toy-digits": Engine(toy_model), "digit_alignment": rewards.get("digit_alignment")},
                         max_batch=64, max_wait_ms=50).start_background()
    yield engine
    engine.close_background()


@pytest.fixture(scope="module")
def batch(toy_model):
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven"]
    reqs = [GenerationRequest(prompt=f"a handwritten {w}", seed=i, steps=6, sampler="ode") for i, w in enumerate(words)]
    traj = Engine(toy_model).generate(reqs)
    return traj.images, traj.prompts, [{"digit": i} for i in range(8)]


def test_same_scores_as_the_in_process_scorer(served, batch):
    images, prompts, metadata = batch
    scorer = ServedRewardScorer(served, "digit_alignment")
    assert isinstance(scorer, Scorer) and scorer.name == "digit_alignment"
    expected = rewards.get("digit_alignment")(images, prompts, metadata)
    got = scorer(images, prompts, metadata)
    assert got.dtype == torch.float32 and got.shape == (8,)
    assert torch.equal(got, expected)


def test_concurrent_callers_are_batched_and_get_their_own_rows(served, batch):
    images, prompts, metadata = batch
    scorer = ServedRewardScorer(served, "digit_alignment")
    expected = rewards.get("digit_alignment")(images, prompts, metadata)
    results = {}
    barrier = threading.Barrier(4)

    def call(i):
        barrier.wait()
        rows = slice(2 * i, 2 * i + 2)
        results[i] = scorer(images[rows], prompts[rows], metadata[rows])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    torch.testing.assert_close(torch.cat([results[i] for i in range(4)]), expected, rtol=0, atol=1e-6)
    stats = served.stats()
    assert stats["pool/batches"] < 4  # at least two callers shared a batch


def test_replacing_the_card_takes_effect_without_restart(served, batch):
    images, prompts, metadata = batch
    scorer = ServedRewardScorer(served, "digit_alignment")
    before = scorer(images, prompts, metadata)
    served.replace_model("digit_alignment", rewards.get("jpeg_compressibility"))
    after = scorer(images, prompts, metadata)
    assert torch.equal(after, rewards.get("jpeg_compressibility")(images, prompts, metadata))
    assert not torch.equal(before, after)
    with pytest.raises(KeyError, match="known: digit_alignment"):
        ServedRewardScorer(served, "toy-digits")  # a generator card is not a scorer


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), None, True])
def test_a_timeout_that_bounds_nothing_is_refused(served, timeout_s):
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds in \(0, "):
        ServedRewardScorer(served, "digit_alignment", timeout_s=timeout_s)


def test_a_call_that_outlives_its_timeout_says_which_reward_and_bound(batch):
    import time

    started = threading.Event()

    def slow(images, prompts, metadata):
        started.set()
        time.sleep(1.0)
        return torch.zeros(len(prompts))

    engine = AsyncEngine({"slow": slow}, max_batch=64, max_wait_ms=1).start_background()
    try:
        scorer = ServedRewardScorer(engine, "slow", timeout_s=0.2)
        images, prompts, metadata = batch
        with pytest.raises(TimeoutError, match=r"served reward 'slow' \(card 'slow'\) did not score a batch of 8 "
                                               r"within timeout_s=0.2: no result within 0.2 s; the call was "
                                               r"cancelled"):
            scorer(images, prompts, metadata)
        assert started.is_set()
    finally:
        engine.close_background()
