"""Tests of the rewards package: spec parsing, masking and totals, the shipped digit scorer, JPEG, the judge."""

from __future__ import annotations

import importlib
import logging
import math
import sys

import pytest
import torch
import torch.nn.functional as F

import rewards
from rewards import RewardBatch, RewardSet, parse_spec
from rewards.digits import DigitAlignment, digit_split, load_classifier
from rewards.judges import DigitJudge
from rewards.registry import register, unregister

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


# ---- spec parsing and the registry ----

def test_parse_spec_weights_defaults_and_whitespace():
    assert parse_spec("digit_alignment:1.0,jpeg_compressibility:0.1") == [
        ("digit_alignment", 1.0), ("jpeg_compressibility", 0.1)]
    assert parse_spec("digit_alignment") == [("digit_alignment", 1.0)]
    assert parse_spec("  a : 2 ,\tb ,c:-0.5 ") == [("a", 2.0), ("b", 1.0), ("c", -0.5)]


def test_parse_spec_yaml_forms():
    assert parse_spec({"a": 1.0, "b": 0.1, "c": None}) == [("a", 1.0), ("b", 0.1), ("c", 1.0)]
    assert parse_spec([["a", 2], ("b", 0.5), "c:3", "d"]) == [("a", 2.0), ("b", 0.5), ("c", 3.0), ("d", 1.0)]


@pytest.mark.parametrize("spec, fragment", [
    ("", "empty"),
    ("   ", "empty"),
    ({}, "empty"),
    ([], "empty"),
    ("a:x", "'x'"),
    ("a:1,b:oops", "b:oops"),
    ("a:", "'a:'"),
    ("a,,b", "position 1"),
    ("a:1:2", "a:1:2"),
    (":1", ":1"),
    ("a:nan", "finite"),
    ("a,b,a", "more than once: a"),
    ({"a": "heavy"}, "heavy"),
    ([("a", 1, 2)], "('a', 1, 2)"),
    (3.0, "float"),
])
def test_parse_spec_errors_name_the_offending_part(spec, fragment):
    with pytest.raises(ValueError, match=None) as err:
        parse_spec(spec)
    assert fragment in str(err.value)


def test_unknown_scorer_lists_known_names():
    with pytest.raises(KeyError) as err:
        rewards.get("no_such_reward")
    message = str(err.value)
    assert "no_such_reward" in message
    for name in ("digit_alignment", "jpeg_compressibility", "jpeg_incompressibility"):
        assert name in message and name in rewards.available()
    assert "digit_judge" not in rewards.available()  # the judge must never be trainable against


def test_import_loads_no_scorer_weights(monkeypatch):
    # Re-import `rewards` with the scorer modules made unimportable: an eager import would raise.
    for name in [m for m in sys.modules if m == "rewards" or m.startswith("rewards.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("rewards.digits", "rewards.jpeg", "rewards.judges"):
        monkeypatch.setitem(sys.modules, name, None)
    fresh = importlib.import_module("rewards")
    assert "digit_alignment" in fresh.available()
    with pytest.raises(ImportError):
        fresh.get("digit_alignment")  # construction is where the import (and the weights) happen


def test_register_as_decorator_and_clash():
    @register("test_decorated")
    def make():
        return FakeScorer("test_decorated", lambda b: torch.zeros(b))

    try:
        assert rewards.get("test_decorated").name == "test_decorated"
        register("test_decorated", make)  # same factory again: harmless
        with pytest.raises(ValueError, match="already registered"):
            register("test_decorated", lambda: None)
        with pytest.raises(ValueError, match="not valid"):
            register("bad:name", make)
    finally:
        unregister("test_decorated")


# ---- combination: masking, counting, totals ----

class FakeScorer:
    """A scorer whose scores come from `fn(batch_size)`."""

    def __init__(self, name, fn):
        self.name, self.fn, self.calls = name, fn, 0

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        return self.fn(images.shape[0])


def _raise(_batch):
    raise RuntimeError("reward server unreachable")


@pytest.fixture
def fakes():
    made = {}
    specs = {
        "test_ramp": lambda b: torch.arange(b, dtype=torch.float32) + 1.0,
        "test_holes": lambda b: torch.tensor([0.5, math.nan, math.inf, 0.75])[:b],
        "test_raises": _raise,
    }
    for name, fn in specs.items():
        register(name, lambda name=name, fn=fn: made.setdefault(name, FakeScorer(name, fn)))
    yield made
    for name in specs:
        unregister(name)


def _images(batch=4):
    return torch.rand(batch, 1, 8, 8)


def test_nan_and_inf_rows_are_masked_and_total_is_exact(fakes):
    batch = RewardSet("test_ramp:0.5, test_holes:2").score(_images(), ["p"] * 4, None, weight_version=7)
    assert isinstance(batch, RewardBatch) and len(batch) == 4 and batch.weight_version == 7
    assert batch.valid.tolist() == [True, False, False, True]
    assert batch.valid_per_scorer["test_ramp"].all()
    assert batch.valid_per_scorer["test_holes"].tolist() == [True, False, False, True]
    assert torch.isnan(batch.scores["test_holes"][1:3]).all()  # inf becomes NaN too
    assert batch.total[0].item() == 0.5 * 1.0 + 2 * 0.5
    assert batch.total[3].item() == 0.5 * 4.0 + 2 * 0.75
    assert torch.isnan(batch.total[1:3]).all()
    assert batch.errors == {}
    assert all(t.dtype == torch.float32 for t in [batch.total, *batch.scores.values()])

    m = batch.metrics()
    assert m["reward/invalid"] == 2 and m["reward/test_holes/invalid"] == 2 and m["reward/test_ramp/invalid"] == 0
    assert m["reward/mean"] == pytest.approx((1.5 + 3.5) / 2)
    assert m["reward/std"] == pytest.approx(1.0)  # population std over the valid rows
    assert m["reward/test_ramp/mean"] == pytest.approx(2.5)
    assert m["reward/test_holes/mean"] == pytest.approx(0.625)
    assert m["reward/test_holes/std"] == pytest.approx(0.125)
    expected = {"reward/mean", "reward/std", "reward/invalid"} | {
        f"reward/{n}/{k}" for n in ("test_ramp", "test_holes") for k in ("mean", "std", "invalid")}
    assert set(m) == expected
    assert set(batch.metrics(prefix="eval")) == {k.replace("reward/", "eval/", 1) for k in expected}


def test_finite_scores_whose_weighted_total_overflows_are_masked(fakes, caplog):
    register("test_huge", lambda: FakeScorer("test_huge", lambda b: torch.tensor([3e38, 1.0, -3e38, 2.0])[:b]))
    try:
        with caplog.at_level(logging.WARNING, logger="rewards.combine"):
            batch = RewardSet("test_huge:2, test_ramp:1").score(_images(), ["p"] * 4, None, weight_version=0)
    finally:
        unregister("test_huge")
    assert batch.valid_per_scorer["test_huge"].all()  # each score is finite; 2 x 3e38 is not
    assert batch.valid.tolist() == [False, True, False, True]
    assert torch.isnan(batch.total[[0, 2]]).all() and batch.total[[1, 3]].tolist() == [4.0, 8.0]
    assert batch.metrics()["reward/invalid"] == 2 and batch.metrics()["reward/mean"] == 6.0
    assert "reward total of row(s) [0, 2] is not finite" in caplog.text


def test_reward_metrics_of_finite_scores_near_float32s_limit_are_finite(fakes):
    """The mean of [3e38, 3e38] is 3e38, but its float32 sum is inf: an inf eval/reward/mean stopped the run and
    blamed masked samples, though none was masked."""
    register("test_near_limit", lambda: FakeScorer("test_near_limit", lambda b: torch.full((b,), 3e38)))
    try:
        batch = RewardSet("test_near_limit:1").score(_images(), ["p"] * 4, None, weight_version=0)
    finally:
        unregister("test_near_limit")
    m = batch.metrics()
    assert batch.valid.all() and m["reward/invalid"] == 0
    assert m["reward/mean"] == pytest.approx(3e38, rel=1e-6) and m["reward/std"] == 0.0


def test_raising_scorer_masks_its_rows_and_keeps_the_error(fakes, caplog):
    rs = RewardSet({"test_ramp": 1.0, "test_raises": 0.1})
    with caplog.at_level(logging.WARNING, logger="rewards.combine"):
        batch = rs.score(_images(), ["p"] * 4, [{}] * 4, weight_version=3)
    assert "reward server unreachable" in batch.errors["test_raises"]
    assert "RuntimeError" in batch.errors["test_raises"]
    assert "test_raises" in caplog.text
    assert not batch.valid.any() and torch.isnan(batch.total).all()
    assert batch.valid_per_scorer["test_ramp"].all()
    m = batch.metrics()
    assert m["reward/invalid"] == 4 and m["reward/test_raises/invalid"] == 4
    assert math.isnan(m["reward/mean"]) and m["reward/test_ramp/mean"] == pytest.approx(2.5)


def test_scorers_are_built_once_and_reused(fakes):
    rs = RewardSet("test_ramp")
    scorer = rs.scorers["test_ramp"]
    for _ in range(3):
        rs.score(_images(), ["p"] * 4, None, weight_version=0)
    assert rs.scorers["test_ramp"] is scorer and scorer.calls == 3


def test_mismatched_lengths_are_an_error(fakes):
    with pytest.raises(ValueError, match="same length"):
        RewardSet("test_ramp").score(_images(4), ["p"] * 3, None, weight_version=0)


# ---- digit_alignment and the shipped classifier ----

@pytest.fixture(scope="module")
def heldout():
    _, x_test, _, y_test = digit_split()
    return torch.tensor(x_test, dtype=torch.float32)[:, None] / 16.0, torch.tensor(y_test)


@pytest.fixture(scope="module")
def scorer():
    return DigitAlignment()


def test_split_matches_the_toy_model():
    data = pytest.importorskip("engine.toy.data", reason="engine.toy.data not written yet")
    ours, theirs = digit_split(), data.digit_split()
    for a, b in zip(ours, theirs):
        assert (a.reshape(len(a), -1) == b.reshape(len(b), -1)).all()


def test_shipped_classifier_heldout_accuracy(heldout):
    x, y = heldout
    model, meta = load_classifier()
    with torch.no_grad():
        acc = (model(x).argmax(-1) == y).float().mean().item()
    assert acc >= 0.95
    assert float(meta["heldout_accuracy"]) == pytest.approx(acc, abs=1e-6)
    assert {"seed", "epochs", "config"} <= set(meta)


def test_digit_alignment_rewards_the_prompted_digit(heldout, scorer):
    x, y = heldout
    right = scorer(x, [""] * len(y), [{"digit": int(d)} for d in y])
    wrong = scorer(x, [""] * len(y), [{"digit": int(d + 1) % 10} for d in y])
    assert right.dtype == torch.float32 and right.shape == (len(y),)
    assert right.mean().item() > 0.9
    assert wrong.mean().item() < 0.2


def test_digit_alignment_accepts_any_size_and_channels(heldout, scorer):
    x, y = heldout
    meta = [{"digit": int(d)} for d in y]
    big = F.interpolate(x, scale_factor=4, mode="nearest").expand(-1, 3, -1, -1)
    assert big.shape[1:] == (3, 32, 32)
    torch.testing.assert_close(scorer(big, [""] * len(y), meta), scorer(x, [""] * len(y), meta), atol=1e-5, rtol=0)


def test_digit_alignment_rejects_bad_metadata_digit(scorer):
    with pytest.raises(ValueError, match="out of range"):
        scorer(_images(1), [""], [{"digit": 12}])


def test_digit_alignment_parses_the_prompt(heldout, scorer):
    pytest.importorskip("engine.toy.prompts", reason="engine.toy.prompts.parse_digit not written yet")
    x, y = heldout
    x, y = x[:20], y[:20]
    prompts = [f"a handwritten {d}" if i % 2 else f"the digit {WORDS[d]}" for i, d in enumerate(y.tolist())]
    parsed = scorer(x, prompts, [{}] * len(y))
    torch.testing.assert_close(parsed, scorer(x, [""] * len(y), [{"digit": int(d)} for d in y]))
    # A prompt that names no digit cannot be scored: NaN, which RewardSet masks and counts.
    assert torch.isnan(scorer(x[:1], ["a picture of a cat"], [{}])).all()
    batch = RewardSet("digit_alignment").score(x[:2], ["a 3", "a cat"], None, weight_version=1)
    assert batch.valid.tolist() == [True, False] and batch.metrics()["reward/invalid"] == 1


def test_reward_set_with_builtin_scorers(heldout):
    x, y = heldout
    rs = rewards.build("digit_alignment:1.0,jpeg_compressibility:0.1",
                       scorer_kwargs={"digit_alignment": {"device": "cpu"}})
    with pytest.raises(ValueError, match="not in the spec: clip"):
        rewards.build("digit_alignment", scorer_kwargs={"clip": {}})
    batch = rs.score(x[:8], [""] * 8, [{"digit": int(d)} for d in y[:8]], weight_version=2)
    assert batch.valid.all() and batch.scorer_ids == ["digit_alignment", "jpeg_compressibility"]
    torch.testing.assert_close(
        batch.total, batch.scores["digit_alignment"] + 0.1 * batch.scores["jpeg_compressibility"])


# ---- JPEG ----

def test_jpeg_flat_is_more_compressible_than_noise():
    gen = torch.Generator().manual_seed(0)
    for channels in (1, 3):
        images = torch.stack([torch.full((channels, 64, 64), 0.5), torch.rand(channels, 64, 64, generator=gen)])
        comp = rewards.get("jpeg_compressibility")(images, ["", ""], [{}, {}])
        incomp = rewards.get("jpeg_incompressibility")(images, ["", ""], [{}, {}])
        assert comp.dtype == torch.float32 and comp[0] > comp[1]
        assert torch.equal(comp, -incomp)
        assert incomp[1] > 1.0  # 64x64 noise at quality 95 is several kB


def test_jpeg_rejects_unsupported_channels():
    with pytest.raises(ValueError, match="C in"):
        rewards.get("jpeg_compressibility")(torch.rand(1, 2, 8, 8), [""], [{}])


# ---- the independent judge ----

def test_judge_agrees_with_classifier_on_real_digits(heldout, scorer):
    x, y = heldout
    judge = DigitJudge()
    judge_pred = judge.probs(x).argmax(-1)
    assert (judge_pred == y).float().mean().item() > 0.9
    assert (judge_pred == scorer.probs(x).argmax(-1)).float().mean().item() > 0.9
    scores = judge(x, [""] * len(y), [{"digit": int(d)} for d in y])
    assert scores.shape == (len(y),) and scores.dtype == torch.float32 and scores.mean().item() > 0.8


def test_the_digit_scorers_stay_in_their_declared_output_range():
    """What the DPO pair-margin check bounds by (rewards.registry.total_reward_span): saturated, blank and noise
    images, every digit, score inside (low, high)."""
    from rewards.digits import NumberAlignment
    from rewards.registry import output_range, total_reward_span

    g = torch.Generator().manual_seed(0)
    images = torch.cat([torch.zeros(2, 1, 8, 16), torch.ones(2, 1, 8, 16), torch.rand(6, 1, 8, 16, generator=g)])
    for name, scorer, prompts in [
        ("digit_alignment", DigitAlignment(), [f"a handwritten {d}" for d in range(10)]),
        ("number_alignment", NumberAlignment(), [f"the number {10 + 9 * d}" for d in range(10)]),
    ]:
        low, high = output_range(name)
        scores = scorer(images, prompts, [{} for _ in prompts])
        assert torch.isfinite(scores).all() and low <= scores.min() and scores.max() <= high
    assert output_range("jpeg_compressibility") is None and output_range("remote:http://127.0.0.1:1") is None
    assert total_reward_span("digit_alignment:0.5,number_alignment:-1.5") == 2.0
    # The weighted sum's own ends: a negative weight takes its scorer's high end to the low one.
    from rewards.registry import total_reward_bounds

    assert total_reward_bounds("digit_alignment:0.5,number_alignment:-1.5") == (-1.5, 0.5)
    assert total_reward_bounds("clip_score:2,number_alignment:1") == (-2.0, 3.0)
    assert total_reward_bounds("number_alignment:1,jpeg_compressibility:1") is None  # one without a range
