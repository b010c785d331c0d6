"""Helpers for pass tests: build small graphs, run them, compare before and after."""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper

import tensorkiln
from tensorkiln.ir import Graph
from tensorkiln.ir.verify import verify
from tensorkiln.runtime import Runner


def model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    # IR 10: what onnxruntime reads wherever it is installed (a newer onnx writes a newer default)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def graph_of(m: onnx.ModelProto) -> Graph:
    return tensorkiln.import_onnx(m)


def ops(graph: Graph) -> list[str]:
    """The graph's ops in order, fused ones as 'tensorkiln.Op'."""
    return [f"{n.domain}.{n.op}" if n.domain else n.op for n in graph.nodes]


def run(graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return Runner(graph).infer(feeds)


def assert_pass_preserves_outputs(
    graph: Graph,
    apply,
    feeds: dict[str, np.ndarray],
    rtol: float = 1e-5,
    atol: float | None = None,
) -> Graph:
    """Run ``apply`` (graph -> None/int) on a copy of ``graph``; outputs must stay equal.

    Equal means within ``rtol`` relative, with an absolute floor of ``rtol`` times the output's
    largest magnitude by default (a rewrite reassociates float sums, so an element that nearly
    cancels can move by a few ulps of the output's scale). Returns the transformed copy (verified)
    for Before/Expected structure checks.
    """
    before = run(graph, feeds)
    after_graph = copy.deepcopy(graph)
    apply(after_graph)
    verify(after_graph)
    after = run(after_graph, feeds)
    assert list(after) == list(before), f"outputs changed: {list(before)} -> {list(after)}"
    for name in before:
        ref = np.asarray(before[name])
        floor = atol
        if floor is None:
            floor = rtol * float(np.abs(ref).max()) if ref.size and ref.dtype.kind == "f" else 0.0
        np.testing.assert_allclose(after[name], ref, rtol=rtol, atol=floor, err_msg=name)
    return after_graph
