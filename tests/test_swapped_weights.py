"""Weights swapped into the one trained module (flywheel/recipe/policy.py `swapped_in`): in-place exchange, the
dtype fallback, restoring on errors, checks before anything moves, and the "swapped" layout's weight sync."""

import pytest
import torch

from flywheel.recipe.policy import swapped_in


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


def test_the_old_module_path_still_imports_the_one_function():
    """swapped_in moved into flywheel/recipe/policy.py (issue 24); its old module re-exports it for one release."""
    from flywheel.recipe import policy, swapped_weights

    assert swapped_weights.swapped_in is policy.swapped_in
