"""quantize_in_layer_norm: a LayerNorm whose output a QuantizeLinear reads (the next quantized
GEMM's input in BERT and GPT-2) writes the quantized tensor itself, its float output kept for
the other readers (a post-LN block's residual).

Oracles: the same build without the rewrite (the fused output must be bit for bit the
QuantizeLinear's), and onnxruntime on an explicitly quantized model (Q/DQ written in it), run
with its graph optimizations off.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.engine import Engine
from tensorkiln.passes import fuse_qdq
from tensorkiln.precision import quantize
from tests.passes.test_residual_into_gemm import post_ln
from tests.passes.util import model

S, N = 6, 32


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def _build(path, backend: str, precision: str, calib, monkeypatch=None, fuse: bool = True):
    if not fuse:
        rules = tuple(r for r in fuse_qdq.REQUANTIZE if r.name != "quantize_in_layer_norm")
        monkeypatch.setattr(quantize, "REQUANTIZE", rules)
    config = BuilderConfig()
    config.set_flag(precision)
    config.calibration_data = calib
    builder = Builder(backend, device="cpu") if backend == "cuda" else Builder(backend)
    return builder.build(path, config), builder.last_report


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_the_layer_norm_writes_the_quantized_input(tmp_path, monkeypatch, backend, precision):
    if backend == "cuda":
        pytest.importorskip("torch")
    rng = np.random.default_rng()
    path = tmp_path / "m.onnx"
    onnx.save(post_ln(rng, N, head=8), path)
    calib = [{"x": rng.standard_normal((4, S, N)).astype(np.float32)} for _ in range(2)]
    fused, report = _build(path, backend, precision, calib)
    norms = [n for n in fused.graph.nodes if n.op == "LayerNorm"]
    assert len(norms) == 2 and all(n.attrs.get("q_dtype") for n in norms)
    assert any("2 LayerNorms write their output quantized too" in n for n in report.notes)
    plain, _ = _build(path, backend, precision, calib, monkeypatch, fuse=False)
    ops = [n.op for n in fused.graph.nodes]
    assert (
        ops.count("QuantizeLinear") == [n.op for n in plain.graph.nodes].count("QuantizeLinear") - 2
    )
    path_engine = tmp_path / "m.engine"
    fused.save(path_engine)
    fused = Engine.load(path_engine)  # (Y_scale and q_dtype survive the file)
    assert all(n.attrs.get("q_dtype") for n in fused.graph.nodes if n.op == "LayerNorm")
    x = rng.standard_normal((3, S, N)).astype(np.float32)
    got = fused.create_execution_context().infer({"x": x})["out"]
    want = plain.create_execution_context().infer({"x": x})["out"]
    if backend == "reference":
        np.testing.assert_array_equal(got, want)
    else:  # (torch's float32 GEMM epilogues: last-bit differences; one code off is 1e-2)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _explicit(rng, elem: int) -> onnx.ModelProto:
    """x -> LayerNormalization -> Q -> DQ -> MatMul(DQ(W_q)): a model quantized as a tool writes
    it, int8 (zero point 0) or float8 E4M3 (opset 21)."""
    np_q = np.int8 if elem == TensorProto.INT8 else None
    y_scale = np.float32(rng.uniform(0.02, 0.04))
    w = rng.standard_normal((N, 8)).astype(np.float32)
    w_scale = np.float32(np.abs(w).max() / (127 if np_q else 448))
    if np_q:
        w_q = numpy_helper.from_array(np.clip(np.rint(w / w_scale), -127, 127).astype(np.int8),
                                      "w_q")  # fmt: skip
        zero = numpy_helper.from_array(np.zeros((), np.int8), "zero")
    else:
        import ml_dtypes

        codes = (w / w_scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        w_q = helper.make_tensor("w_q", elem, w.shape, codes.tobytes(), raw=True)
        zero = helper.make_tensor("zero", elem, [], np.zeros(1, np.uint8).tobytes(), raw=True)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "be"], ["y"], axis=-1, epsilon=1e-5),
        helper.make_node("QuantizeLinear", ["y", "ys", "zero"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "ys", "zero"], ["ydq"]),
        helper.make_node("DequantizeLinear", ["w_q", "ws", "zero"], ["wdq"]),
        helper.make_node("MatMul", ["ydq", "wdq"], ["out"]),
    ]
    inits = [_const("g", rng.uniform(0.5, 1.5, N).astype(np.float32)),
             _const("be", rng.standard_normal(N).astype(np.float32)),
             _const("ys", y_scale), _const("ws", w_scale), w_q, zero]  # fmt: skip
    return model(nodes, [_vi("x", ["B", S, N])], [_vi("out", ["B", S, 8])], inits, opset=21)


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("elem", [TensorProto.INT8, TensorProto.FLOAT8E4M3FN], ids=["int8", "fp8"])
def test_an_explicitly_quantized_layer_norm_agrees_with_onnxruntime(tmp_path, backend, elem):
    ort = pytest.importorskip("onnxruntime")
    if backend == "cuda":
        pytest.importorskip("torch")
    rng = np.random.default_rng()
    m = _explicit(rng, elem)
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    builder = Builder(backend, device="cpu") if backend == "cuda" else Builder(backend)
    engine = builder.build(path, BuilderConfig())
    (norm,) = [n for n in engine.graph.nodes if n.op == "LayerNorm"]
    assert norm.attrs.get("q_dtype") == elem
    assert "QuantizeLinear" not in [n.op for n in engine.graph.nodes]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(m.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    x = rng.standard_normal((3, S, N)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["out"]
    want = session.run(None, {"x": x})[0]
    # (float32 sums in another order; a code on a rounding boundary may land one step over)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 0.05 * scale
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3
