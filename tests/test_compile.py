"""Engine(compile=True): the compiled serving forward matches eager, and sees weights synced in place."""

import pytest
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


def test_rollout_rewrites_keep_the_function_and_leave_no_tanh_gelu_or_biased_linear():
    from engine.compiling import rewrite_for_rollouts, rollout_backend

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(16, 8),
                                 torch.nn.GELU(), torch.nn.Linear(8, 4, bias=False)).eval()
    seen = {}

    def recording_backend(graph_module, example_inputs):
        seen["counts"] = rewrite_for_rollouts(graph_module)
        seen["calls"] = [(n.target, dict(n.kwargs)) for n in graph_module.graph.nodes if n.op == "call_function"]
        return graph_module.forward  # the rewritten graph itself, run eagerly

    x = 3 * torch.randn(5, 7, 8)  # wide enough that tanh-GELU differs visibly from erf-GELU
    with torch.no_grad():
        rewritten = torch.compile(module, backend=recording_backend)(x)
        compiled = torch.compile(module, backend=rollout_backend)(x)
        reference = module(x)
    assert seen["counts"] == {"gelu": 1, "linear": 2}  # the erf GELU and the bias-free linear are left alone
    gelus = [kwargs for target, kwargs in seen["calls"] if target is torch._C._nn.gelu]
    assert gelus == [{"approximate": "none"}]  # only the exact GELU remains a GELU call
    assert sum(target is torch.sigmoid for target, _ in seen["calls"]) == 1
    assert (rewritten - reference).abs().max() <= 1e-5
    assert (compiled - reference).abs().max() <= 1e-5
    # A one-line golden value: tanh-GELU(1) = 0.5·(1 + tanh(√(2/π)·1.044715)).
    from engine.compiling import GELU_TANH_SIGMOID_SCALE
    assert torch.sigmoid(torch.tensor(GELU_TANH_SIGMOID_SCALE * 1.044715)).item() == pytest.approx(0.8411920, abs=1e-6)


def test_grpo_with_compiled_rollouts_is_on_policy_up_to_float_rounding(tmp_path):
    """model.compile relaxes DESIGN's exact on-policy ratio to float rounding: the compiled rollout's
    log-probs and training's eager recomputation differ only in fused-kernel rounding."""
    from flywheel.runs.rundir import read_metrics
    from trainers.grpo import main

    main([f"run_dir={tmp_path}", "tracker=none", "steps=2", "eval.every=1000", "save_every=1000",
          "sample_every=1000", "model.compile=true",
          # 5 prompts x 8 images = 40 held-out prompts x 1 seed: eval reuses the training batch's compiled graph
          "data.prompts_per_step=5", "data.group_size=8", "eval.seeds=1"])
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert 0.0 <= rows[1]["ratio/max_dev"] <= 1e-5 and rows[1]["clipfrac"] == 0.0
    assert 0.0 <= rows[2]["ratio/max_dev"] <= 1e-5  # after a sync, rollouts use the new weights
