"""torch.compile of the rollout forward, with two rewrites that keep the math and speed up CPUs.

`compile_for_rollouts(module)` is `torch.compile(module)` through Inductor, after
two rewrites of the graph Dynamo captures:

- tanh-approximated GELU (the SD3, FLUX and Wan feed-forwards) becomes
  x·σ(2z) instead of 0.5·x·(1 + tanh z), with z = √(2/π)·(x + 0.044715x³).
  The two are the same function (1 + tanh z = 2σ(2z)), and on CPUs the
  vectorised exp behind σ costs much less than tanh.
- fp32 `linear(x, w, b)` becomes `linear(x, w) + b`. ATen's CPU addmm first copies
  the broadcast bias into the output and then accumulates the GEMM onto it.
  As a plain add, the bias joins the pointwise kernel that already reads the
  GEMM's output (a GELU, a gated residual, the q/k/v concatenation).

Inductor then compiles with `emulate_precision_casts`, so bf16/fp16 kernels
round between ops where eager rounds: the trainer recomputes log-probs eagerly,
and the rollout's policy must be the one it recomputes (the bf16 |ratio - 1| of
the first update drops from ~1e-3 to ~1e-5, tests/test_families.py).

The rewrites change the captured graph itself, so Inductor's caches key on the
rewritten graph (a `decompositions=` table would not: AOTAutograd's cache key
leaves it out). Parameters stay graph inputs (no freezing), so weights written
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


def _dtype(value) -> torch.dtype | None:
    """The dtype of a captured tensor argument (Dynamo records an example value on each node)."""
    example = value.meta.get("example_value") if isinstance(value, fx.Node) else None
    return example.dtype if isinstance(example, torch.Tensor) else None


def _rewrite_gelu(graph: fx.Graph, node: fx.Node) -> bool:
    x, approximate = _call_args(node, ("input", "approximate"))
    dtype = _dtype(x)
    if approximate != "tanh" or dtype is None:
        return False
    with graph.inserting_before(node):
        # Eager computes a low-precision GELU in fp32 and rounds once: so does the rewrite, so that
        # emulate_precision_casts rounds it where eager does and nowhere else.
        wide = x if dtype == torch.float32 else graph.call_method("float", (x,))
        cube = graph.call_function(operator.mul, (graph.call_function(operator.mul, (wide, wide)), wide))
        inner = graph.call_function(operator.add, (wide, graph.call_function(operator.mul, (cube, 0.044715))))
        gate = graph.call_function(torch.sigmoid,
                                   (graph.call_function(operator.mul, (inner, GELU_TANH_SIGMOID_SCALE)),))
        replacement = graph.call_function(operator.mul, (wide, gate))
        if dtype != torch.float32:
            replacement = graph.call_method("to", (replacement, dtype))
    replacement.meta.update(node.meta)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)
    return True


def _rewrite_linear(graph: fx.Graph, node: fx.Node) -> bool:
    x, weight, bias = _call_args(node, ("input", "weight", "bias"))
    # In bf16/fp16 a separate add would round the product before adding the bias, where eager's
    # addmm rounds once: only fp32 linears are rewritten.
    if bias is None or _dtype(x) != torch.float32:
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
    """A torch.compile backend: `rewrite_for_rollouts`, then Inductor rounding bf16/fp16 where eager does."""
    from torch._inductor.compile_fx import compile_fx

    rewrite_for_rollouts(graph_module)
    # Fused bf16 kernels would otherwise keep fp32 between ops that eager rounds after, and training's
    # eager recomputation of the log-probs would then see a different policy (|ratio - 1| ~ 1e-3).
    return compile_fx(graph_module, example_inputs, config_patches={"emulate_precision_casts": True})


def compile_for_rollouts(module: nn.Module) -> nn.Module:
    """The module compiled for inference-only rollouts (training keeps using `module` eagerly)."""
    return torch.compile(module, backend=rollout_backend)
