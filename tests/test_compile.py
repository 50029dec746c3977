"""Engine(compile=True): the compiled serving forward matches eager, and sees weights synced in place."""

import torch

from engine import Engine, GenerationRequest, load_model


def reqs(n=4):
    return [GenerationRequest(prompt=f"the digit {d}", seed=40 + i, steps=6) for i, d in enumerate([3, 8, 1, 5][:n])]


def test_compiled_engine_matches_eager_and_uses_weights_synced_in_place():
    eager, compiled = Engine(load_model("toy-digits")), Engine(load_model("toy-digits"), compile=True)
    first = compiled.generate(reqs())
    reference = eager.generate(reqs())
    assert (first.latents - reference.latents).abs().max() <= 1e-5
    assert (first.log_probs - reference.log_probs).abs().max() <= 1e-4
    assert compiled.serving_transformer() is not compiled.model.transformer  # it really is the compiled module

    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in eager.model.transformer.state_dict().items()}
    compiled.load_weights(new, version=1)
    eager.load_weights(new, version=1)
    after, reference = compiled.generate(reqs()), eager.generate(reqs())
    assert after.weight_version == 1
    assert (after.latents - first.latents).abs().max() > 1e-3  # the new weights changed the rollout ...
    assert (after.latents - reference.latents).abs().max() <= 1e-5  # ... exactly as they change eager's
