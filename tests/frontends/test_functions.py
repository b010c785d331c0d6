"""Model-local functions are inlined; standard function ops expand when a backend lacks a kernel."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

import tensorkiln
from tensorkiln.frontends.onnx.functions import expand_functions
from tests.kernels.ort_oracle import run_ort


def test_model_local_function_is_inlined_and_matches_onnxruntime():
    fn = helper.make_function(
        "custom",
        "ScaledTanh",
        ["x"],
        ["y"],
        [
            helper.make_node("Constant", [], ["a"], value_float=1.7),
            helper.make_node("Tanh", ["x"], ["t"]),
            helper.make_node("Mul", ["t", "a"], ["y"]),
        ],
        [helper.make_opsetid("", 17)],
    )
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])
    graph = helper.make_graph(
        [helper.make_node("ScaledTanh", ["x"], ["y"], domain="custom")], "g", [x], [y]
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)],
        functions=[fn],
    )
    graph_ir = tensorkiln.import_onnx(model)
    assert [n.op for n in graph_ir.nodes] == ["Constant", "Tanh", "Mul"]
    feeds = {"x": np.random.default_rng().standard_normal((3, 5)).astype(np.float32)}
    np.testing.assert_allclose(
        tensorkiln.run_onnx(graph_ir, feeds)["y"], run_ort(model, feeds)[0], rtol=1e-6
    )


def test_function_op_without_kernel_is_expanded_into_its_body():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])
    node = helper.make_node("Gelu", ["x"], ["y"], approximate="tanh")
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [y]), opset_imports=[helper.make_opsetid("", 20)]
    )
    # A backend with no kernels at all sees Gelu expanded into primitive ops.
    expanded = expand_functions(onnx.ModelProto.FromString(model.SerializeToString()), "none")
    ops = {n.op_type for n in expanded.graph.node}
    assert "Gelu" not in ops and {"Tanh", "Mul"} <= ops
    feeds = {"x": np.random.default_rng().standard_normal((4, 6)).astype(np.float32)}
    got = tensorkiln.run_onnx(expanded, feeds)["y"]
    np.testing.assert_allclose(got, run_ort(model, feeds)[0], rtol=1e-5, atol=1e-6)
