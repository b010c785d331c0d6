"""SmoothQuant on a GEMM whose input has outlier channels, as transformer activations do: the
engine must equal onnxruntime's run of the same smoothed Q/DQ graph (written here from the
cache's per-channel ranges), and be far closer to the float model than per-tensor INT8 alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.precision.smooth import factors

ort = pytest.importorskip("onnxruntime")
K, N = 64, 32


def _model(w: np.ndarray, b: np.ndarray) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], "fc"),
         helper.make_node("Add", ["h", "b"], ["y"], "bias")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 10, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _data(rng: np.random.Generator, n: int, outliers: np.ndarray) -> np.ndarray:
    x = rng.standard_normal((n, 10, K))
    x[..., outliers] *= 60  # a few channels 60x the rest
    return x.astype(np.float32)


def _oracle(w, b, channel_amax, alpha) -> onnx.ModelProto:
    """Mul(x, 1/s) -> Q -> DQ at max(amax_j / s_j) / 127, weight s*W quantized per column."""
    s = factors(np.asarray(channel_amax), w, 0, alpha)
    a = float(np.max(np.asarray(channel_amax) / s)) / 127
    ws = w * s[:, None]
    wscale = (np.abs(ws).max(axis=0) / 127).astype(np.float32)
    wq = np.clip(np.rint(ws / wscale), -127, 127).astype(np.int8)
    inits = [numpy_helper.from_array(x, n) for x, n in (
        ((1 / s).astype(np.float32), "inv"), (np.float32(a), "a"), (np.int8(0), "zp"),
        (wq, "wq"), (wscale, "ws"), (b, "b"))]  # fmt: skip
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "inv"], ["xs"]),
         helper.make_node("QuantizeLinear", ["xs", "a", "zp"], ["xq"]),
         helper.make_node("DequantizeLinear", ["xq", "a", "zp"], ["xd"]),
         helper.make_node("DequantizeLinear", ["wq", "ws"], ["wd"], axis=1),
         helper.make_node("MatMul", ["xd", "wd"], ["h"]),
         helper.make_node("Add", ["h", "b"], ["y"])],
        "oracle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 10, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # fmt: skip


def test_smoothing_matches_its_qdq_graph_and_recovers_accuracy(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    outliers = rng.choice(K, 3, replace=False)
    w = rng.standard_normal((K, N)) * 0.1
    w[outliers] /= 60  # (as in transformers: the output does not hang on the outliers alone)
    w = w.astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    path = tmp_path / "m.onnx"
    onnx.save(_model(w, b), path)
    calib = [{"x": _data(rng, 8, outliers)} for _ in range(4)]
    x = _data(rng, 16, outliers)
    want = _run(_model(w, b), x)

    def build(alpha):
        config = BuilderConfig()
        config.set_flag("int8")
        config.calibrator = "minmax"
        config.calibration_data = calib
        config.calibration_cache = str(tmp_path / f"c{alpha}.json")
        config.smooth_quant = alpha
        engine = Builder("reference").build(path, config)
        return engine, engine.create_execution_context().infer({"x": x})["y"]

    _, y_plain = build(None)
    smoothed, y_smooth = build(0.5)
    ops = [n.op for n in smoothed.graph.nodes]
    assert ops == ["Mul", "QuantizeLinear", "QGemmAct"], ops
    doc = json.loads((tmp_path / "c0.5.json").read_text())
    channel_amax = doc["tensors"]["x"]["channel_amax"]
    np.testing.assert_allclose(channel_amax, np.abs(np.concatenate([c["x"] for c in calib]))
                               .reshape(-1, K).max(0), rtol=1e-6)  # fmt: skip
    oracle = _run(_oracle(w, b, channel_amax, 0.5), x)
    np.testing.assert_allclose(y_smooth, oracle, rtol=1e-4, atol=1e-4 * np.abs(oracle).max())

    def rel(y):
        return np.linalg.norm(y - want) / np.linalg.norm(want)

    assert rel(y_smooth) < rel(y_plain) / 2, (rel(y_smooth), rel(y_plain))
    auto, y_auto = build("auto")  # per GEMM, measured on the first calibration batch
    assert any("smoothquant (auto" in note for note in auto.build["notes"])
    assert rel(y_auto) <= rel(y_plain) * 1.05, (rel(y_auto), rel(y_plain))
    assert "channel_amax" not in json.loads((tmp_path / "cNone.json").read_text())["tensors"]["x"]


def test_a_cache_without_channel_ranges_is_refused_for_smoothing(tmp_path: Path) -> None:
    from tensorkiln.errors import BuildError

    rng = np.random.default_rng()
    w = rng.standard_normal((K, N)).astype(np.float32)
    path = tmp_path / "m.onnx"
    onnx.save(_model(w, np.zeros(N, np.float32)), path)
    config = BuilderConfig()
    config.set_flag("int8")
    config.calibration_data = [{"x": _data(rng, 4, np.array([1]))}]
    config.calibration_cache = str(tmp_path / "c.json")
    Builder("reference").build(path, config)
    config.calibration_data, config.smooth_quant = None, 0.5
    with pytest.raises(BuildError, match="no range for 1 of the 1 tensors"):
        Builder("reference").build(path, config)
