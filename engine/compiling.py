"""torch.compile of the rollout forward, with two rewrites that keep the math and speed up CPUs.

`compile_for_rollouts(module)` is `torch.compile(module)` through Inductor, after
two rewrites of the graph Dynamo captures:

- tanh-approximated GELU (the SD3, FLUX and Wan feed-forwards) becomes
  x·σ(2z) instead of 0.5·x·(1 + tanh z), with z = √(2/π)·(x + 0.044715x³).
  The two are the same function (1 + tanh z = 2σ(2z)), and on CPUs the
  vectorised exp behind σ costs much less than tanh.
- `linear(x, w, b)` becomes `linear(x, w) + b`. ATen's CPU addmm first copies
  the broadcast bias into the output and then accumulates the GEMM onto it.
  As a plain add, the bias joins the pointwise kernel that already reads the
  GEMM's output (a GELU, a gated residual, the q/k/v concatenation).

The rewrites change the captured graph itself, so Inductor's caches key on the
rewritten graph. Parameters stay graph inputs (no freezing), so weights written
in place by a weight sync are used by the next call. Results match eager within
float rounding (tests/test_compile.py).
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

GELU_TANH_SIGMOID_SCALE = 2.0 * 0.7978845608028654  # 2·√(2/π)
GELU_TARGETS = (torch._C._nn.gelu, torch.nn.functional.gelu)
LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


def _call_args(node: fx.Node, names: tuple[str, ...]) -> list:
    """The node's arguments by position, wherever the call passed them (positionally or by name)."""
    values = list(node.args) + [None] * (len(names) - len(node.args))
    for i, name in enumerate(names):
        if name in node.kwargs:
            values[i] = node.kwargs[name]
    return values


def _rewrite_gelu(graph: fx.Graph, node: fx.Node) -> bool:
    x, approximate = _call_args(node, ("input", "approximate"))
    if approximate != "tanh":
        return False
    with graph.inserting_before(node):
        cube = graph.call_function(operator.mul, (graph.call_function(operator.mul, (x, x)), x))
        inner = graph.call_function(operator.add, (x, graph.call_function(operator.mul, (cube, 0.044715))))
        gate = graph.call_function(torch.sigmoid,
                                   (graph.call_function(operator.mul, (inner, GELU_TANH_SIGMOID_SCALE)),))
        replacement = graph.call_function(operator.mul, (x, gate))
    replacement.meta.update(node.meta)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)
    return True


def _rewrite_linear(graph: fx.Graph, node: fx.Node) -> bool:
    x, weight, bias = _call_args(node, ("input", "weight", "bias"))
    if bias is None:
        return False
    with graph.inserting_before(node):
        product = graph.call_function(torch._C._nn.linear, (x, weight))
        replacement = graph.call_function(operator.add, (product, bias))
    replacement.meta.update(node.meta)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)
    return True


def rewrite_for_rollouts(graph_module: fx.GraphModule) -> dict[str, int]:
    """Apply both rewrites in place; returns how many GELUs and linears were rewritten."""
    counts = {"gelu": 0, "linear": 0}
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in GELU_TARGETS:
            counts["gelu"] += _rewrite_gelu(graph_module.graph, node)
        elif node.target in LINEAR_TARGETS:
            counts["linear"] += _rewrite_linear(graph_module.graph, node)
    graph_module.graph.lint()
    graph_module.recompile()
    return counts


def rollout_backend(graph_module: fx.GraphModule, example_inputs):
    """A torch.compile backend: `rewrite_for_rollouts`, then Inductor."""
    from torch._inductor.compile_fx import compile_fx

    rewrite_for_rollouts(graph_module)
    return compile_fx(graph_module, example_inputs)


def compile_for_rollouts(module: nn.Module) -> nn.Module:
    """The module compiled for inference-only rollouts (training keeps using `module` eagerly)."""
    return torch.compile(module, backend=rollout_backend)
