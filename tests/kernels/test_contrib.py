"""com.microsoft (onnxruntime contrib) kernels against onnxruntime, which implements them: small
random models built on the reference backend and on the cuda backend's torch kernels on CPU."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder
from tensorkiln.errors import TensorkilnError, UnsupportedOpError

MS = "com.microsoft"
F = TensorProto.FLOAT
SEQ, INPUT, HIDDEN = 5, 8, 6


def _dq_lstm_model(rng, *, direction: str, codes: type, per_column: bool, batch: int):
    """A DynamicQuantizeLSTM node with random int8/uint8 W and R, their scales and zero points,
    a bias and initial states; X is the graph input."""
    dirs = 2 if direction == "bidirectional" else 1
    lo, hi = np.iinfo(codes).min, np.iinfo(codes).max + 1
    if codes is np.int8:
        # 7-bit int8 weights: onnxruntime's uint8 x int8 kernel on AVX2 (no VNNI) adds pairs of
        # products in saturating int16 (vpmaddubsw), so with weights of magnitude above 64 its
        # own answer is off; within 7 bits it is exact, as ours always is
        lo, hi = -64, 64
    cols = (dirs, 4 * HIDDEN) if per_column else (dirs,)
    # onnxruntime takes int8 weights symmetric (zero point 0) and reads one uint8 zero point per
    # direction, so a per-column one repeats it
    zero = np.broadcast_to(
        rng.integers(0 if lo else 100, 1 if lo else 156, (dirs, 1)), (dirs, 4 * HIDDEN)
    )
    consts = {
        "W": rng.integers(lo, hi, (dirs, INPUT, 4 * HIDDEN)).astype(codes),
        "R": rng.integers(lo, hi, (dirs, HIDDEN, 4 * HIDDEN)).astype(codes),
        "B": rng.standard_normal((dirs, 8 * HIDDEN)).astype(np.float32),
        "h0": rng.standard_normal((dirs, batch, HIDDEN)).astype(np.float32),
        "c0": rng.standard_normal((dirs, batch, HIDDEN)).astype(np.float32),
        "W_scale": rng.uniform(0.002, 0.01, cols).astype(np.float32),
        "W_zero_point": (zero if per_column else zero[:, 0]).astype(codes),
        "R_scale": rng.uniform(0.002, 0.01, cols).astype(np.float32),
        "R_zero_point": (zero if per_column else zero[:, 0]).astype(codes),
    }
    names = ["X", "W", "R", "B", "", "h0", "c0", ""]
    names += ["W_scale", "W_zero_point", "R_scale", "R_zero_point"]
    node = helper.make_node(
        "DynamicQuantizeLSTM", names, ["Y", "Y_h", "Y_c"], domain=MS,
        direction=direction, hidden_size=HIDDEN,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "dq_lstm",
        [helper.make_tensor_value_info("X", F, [SEQ, batch, INPUT])],
        [helper.make_tensor_value_info(n, F, None) for n in ("Y", "Y_h", "Y_c")],
        [numpy_helper.from_array(np.ascontiguousarray(a), k) for k, a in consts.items()],
    )
    opsets = [helper.make_opsetid("", 12), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # one range per hidden state: see kernels/reference/contrib
    sess = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _tensorkiln(model: onnx.ModelProto, feeds: dict, backend: str) -> list[np.ndarray]:
    """The engine's outputs; backend "cuda" runs the torch kernels on CPU tensors, "cuda-gpu" on
    the GPU."""
    if backend == "reference":
        builder = Builder("reference")
    else:
        builder = Builder("cuda", device="cuda" if backend == "cuda-gpu" else "cpu")
    out = builder.build(model, progress=False).create_execution_context().infer(feeds)
    return [np.asarray(v.cpu().numpy() if hasattr(v, "cpu") else v) for v in out.values()]


@pytest.mark.parametrize(
    "backend", ["reference", "cuda", pytest.param("cuda-gpu", marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize(
    ("direction", "codes", "per_column", "batch"),
    [
        ("bidirectional", np.int8, False, 1),
        ("forward", np.uint8, True, 3),
        ("reverse", np.int8, True, 2),
    ],
)
def test_dynamic_quantize_lstm_matches_onnxruntime(backend, direction, codes, per_column, batch):
    if backend != "reference":
        pytest.importorskip("torch")
    rng = np.random.default_rng()
    model = _dq_lstm_model(
        rng, direction=direction, codes=codes, per_column=per_column, batch=batch
    )
    feeds = {"X": rng.standard_normal((SEQ, batch, INPUT)).astype(np.float32)}
    want = _ort(model, feeds)
    got = _tensorkiln(model, feeds, backend)
    for name, g, w in zip(("Y", "Y_h", "Y_c"), got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_dynamic_quantize_lstm_rejects_wrong_weight_shape():
    rng = np.random.default_rng()
    model = _dq_lstm_model(rng, direction="forward", codes=np.int8, per_column=False, batch=1)
    w = next(t for t in model.graph.initializer if t.name == "W")
    w.CopyFrom(numpy_helper.from_array(np.zeros((1, INPUT + 1, 4 * HIDDEN), np.int8), "W"))
    feeds = {"X": rng.standard_normal((SEQ, 1, INPUT)).astype(np.float32)}
    with pytest.raises(TensorkilnError, match=r"DynamicQuantizeLSTM's W must have shape"):
        _tensorkiln(model, feeds, "reference")


def test_unknown_com_microsoft_op_is_a_clear_unsupported_error():
    node = helper.make_node("NoSuchContribOp", ["x"], ["y"], domain=MS)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", F, [2])],
        [helper.make_tensor_value_info("y", F, [2])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    with pytest.raises(UnsupportedOpError, match=r"'NoSuchContribOp' of domain 'com.microsoft'"):
        Builder("reference").build(model, progress=False)
