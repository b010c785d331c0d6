"""The executor's observer hook: every value of the top graph as it is produced.

Layer-by-layer comparison is what it is for: an optimized cpu engine's intermediates, seen through
the hook, match the reference backend's kernels running the same optimized graph, and both end at
onnxruntime's answer for the source model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder
from tensorkiln.ir import Node
from tensorkiln.runtime import Executor

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")


def _conv_net(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv-BN-ReLU, a depthwise conv with hardswish, global pool and a classifier: layers the
    optimizer fuses (ConvAct, GemmAct, ...), so the engine's graph is not the model's."""

    def w(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array(
            (rng.standard_normal(shape) * scale).astype(np.float32), name
        )

    inits = [
        w("w1", 8, 3, 3, 3),
        w("b1", 8),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "scale"),
        w("bias", 8),
        w("mean", 8, scale=0.1),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "var"),
        w("w2", 8, 1, 3, 3),
        w("wfc", 8, 5),
        w("bfc", 5),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node(
            "BatchNormalization", ["c1", "scale", "bias", "mean", "var"], ["bn"], name="bn"
        ),
        helper.make_node("Relu", ["bn"], ["r1"], name="relu"),
        helper.make_node(
            "Conv", ["r1", "w2"], ["c2"], group=8, pads=[1, 1, 1, 1], strides=[2, 2], name="dw"
        ),
        helper.make_node("HardSwish", ["c2"], ["h"], name="hswish"),
        helper.make_node("GlobalAveragePool", ["h"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "wfc"], ["m"], name="fc"),
        helper.make_node("Add", ["m", "bfc"], ["logits"], name="fc_bias"),
        helper.make_node("Softmax", ["logits"], ["y"], axis=-1, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes,
        "convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _recorder(backend: Any, seen: dict[str, np.ndarray], order: list[str]):
    def observe(node: Node, outputs: list[Any]) -> None:
        order.append(node.name)
        for v, value in zip(node.outputs, outputs):
            if v is not None:
                seen[v.name] = np.array(backend.to_host(value))  # a copy: buffers are reused

    return observe


def test_every_intermediate_of_an_optimized_engine_matches_the_reference_backend() -> None:
    rng = np.random.default_rng()
    model = _conv_net(rng)
    engine = Builder("cpu").build(model.SerializeToString(), progress=False)
    graph = engine.graph
    assert len(graph.nodes) < len(model.graph.node)  # the optimizer fused layers
    x = rng.standard_normal((2, 3, 12, 12)).astype(np.float32)

    got: dict[str, np.ndarray] = {}
    order: list[str] = []
    with engine.create_execution_context() as ctx:
        out = ctx.infer({"x": x}, observer=_recorder(ctx.backend, got, order))
    # every layer once, in the engine's order, every output it declares
    assert order == [n.name for n in graph.nodes]
    assert set(got) == {v.name for n in graph.nodes for v in n.outputs if v is not None}

    # the same optimized graph on the reference backend's kernels (the oracle)
    reference = Executor(graph, "reference")
    want: dict[str, np.ndarray] = {}
    ref_order: list[str] = []
    observer = _recorder(reference.backend, want, ref_order)
    ref_out = reference.run({graph.inputs[0]: x}, observer=observer)
    assert ref_order == order and set(want) == set(got)
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)

    # and the last layer is what the engine answered, and what onnxruntime computes
    np.testing.assert_array_equal(got[graph.outputs[0].name], out["y"])
    np.testing.assert_allclose(ref_out[0], out["y"], rtol=1e-4, atol=1e-6)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(out["y"], sess.run(None, {"x": x})[0], rtol=1e-4, atol=1e-6)


def test_a_run_with_an_observer_gives_the_same_outputs_as_one_without() -> None:
    rng = np.random.default_rng()
    engine = Builder("cpu").build(_conv_net(rng).SerializeToString(), progress=False)
    x = rng.standard_normal((2, 3, 12, 12)).astype(np.float32)
    with engine.create_execution_context() as ctx:
        plain = ctx.infer({"x": x})["y"]
        calls: list[str] = []
        seen = ctx.infer({"x": x}, observer=lambda node, outs: calls.append(node.name))["y"]
        again = ctx.infer({"x": x})["y"]  # the hook leaves nothing behind
    np.testing.assert_allclose(seen, plain, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(again, plain)
    assert calls == [n.name for n in engine.graph.nodes]


def _if_model() -> onnx.ModelProto:
    """y = If(cond) then (x * 2 + 1) else (x - 1), then Abs: a subgraph of two nodes."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    then_graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "two"], ["t0"], name="then_mul"),
            helper.make_node("Add", ["t0", "one"], ["t1"], name="then_add"),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("t1", TensorProto.FLOAT, [3])],
        [two, one],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Sub", ["x", "one_e"], ["e0"], name="else_sub")],
        "else",
        [],
        [helper.make_tensor_value_info("e0", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "one_e")],
    )
    nodes = [
        helper.make_node(
            "If", ["cond"], ["branch"], then_branch=then_graph, else_branch=else_graph, name="if"
        ),
        helper.make_node("Abs", ["branch"], ["y"], name="abs"),
    ]
    graph = helper.make_graph(
        nodes,
        "cond",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_subgraph_is_observed_through_the_node_that_runs_it(backend: str) -> None:
    engine = Builder(backend).build(_if_model().SerializeToString(), progress=False)
    x = np.random.default_rng().standard_normal(3).astype(np.float32)
    seen: dict[str, np.ndarray] = {}
    order: list[str] = []
    with engine.create_execution_context() as ctx:
        out = ctx.infer(
            {"cond": np.array(True), "x": x}, observer=_recorder(ctx.backend, seen, order)
        )
    assert order == ["if", "abs"]  # the branch's Mul and Add are not shown one by one
    np.testing.assert_allclose(seen["branch"], x * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose(out["y"], np.abs(x * 2 + 1), rtol=1e-6)
