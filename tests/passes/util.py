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


def model(nodes, inputs, outputs, inits=(), opset=17, fused=False) -> onnx.ModelProto:
    """A model of ``nodes``; ``fused`` also imports the tensorkiln domain (Expected graphs)."""
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    opsets = [helper.make_opsetid("", opset)]
    if fused:
        opsets.append(helper.make_opsetid("tensorkiln", 1))
    # IR 10: what onnxruntime reads wherever it is installed (a newer onnx writes a newer default)
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


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


def structure(graph: Graph) -> list[tuple]:
    """The graph's nodes as (domain, op, attributes, inputs), names left out, for comparing an
    optimized graph with an Expected one. An input reads a graph input (by name), a constant (by
    shape and dtype), or output ``k`` of the ``i``-th node."""
    made = {v: (i, k) for i, n in enumerate(graph.nodes) for k, v in enumerate(n.outputs)}
    inputs = {v: v.name for v in graph.inputs}
    rows = []
    for n in graph.nodes:
        ins = []
        for v in n.inputs:
            if v is None:
                ins.append(None)
            elif v in made:
                ins.append(("node", *made[v]))
            elif v in inputs:
                ins.append(("input", inputs[v]))
            else:
                ins.append(("const", v.const.dtype.str, v.const.shape))
        attrs = {k: a for k, a in n.attrs.items() if not isinstance(a, Graph)}
        rows.append((n.domain, n.op, attrs, ins))
    return rows


def assert_structure(after: Graph, expected: Graph) -> None:
    """``after`` computes what ``expected`` does, node for node (names aside)."""
    got, want = structure(after), structure(expected)
    assert len(got) == len(want), f"{ops(after)} != {ops(expected)}"
    for g, w in zip(got, want):
        assert g[:2] == w[:2], f"{ops(after)} != {ops(expected)}"
        assert g[3] == w[3], f"{g[1]} inputs {g[3]} != {w[3]}"
        assert g[2].keys() == w[2].keys(), f"{g[1]} attributes {g[2]} != {w[2]}"
        for k in g[2]:
            a, b = g[2][k], w[2][k]
            if isinstance(a, (str, bytes)) or isinstance(b, (str, bytes)):
                assert a == b, f"{g[1]}.{k}: {a!r} != {b!r}"
            else:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
