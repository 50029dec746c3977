"""Tests of `DigitTypicalityJudge`: real digits score ~0.5, wrong-class digits and saturated blobs ~0."""

import math

import pytest
import torch
import torch.nn.functional as F

from rewards.digits import DigitAlignment, digit_split
from rewards.judges import DigitJudge, DigitTypicalityJudge


@pytest.fixture(scope="module")
def judge():
    return DigitTypicalityJudge()


@pytest.fixture(scope="module")
def split():
    """(x_train, x_test, y_train, y_test): images [N, 1, 8, 8] in [0, 1], labels [N] long."""
    x_train, x_test, y_train, y_test = digit_split()
    as_images = lambda x: torch.tensor(x, dtype=torch.float32)[:, None] / 16.0  # noqa: E731
    return as_images(x_train), as_images(x_test), torch.tensor(y_train), torch.tensor(y_test)


def _prompted(digits) -> tuple[list[str], list[dict]]:
    digits = [int(d) for d in digits]
    return [""] * len(digits), [{"digit": d} for d in digits]


def test_real_heldout_digits_score_about_half_in_every_class(judge, split):
    _, x, _, y = split
    scores = judge(x, *_prompted(y))
    assert scores.shape == (len(y),) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all() and scores.min() >= 0 and scores.max() <= 1
    for digit in range(10):
        mean = scores[y == digit].mean().item()
        assert 0.35 <= mean <= 0.65, f"digit {digit}: real held-out digits score {mean:.3f}; expected ~0.5"
    # An empirical p-value: the scores spread over [0, 1], not all bunched in the middle.
    assert (scores <= 0.1).any() and (scores >= 0.9).any()


def test_real_digits_prompted_as_another_digit_score_low(judge, split):
    _, x, _, y = split
    threes = x[y == 3]
    assert judge(threes, *_prompted([8] * len(threes))).mean().item() < 0.1
    for true in range(10):
        images = x[y == true]
        for prompted in range(10):
            if prompted != true:
                mean = judge(images, *_prompted([prompted] * len(images))).mean().item()
                assert mean < 0.1, f"real {true}s prompted as {prompted} score {mean:.3f}; expected < 0.1"


def test_saturated_blob_both_classifiers_accept_scores_near_zero(judge, split):
    # The failure the judge exists for: digit 6's class mean thresholded to 0/1 is a blob the reward CNN
    # and the SVC judge both read as a 6, yet it is further from real 6s than any held-out real 6.
    x_train, _, y_train, _ = split
    blob = (x_train[y_train == 6].mean(dim=0, keepdim=True) > 0.2).float()
    prompts, metadata = _prompted([6])
    assert DigitAlignment()(blob, prompts, metadata).item() > 0.9
    assert DigitJudge()(blob, prompts, metadata).item() > 0.9
    assert judge(blob, prompts, metadata).item() < 0.05
    dilated = F.max_pool2d(blob, 3, stride=1, padding=1)
    assert judge(dilated, prompts, metadata).item() < 0.05
    # Every digit's thresholded mean, and the flat images, are atypical of every class.
    blobs = torch.cat([(x_train[y_train == d].mean(dim=0, keepdim=True) > 0.2).float() for d in range(10)])
    assert judge(blobs, *_prompted(range(10))).max().item() < 0.05
    for value in (0.0, 1.0):
        flat = torch.full((10, 1, 8, 8), value)
        assert judge(flat, *_prompted(range(10))).max().item() < 0.05


# The first held-out image of the shared split (a 7), as load_digits values 0..16.
GOLDEN_SEVEN = [[0, 0, 2, 13, 16, 9, 0, 0], [0, 0, 12, 12, 7, 16, 3, 0], [0, 1, 14, 3, 0, 16, 4, 0],
                [0, 0, 0, 4, 10, 16, 6, 0], [0, 0, 0, 13, 16, 16, 9, 0], [0, 0, 0, 5, 13, 1, 0, 0],
                [0, 0, 0, 11, 9, 0, 0, 0], [0, 0, 1, 16, 4, 0, 0, 0]]


def test_golden_value_of_one_real_digit(judge):
    image = torch.tensor(GOLDEN_SEVEN, dtype=torch.float32)[None, None] / 16.0
    assert judge.distances(image, [7]).item() == pytest.approx(1.1110243021644486, rel=1e-9)
    # 17 of the 36 held-out 7s are at least that far from their nearest train 7.
    assert judge(image, [""], [{"digit": 7}]).item() == pytest.approx(17 / 36, abs=1e-6)
    assert judge(image, ["a handwritten seven"], [{}]).item() == pytest.approx(17 / 36, abs=1e-6)


def test_a_training_digit_scores_one(judge, split):
    # Distance 0 to its own reference row: the judge's blind spot is a model that copies training digits.
    x_train, _, y_train, _ = split
    assert torch.equal(judge.distances(x_train[:20], y_train[:20].tolist()), torch.zeros(20, dtype=torch.float64))
    assert torch.equal(judge(x_train[:20], *_prompted(y_train[:20])), torch.ones(20))


def test_classes_match_digit_judge_and_unnamed_digits_score_nan(judge, split):
    prompts = ["a handwritten seven", "number 3, written neatly", "a picture", "anything", "two or three"]
    metadata = [{}, {}, {}, {"digit": 4}, {}]
    expected = DigitJudge().classes(prompts, metadata)
    assert judge.classes(prompts, metadata) == expected == [7, 3, None, 4, None]
    _, x, _, _ = split
    scores = judge(x[:5], prompts, metadata)
    assert scores.shape == (5,) and scores.dtype == torch.float32
    assert [math.isnan(s) for s in scores.tolist()] == [False, False, True, False, True]


def test_rgb_and_upscaled_images_score_as_their_gray_8x8(judge, split):
    _, x, _, y = split
    x, prompts, metadata = x[:30], *_prompted(y[:30])
    gray = judge(x, prompts, metadata)
    assert torch.equal(judge(x.expand(-1, 3, -1, -1), prompts, metadata), gray)
    upscaled = F.interpolate(x, scale_factor=4, mode="nearest")
    assert torch.allclose(judge(upscaled, prompts, metadata), gray)


def test_is_never_a_trainable_reward():
    import rewards

    assert DigitTypicalityJudge.name == "digit_typicality" and "digit_typicality" not in rewards.available()


def test_deterministic_across_instances(judge, split):
    _, x, _, y = split
    assert torch.equal(DigitTypicalityJudge()(x, *_prompted(y)), judge(x, *_prompted(y)))


def test_bad_input_is_a_clear_error(judge):
    images = torch.rand(2, 1, 8, 8)
    with pytest.raises(ValueError, match="2 images and 3 prompts"):
        judge(images, *_prompted([1, 2, 3]))
    with pytest.raises(ValueError, match="non-finite"):
        judge(torch.full((1, 1, 8, 8), math.nan), *_prompted([1]))
    with pytest.raises(ValueError, match="out of range"):
        judge(images[:1], *_prompted([10]))
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        judge(torch.rand(1, 8, 8), *_prompted([1]))
