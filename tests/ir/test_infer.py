"""Shape inference: symbolic dims survive real graphs, and inferred shapes match what runs.

The oracle is execution: every node is run with the reference kernels and each output's real shape
must equal its inferred shape once the symbols are bound to the sizes fed in.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import tensorkiln
from tensorkiln.ir import Graph, TensorType
from tensorkiln.kernels.registry import lookup


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def assert_inferred_shapes_match_execution(graph: Graph, feeds: dict[str, np.ndarray]) -> None:
    env = {v: feeds[v.name] for v in graph.inputs}
    env.update({v: v.const for v in graph.initializers})
    symbols: dict[str, int] = {}
    for v in graph.inputs:
        for d, n in zip(v.shape, feeds[v.name].shape):
            if isinstance(d, str):
                symbols[d] = n
    for node in graph.nodes:
        entry = lookup(node.op, node.domain, graph.opset(node.domain))
        out = entry.fn(*[env[v] for v in node.inputs], **node.attrs)
        out = out if isinstance(out, tuple) else (out,)
        for v, arr in zip(node.outputs, out):
            env[v] = arr
            assert isinstance(v.type, TensorType) and v.shape is not None, f"{v.name}: no shape"
            assert len(v.shape) == arr.ndim, f"{v.name}: rank {v.shape} vs {arr.shape}"
            for d, n in zip(v.shape, arr.shape):
                if isinstance(d, int):
                    assert d == n, f"{v.name}: inferred {v.shape}, ran {arr.shape}"
                elif "*" not in d and not d.startswith("_d"):
                    assert symbols.setdefault(d, n) == n, f"{v.name}: {d} != {n}"
            assert v.dtype.numpy == arr.dtype, f"{v.name}: {v.dtype} vs {arr.dtype}"


def test_dynamic_batch_stays_symbolic_through_attention_reshapes():
    """The Shape -> Gather -> Concat -> Reshape pattern torch exports for multi-head attention."""
    rng = np.random.default_rng()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "S", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")
    c = {
        k: numpy_helper.from_array(np.array(v, np.int64), k)
        for k, v in {"i0": 0, "i1": 1, "heads": [4], "hd": [16], "flat": [-1, 64]}.items()
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["q"]),
        helper.make_node("Shape", ["x"], ["shp"]),
        helper.make_node("Gather", ["shp", "i0"], ["n"], axis=0),
        helper.make_node("Gather", ["shp", "i1"], ["s"], axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
        helper.make_node("Unsqueeze", ["s", "ax0"], ["s1"]),
        helper.make_node("Concat", ["n1", "s1", "heads", "hd"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["q", "newshape"], ["q4"]),
        helper.make_node("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["qt", "kt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "qt"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "flat"], ["y"]),
        helper.make_node("Transpose", ["qt"], ["kt"], perm=[0, 1, 3, 2]),
    ]
    ax0 = numpy_helper.from_array(np.array([0], np.int64), "ax0")
    model = _model(nodes, [x], [y], [w, ax0, *c.values()])
    graph = tensorkiln.import_onnx(model)
    by_name = {v.name: v for v in graph.values()}
    assert by_name["newshape"].type.shape == (4,)
    assert by_name["q4"].shape == ("N", "S", 4, 16)
    assert by_name["scores"].shape == ("N", 4, "S", "S")
    assert by_name["y"].shape == ("N*S", 64)
    for n, s in [(1, 5), (3, 7)]:
        feeds = {"x": rng.standard_normal((n, s, 64)).astype(np.float32)}
        assert_inferred_shapes_match_execution(graph, feeds)


def test_conv_pool_gemm_shapes_with_dynamic_batch():
    rng = np.random.default_rng()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 32, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "cw"),
        numpy_helper.from_array(rng.standard_normal((8 * 8 * 8, 10)).astype(np.float32), "fw"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "cw"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "fw"], ["y"]),
    ]
    graph = tensorkiln.import_onnx(_model(nodes, [x], [y], inits))
    assert graph.outputs[0].shape == ("batch", 10)
    by_name = {v.name: v for v in graph.values()}
    assert by_name["p"].shape == ("batch", 8, 8, 8)
    feeds = {"x": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)}
    assert_inferred_shapes_match_execution(graph, feeds)


def test_constant_shape_computations_are_evaluated():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("ReduceProd", ["s"], ["n"], keepdims=1),
        helper.make_node("Reshape", ["x", "n"], ["y"]),
    ]
    graph = tensorkiln.import_onnx(_model(nodes, [x], [y]))
    assert graph.outputs[0].shape == (24,)
