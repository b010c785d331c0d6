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


def _masked_attention(rng: np.random.Generator) -> onnx.ModelProto:
    """softmax(Q K^T / sqrt(D) + where(keep, 0, float32's lowest)) V, as transformers writes a
    padding mask; Q is scaled by a learned-looking weight so the scores are ordinary."""
    b, h, s, d = 2, 2, 8, 16
    lowest = np.float32(np.finfo(np.float32).min)
    nodes = [
        helper.make_node("Where", ["keep", "zero", "lowest"], ["bias"], "mask_where"),
        helper.make_node("Transpose", ["k"], ["kt"], "kt", perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"], "scores"),
        helper.make_node("Div", ["qk", "sqrt_d"], ["scaled"], "scale"),
        helper.make_node("Add", ["scaled", "bias"], ["logits"], "add_mask"),
        helper.make_node("Softmax", ["logits"], ["p"], "softmax", axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"], "context"),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [b, h, s, d]) for n in "qkv"]
    inputs.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, [b, 1, s, s]))
    inits = [
        numpy_helper.from_array(np.float32(0.0), "zero"),
        numpy_helper.from_array(lowest, "lowest"),
        numpy_helper.from_array(np.float32(np.sqrt(d)), "sqrt_d"),
    ]
    out = [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "g", inputs, out, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _attention_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {n: rng.standard_normal((2, 2, 8, 16)).astype(np.float32) for n in "qkv"}
    keep = rng.random((2, 1, 8, 8)) < 0.6
    keep[..., 0] = True  # every query sees a key
    feeds["keep"] = keep
    return feeds


def test_an_additive_attention_mask_does_not_keep_the_attention_in_fp32(tmp_path: Path) -> None:
    """float32's lowest in a padding mask means minus infinity, which float16's saturated
    -65504 means too: the guard leaves the mask and the fused attention in fp16, and the engine
    still agrees with onnxruntime (masked keys get no weight)."""
    rng = np.random.default_rng()
    path = tmp_path / "attention.onnx"
    onnx.save(_masked_attention(rng), path)
    config = BuilderConfig()
    config.set_flag("fp16")
    config.calibration_data = [_attention_feeds(rng) for _ in range(2)]
    engine = Builder("cuda", device="cpu").build(path, config)
    precisions = {n.op: n.precision for n in engine.graph.nodes}
    assert precisions.get("Attention") == "fp16", precisions
    assert "fp32" not in precisions.values(), precisions
    assert not any("beyond fp16's range" in note for note in engine.build["notes"])
    feeds = _attention_feeds(rng)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = np.asarray(engine.create_execution_context().infer(feeds)["o"], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_the_mask_exemption_does_not_reach_the_attention_inputs(tmp_path: Path) -> None:
    """Only the mask is exempt: a Q beyond fp16's range on the calibration data still keeps
    the attention that reads it in float32."""
    rng = np.random.default_rng()
    path = tmp_path / "attention.onnx"
    onnx.save(_masked_attention(rng), path)
    config = BuilderConfig()
    config.set_flag("fp16")
    big = _attention_feeds(rng)
    big["q"] = big["q"] * 3e4  # beyond half of 65504
    config.calibration_data = [big]
    engine = Builder("cuda", device="cpu").build(path, config)
    assert any("beyond fp16's range" in note for note in engine.build["notes"])
    precisions = {n.op: n.precision for n in engine.graph.nodes}
    assert precisions.get("Attention") == "fp32", precisions
