"""Anonymous dimension markers ("?", "", "-1", ...) are each their own unknown, as in onnxruntime.

paddle2onnx declares every dynamic axis as dim_param "?"; binding them to one symbol would refuse
inputs whose dynamic axes differ in size.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tensorkiln
from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.engine import Engine
from tensorkiln.errors import InputError


def _paddle_like(marker: str | int) -> onnx.ModelProto:
    """Conv -> Relu -> global pool, with input [marker, 3, marker, marker] like paddle2onnx's
    (an int marker is a dim_value: -1 is how some exporters say "unknown")."""
    rng = np.random.default_rng()
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [marker, 3, marker, marker])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [marker, 4, marker, marker])
    p = helper.make_tensor_value_info("p", TensorProto.FLOAT, [marker, 4, 1, 1])
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
        helper.make_node("GlobalAveragePool", ["y"], ["p"]),
    ]
    graph = helper.make_graph(nodes, "paddle_like", [x], [y, p], initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)


@pytest.mark.parametrize("marker", ["?", "", "-1", "None", "unk", -1])
def test_each_marker_axis_is_its_own_unknown(marker: str | int) -> None:
    model = _paddle_like(marker)
    graph = tensorkiln.import_onnx(model)
    dims = [d for d in graph.inputs[0].shape if not isinstance(d, int)]
    assert len(dims) == 3 and len(set(dims)) == 3  # three distinct symbols
    rng = np.random.default_rng()
    for shape in [(2, 3, 9, 5), (1, 3, 4, 11)]:
        x = rng.standard_normal(shape).astype(np.float32)
        got = tensorkiln.run_onnx(model, {"x": x})
        want = _ort(model, {"x": x})
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["p"], want[1], rtol=1e-5, atol=1e-5)


def test_named_dims_still_bind_together() -> None:
    """A real name is a promise that the axes agree; only markers are anonymous."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "N"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "N"])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    bad = np.random.default_rng().standard_normal((2, 3)).astype(np.float32)
    with pytest.raises(InputError, match="'N'"):
        tensorkiln.run_onnx(model, {"x": bad})


def test_engine_with_profile_over_marker_axes(tmp_path) -> None:
    model = _paddle_like("?")
    config = BuilderConfig()
    config.add_optimization_profile(
        OptimizationProfile().set_shape("x", (1, 3, 4, 4), (2, 3, 16, 8), (4, 3, 32, 32))
    )
    Builder().build(model, config).save(tmp_path / "m.engine")
    context = Engine.load(tmp_path / "m.engine").create_execution_context()
    rng = np.random.default_rng()
    for shape in [(2, 3, 24, 6), (3, 3, 5, 31)]:
        x = rng.standard_normal(shape).astype(np.float32)
        got = context.infer({"x": x})
        want = _ort(model, {"x": x})
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["p"], want[1], rtol=1e-5, atol=1e-5)
