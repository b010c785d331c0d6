"""The fp16 overflow guard: a model whose intermediate values pass fp16's 65504 on real inputs
returns inf/NaN from a plain fp16 engine; given calibration data, the builder keeps those layers
in float32 and the engine agrees with onnxruntime. (The cuda backend's kernels on CPU tensors.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder, BuilderConfig

pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")


def _model(rng: np.random.Generator) -> onnx.ModelProto:
    """x -> MatMul (a large weight: values near 1e5) -> ReduceMean-normalize -> MatMul -> y."""
    w1 = (rng.standard_normal((16, 32)) * 3e4).astype(np.float32)
    w2 = (rng.standard_normal((32, 4)) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["big"], "fc_big"),
        helper.make_node("ReduceL2", ["big"], ["norm"], "norm", axes=[1], keepdims=1),
        helper.make_node("Div", ["big", "norm"], ["unit"], "divide"),
        helper.make_node("MatMul", ["unit", "w2"], ["y"], "fc_out"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_layers_beyond_fp16_stay_fp32_with_calibration_data(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    path = tmp_path / "m.onnx"
    onnx.save(_model(rng), path)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[
        0
    ]

    def build(calibrated: bool):
        config = BuilderConfig()
        config.set_flag("fp16")
        if calibrated:
            config.calibration_data = [{"x": rng.standard_normal((8, 16)).astype(np.float32)}]
        return Builder("cuda", device="cpu").build(path, config)

    plain = build(False).create_execution_context().infer({"x": x})["y"]
    assert not np.all(np.isfinite(plain)) or np.abs(plain - want).max() > 0.1  # broken in fp16
    guarded = build(True)
    kept = {n.name: n.precision for n in guarded.graph.nodes}
    assert kept["fc_big"] == "fp32"
    assert any("beyond fp16's range" in note for note in guarded.build["notes"])
    got = np.asarray(guarded.create_execution_context().infer({"x": x})["y"], np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
