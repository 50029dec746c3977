"""Which scorers pass gradients to the pixels (`differentiable = True`), checked on tiny inputs: d reward / d image
is finite and non-zero for each one marked, and the registry says which are (remote ones never)."""

from __future__ import annotations

import pytest
import torch

from rewards.registry import differentiable_scorers, get, is_differentiable_target
from rewards.types import is_differentiable

from test_clip_rewards import clip_folder  # noqa: F401  the tiny random CLIP folder fixture

MARKED = {"digit_alignment", "number_alignment", "clip_score", "pickscore", "aesthetic"}


def pixel_gradient(scorer, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    images = images.clone().requires_grad_(True)
    scores = scorer(images, prompts, [{} for _ in prompts])
    assert scores.shape == (len(prompts),) and torch.isfinite(scores).all()
    scores.sum().backward()
    return images.grad


def assert_real_gradient(grad: torch.Tensor) -> None:
    assert grad is not None and torch.isfinite(grad).all()
    assert grad.abs().sum() > 0
    assert (grad.flatten(1).abs().sum(1) > 0).all()  # every row's score depends on its own pixels


def test_the_registry_names_the_differentiable_scorers_and_no_others():
    assert set(differentiable_scorers()) == MARKED
    for name in ("ocr", "jpeg_compressibility", "vlm_judge", "hpsv3", "audio_loudness", "clip_score_video"):
        assert not is_differentiable_target(name), name
    assert not is_differentiable_target("remote:http://127.0.0.1:9/score")
    assert not is_differentiable(object())  # the default: not differentiable


def test_digit_cnn_rewards_pass_gradients_to_the_pixels():
    images = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    assert_real_gradient(pixel_gradient(get("digit_alignment"), images, ["digit 3", "digit 7", "digit 0"]))
    pair = torch.rand(2, 1, 8, 16, generator=torch.Generator().manual_seed(1))
    grad = pixel_gradient(get("number_alignment"), pair, ["the number 42", "the number 17"])
    assert_real_gradient(grad)
    assert (grad[..., :8].abs().sum() > 0) and (grad[..., 8:].abs().sum() > 0)  # both digits' halves


def test_the_digit_reward_gradient_matches_a_finite_difference():
    scorer = get("digit_alignment")
    images = torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(2)) * 0.6 + 0.2
    grad = pixel_gradient(scorer, images, ["digit 5"])
    direction = torch.randn(images.shape, generator=torch.Generator().manual_seed(3))
    h = 1e-3
    plus = scorer(images + h * direction, ["digit 5"], [{}])
    minus = scorer(images - h * direction, ["digit 5"], [{}])
    numeric = float((plus - minus) / (2 * h))
    assert float((grad * direction).sum()) == pytest.approx(numeric, rel=2e-2, abs=1e-5)


@pytest.mark.parametrize("name", ["clip_score", "pickscore", "aesthetic"])
def test_clip_family_rewards_pass_gradients_to_the_pixels(name, clip_folder):  # noqa: F811
    scorer = get(name, path=str(clip_folder), device="cpu")
    images = torch.rand(2, 3, 40, 48, generator=torch.Generator().manual_seed(4)) * 0.8 + 0.1
    assert_real_gradient(pixel_gradient(scorer, images, ["a red cat", "a blue dog"]))


def test_scores_without_grad_build_no_graph():
    # Rollouts score images that need no grad: the scorer must not build a graph (its weights are frozen).
    scores = get("digit_alignment")(torch.rand(2, 1, 8, 8), ["digit 1", "digit 2"], [{}, {}])
    assert not scores.requires_grad
