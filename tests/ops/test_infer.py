"""Shape inference without kernels (tensorkiln.ops.infer) and with the reference kernels as its
evaluator (tensorkiln.kernels.evaluate): the first knows the shapes constants spell, the second
also folds computations; both agree on the types of what they infer."""

from __future__ import annotations

import copy

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import tensorkiln
from tensorkiln.ir import TensorType
from tensorkiln.kernels import evaluate
from tensorkiln.ops import infer

rng = np.random.default_rng()


def _graph():
    """x -> Reshape(x, Constant shape) and Cos(Constant) -> Add(x, .): a shape a Constant spells,
    and a computation only an evaluator can fold."""
    c = rng.standard_normal(12).astype(np.float32)
    nodes = [
        helper.make_node(
            "Constant",
            [],
            ["shape"],
            value=numpy_helper.from_array(np.array([-1, 2], dtype=np.int64)),
        ),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(c)),
        helper.make_node("Cos", ["c"], ["cos"]),
        helper.make_node("Reshape", ["cos", "shape"], ["cos2"]),
        helper.make_node("Add", ["r", "cos2"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    return tensorkiln.import_onnx(model), c


def _clear(graph):
    for v in graph.values():
        if v not in graph.inputs and v not in graph.initializers:
            v.type = None


def test_inference_without_kernels_knows_what_constants_spell():
    graph, _ = _graph()
    _clear(graph)
    infer.infer_shapes(graph)  # no evaluator
    shapes = {v.name: v.shape for v in graph.values() if isinstance(v.type, TensorType)}
    assert shapes["r"] == (6, 2)
    assert shapes["cos"] == (12,)  # the rule's type, though the value is not computed
    assert shapes["y"] == (6, 2)


def test_the_reference_evaluator_folds_what_it_can():
    graph, c = _graph()
    plain = copy.deepcopy(graph)
    _clear(graph)
    _clear(plain)
    known: list = []

    def spy(g, node, args, **kw):
        out = evaluate.evaluate_node(g, node, args, **kw)
        if out is not None:
            known.append((node.op, out))
        return out

    infer.infer_shapes(graph, evaluate=spy)
    cos = [out[0] for op, out in known if op == "Cos"]
    assert len(cos) == 1
    np.testing.assert_allclose(cos[0], np.cos(c), rtol=1e-6)  # numpy is the oracle
    infer.infer_shapes(plain)
    types = {v.name: v.type for v in graph.values()}
    assert all(types[v.name] == v.type for v in plain.values() if v.name in types)


def test_quantize_linear_infers_float8_at_an_older_opset():
    """The builder writes float8 Q/DQ into models of any opset; ONNX's QuantizeLinear schema
    before 19 refuses an E4M3 zero point, so the native rule must type it (and keep the shape
    concrete at the shapes the autotuner works with)."""
    from tensorkiln.ir import DType, Graph, Node, Value

    x = Value("x", TensorType(DType.FLOAT16, ("batch", 8)))
    s = Value("s", TensorType(DType.FLOAT, ()), const=np.float32(0.1))
    zp = Value("zp", TensorType(DType.FLOAT8E4M3FN, ()), const=np.zeros((), np.float32))
    q, d = Value("q", None), Value("d", None)
    graph = Graph(inputs=[x], outputs=[d], initializers=[s, zp], opsets={"": 17},
                  nodes=[Node("QuantizeLinear", [x, s, zp], [q]),
                         Node("DequantizeLinear", [q, s, zp], [d])])  # fmt: skip
    concrete = infer.infer_at_shapes(graph, {"x": (4, 8)})
    types = {v.name: v.type for v in concrete.values()}
    assert types["q"] == TensorType(DType.FLOAT8E4M3FN, (4, 8))
    assert types["d"] == TensorType(DType.FLOAT, (4, 8))


def test_a_pool_of_float8_codes_infers_at_concrete_shapes():
    """An FP8 engine pools E4M3 codes (the stem's max pool, rewritten to run on its quantized
    output); ONNX's MaxPool takes no float8 at any opset, so its types come from float32
    inference, narrowed back. Left symbolic, every layer after the pool would have no
    concrete shape for the autotuner to time it at. The oracle: onnxruntime's output shape
    for the same pool on float32."""
    import onnxruntime as ort

    from tensorkiln.ir import DType, Graph, Node, Value

    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}
    x = Value("x", TensorType(DType.FLOAT8E4M3FN, ("n", 16, 30, 30)))
    y = Value("y", TensorType(DType.FLOAT8E4M3FN, ("n", 16, "h", "w")))
    graph = Graph(inputs=[x], outputs=[y], opsets={"": 19},
                  nodes=[Node("MaxPool", [x], [y], attrs=attrs)])  # fmt: skip
    concrete = infer.infer_at_shapes(graph, {"x": (5, 16, 30, 30)})
    got = {v.name: v.type for v in concrete.values()}["y"]
    pool = helper.make_node("MaxPool", ["x"], ["y"], **attrs)
    model = helper.make_model(
        helper.make_graph([pool], "p", [helper.make_tensor_value_info("x", 1, [5, 16, 30, 30])],
                          [helper.make_tensor_value_info("y", 1, None)]),
        opset_imports=[helper.make_opsetid("", 19)],
    )  # fmt: skip
    feed = rng.standard_normal((5, 16, 30, 30)).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": feed})
    assert got == TensorType(DType.FLOAT8E4M3FN, want.shape)
