"""Weights swapped into the one trained module (flywheel/recipe/swapped_weights.py): in-place exchange, the
dtype fallback, restoring on errors, checks before anything moves, and the "swapped" layout's weight sync."""

import pytest
import torch

from engine import Engine, GenerationRequest, load_model
from flywheel.recipe.swapped_weights import SwappedTransport, nbytes, swapped_in
from flywheel.sync.controller import WeightSyncController


def params(*values, dtype=torch.float32):
    return [(f"p{i}", torch.nn.Parameter(torch.tensor(v, dtype=dtype))) for i, v in enumerate(values)]


def test_same_dtype_weights_are_exchanged_in_place_and_both_come_back_bit_for_bit():
    named = params([1.0, 2.0], [[3.0]])
    weights = {"p0": torch.tensor([5.0, 6.0]), "p1": torch.tensor([[7.0]]), "unused": torch.zeros(9)}
    storages = [p.data_ptr() for _, p in named]
    with swapped_in(named, weights):
        assert named[0][1].tolist() == [5.0, 6.0] and named[1][1].tolist() == [[7.0]]
        # Exchanged, not copied aside: the dict holds the trained values for the duration.
        assert weights["p0"].tolist() == [1.0, 2.0] and weights["p1"].tolist() == [[3.0]]
    assert named[0][1].tolist() == [1.0, 2.0] and named[1][1].tolist() == [[3.0]]
    assert weights["p0"].tolist() == [5.0, 6.0] and weights["p1"].tolist() == [[7.0]]
    assert [p.data_ptr() for _, p in named] == storages  # the Parameters keep their storage (optimizer, DDP)
    assert named[0][1].requires_grad


def test_weights_of_another_dtype_are_copied_in_and_the_trained_ones_restored_exactly():
    named = params([1.0 / 3.0, 2.0], dtype=torch.bfloat16)
    trained = named[0][1].detach().clone()
    average = {"p0": torch.tensor([0.123456789, -4.0], dtype=torch.float32)}  # a float32 EMA of bf16 weights
    with swapped_in(named, average):
        assert torch.equal(named[0][1], average["p0"].to(torch.bfloat16))
        assert average["p0"].tolist() == pytest.approx([0.123456789, -4.0])  # left alone
    assert torch.equal(named[0][1], trained)


def test_an_error_in_the_body_still_restores_the_trained_weights():
    named = params([1.0], [2.0])
    weights = {"p0": torch.tensor([8.0]), "p1": torch.tensor([9.0])}
    with pytest.raises(RuntimeError, match="boom"):
        with swapped_in(named, weights):
            raise RuntimeError("boom")
    assert [p.item() for _, p in named] == [1.0, 2.0] and [w.item() for w in weights.values()] == [8.0, 9.0]


@pytest.mark.parametrize("weights, message", [
    ({"p0": torch.tensor([8.0])}, r"no tensor for 1 of the 2 trained parameters \(e.g. 'p1'\)"),
    ({"p0": torch.tensor([8.0]), "p1": torch.zeros(2)}, r"'p1': shape \(2,\), the trained parameter's is \(1,\)"),
])
def test_missing_or_misshapen_weights_are_refused_before_anything_moves(weights, message):
    named = params([1.0], [2.0])
    with pytest.raises(ValueError, match=message):
        with swapped_in(named, weights, what="the sampling policy"):
            pass
    assert [p.item() for _, p in named] == [1.0, 2.0] and weights["p0"].item() == 8.0


def test_the_swapped_layout_rolls_out_the_synced_weights_from_the_trained_module():
    model = load_model("toy-digits")
    named = list(model.transformer.named_parameters())
    trained = {n: p.detach().clone() for n, p in named}
    g = torch.Generator().manual_seed(3)
    theta_old = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in named}
    engine = Engine(model)
    controller = WeightSyncController(engine, transport=SwappedTransport(named, dict(trained)))
    requests = [GenerationRequest(prompt=f"the digit {d}", seed=40 + d, steps=4) for d in (1, 7)]

    metrics = controller.sync(theta_old)
    assert metrics["weight_version"] == 1 == engine.weight_version
    assert metrics["sync/bytes"] == nbytes(theta_old) > 0  # what each rollout swaps in
    with controller.transport.serving():
        served = engine.generate(requests)
    assert all(torch.equal(p, trained[n]) for n, p in named)  # back to the trained weights, bit for bit
    own = load_model("toy-digits")
    own.transformer.load_state_dict(theta_old)  # an engine holding theta_old itself: the same rollouts
    reference = Engine(own, weight_version=1).generate(requests)
    assert torch.equal(served.latents, reference.latents) and served.weight_version == 1
    outside = engine.generate(requests)  # without the context the engine samples the trained weights
    assert not torch.equal(outside.latents, served.latents)

    with pytest.raises(ValueError, match="the synced weights: no tensor for"):
        controller.sync({})
    assert engine.weight_version == 1  # a refused sync leaves the version where it was
