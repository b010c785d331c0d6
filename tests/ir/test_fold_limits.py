"""Evaluating nodes ahead of time is bounded by output size, computed before anything is allocated.

A model of a few hundred bytes can ask a ConstantOfShape, Expand, Tile or Range for gigabytes. Import-
time shape inference and the constant folding pass leave such nodes to run at run time (where an
impossible size is a clear KernelError) instead of materializing them while building.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tensorkiln
import tensorkiln.kernels.evaluate as infer
from tensorkiln.builder import Builder
from tensorkiln.errors import EngineCompatibilityError, KernelError
from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.passes.cleanup import constant_folding

BIG = 1 << 26  # elements: 256 MiB of float32, far above the 16 MiB cap


def _ints(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _one(value: float = 1.0) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array([value], np.float32))


# Each generator: nodes producing "big" (a float32 tensor of BIG elements) from tiny constants.
GENERATORS = {
    "ConstantOfShape": (
        [helper.make_node("ConstantOfShape", ["shape"], ["big"], value=_one())],
        [_ints("shape", [BIG])],
    ),
    "Expand": (
        [helper.make_node("Expand", ["one", "shape"], ["big"])],
        [numpy_helper.from_array(np.ones(1, np.float32), "one"), _ints("shape", [BIG])],
    ),
    "Tile": (
        [helper.make_node("Tile", ["one", "reps"], ["big"])],
        [numpy_helper.from_array(np.ones(1, np.float32), "one"), _ints("reps", [BIG])],
    ),
    "Range": (
        [helper.make_node("Range", ["start", "limit", "delta"], ["big"])],
        [
            numpy_helper.from_array(np.array(0, np.float32), "start"),
            numpy_helper.from_array(np.array(BIG, np.float32), "limit"),
            numpy_helper.from_array(np.array(1, np.float32), "delta"),
        ],
    ),
}


def _model(op: str) -> onnx.ModelProto:
    """y = x * ReduceMax(big): tiny file, huge intermediate."""
    nodes, inits = GENERATORS[op]
    nodes = [*nodes, helper.make_node("ReduceMax", ["big"], ["m"], keepdims=0)]
    nodes.append(helper.make_node("Mul", ["x", "m"], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    graph = helper.make_graph(nodes, op, [x], [y], initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("op", sorted(GENERATORS))
def test_import_and_build_do_not_materialize_huge_outputs(op: str) -> None:
    model = _model(op)
    assert len(model.SerializeToString()) < 400
    graphs = []
    assert _peak_mib(lambda: graphs.append(tensorkiln.import_onnx(model))) < 32
    big = next(v for v in graphs[0].values() if v.name == "big")
    assert big.shape == (BIG,) and big.const is None  # typed by the shape rule, not computed
    assert _peak_mib(lambda: Builder().build(model, progress=False)) < 32


def test_fold_pass_trusts_computed_sizes_not_declared_types() -> None:
    """A graph whose declared type understates the output: the fold pass still does not fold."""
    shape = Value("shape", TensorType(DType.INT64, (1,)), const=np.array([BIG], np.int64))
    big = Value("big", TensorType(DType.FLOAT, (2,)))  # a lie: the node makes BIG elements
    y = Value("y", TensorType(DType.FLOAT, (2,)))
    nodes = [
        Node("ConstantOfShape", [shape], [big], {"value": np.ones(1, np.float32)}, name="cos"),
        Node("Neg", [big], [y], name="neg"),
    ]
    graph = Graph("lying", [], [y], nodes, [shape], {"": 18})
    assert _peak_mib(lambda: constant_folding(graph)) < 32
    assert [n.name for n in graph.nodes] == ["cos", "neg"] and big.const is None


def test_below_the_cap_folds_and_agrees_with_onnxruntime(monkeypatch) -> None:
    """With the cap lowered, a small ConstantOfShape stays a node; above it, it folds. Both run
    like onnxruntime."""
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["c"], value=_one(0.5)),
        helper.make_node("Add", ["x", "c"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 16])
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=[_ints("shape", [64, 16])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    feeds = {"x": np.random.default_rng().standard_normal((64, 16)).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    for cap, folded in [(1024, False), (infer.FOLD_MAX_BYTES, True)]:
        monkeypatch.setattr(infer, "FOLD_MAX_BYTES", cap)
        engine = Builder().build(model, progress=False)
        ops = [n.op for n in engine.graph.nodes]
        assert ("ConstantOfShape" not in ops) == folded, (cap, ops)
        got = engine.create_execution_context().infer(feeds)["y"]
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_data_dependent_ops_bounded_by_inputs_still_fold() -> None:
    """NonZero of a constant (size known only by running) folds: its output is bounded."""
    mask = numpy_helper.from_array(np.array([[1, 0, 3], [0, 5, 0]], np.int64), "mask")
    nodes = [
        helper.make_node("NonZero", ["mask"], ["nz"]),
        helper.make_node("Shape", ["nz"], ["s"]),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "sf"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=[mask])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    ir = tensorkiln.import_onnx(model)
    assert next(v for v in ir.values() if v.name == "nz").shape == (2, 3)
    xv = np.random.default_rng().standard_normal(2).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": xv})[0]
    np.testing.assert_allclose(tensorkiln.run_onnx(ir, {"x": xv})["y"], want, rtol=1e-6)


@pytest.mark.parametrize(
    ("backend", "error", "match"),
    [
        ("reference", KernelError, r"ConstantOfShape.*allocate"),
        ("cpu", EngineCompatibilityError, r"activation memory plan needs [\d,]+ bytes"),
        ("cuda", EngineCompatibilityError, r"activation memory plan needs [\d,]+ bytes"),
    ],
)
def test_impossible_size_is_a_clear_error_at_run_time(backend, error, match) -> None:
    """The reference backend fails the node; the torch backends (cpu, and cuda on CPU tensors
    here) refuse to create a context whose memory plan cannot fit."""
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["big"], value=_one()),
        helper.make_node("ReduceMax", ["big"], ["m"], keepdims=0),
        helper.make_node("Mul", ["x", "m"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=[_ints("shape", [1 << 50])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    builder = Builder("cuda", device="cpu") if backend == "cuda" else Builder(backend)
    engine = builder.build(model, progress=False)
    with pytest.raises(error, match=match):
        engine.create_execution_context().infer({"x": np.ones(3, np.float32)})
