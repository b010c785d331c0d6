"""Explicit quantization: models that carry their own QuantizeLinear/DequantizeLinear nodes, as
onnxruntime's quantizer and NVIDIA's toolkits write them, are honoured as written. Symmetric
int8/float8 convolutions and GEMMs become quantized layers; anything else runs through its Q/DQ
nodes in float. The oracle is onnxruntime's own run of the same Q/DQ model."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder
from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.passes.fuse_conv import fuse_conv_act
from tensorkiln.passes.fuse_qdq import fuse_quantized

ort = pytest.importorskip("onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization")


def _float_model(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv+Relu, depthwise Conv+Relu, global pool, Gemm."""
    inits = {
        "w1": rng.standard_normal((8, 3, 3, 3)) * 0.3, "b1": rng.standard_normal(8) * 0.1,
        "w2": rng.standard_normal((8, 1, 3, 3)) * 0.5, "b2": rng.standard_normal(8) * 0.1,
        "w3": rng.standard_normal((10, 8)) * 0.4, "b3": rng.standard_normal(10) * 0.1,
    }  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], "conv2", pads=[1] * 4, group=8),
        helper.make_node("Relu", ["c2"], ["r2"], "relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], "pool"),
        helper.make_node("Flatten", ["p"], ["f"], "flatten"),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], "fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 10])],
        [numpy_helper.from_array(a.astype(np.float32), k) for k, a in inits.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class _Reader(quantization.CalibrationDataReader):
    def __init__(self, rng: np.random.Generator) -> None:
        self.it = iter([{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32)}
                        for _ in range(16)])  # fmt: skip

    def get_next(self):
        return next(self.it, None)


def _ort_quantized(tmp_path: Path, rng: np.random.Generator, symmetric: bool) -> Path:
    src, dst = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(_float_model(rng), src)
    q = quantization
    q.quantize_static(
        str(src), str(dst), _Reader(rng), quant_format=q.QuantFormat.QDQ, per_channel=True,
        activation_type=q.QuantType.QInt8 if symmetric else q.QuantType.QUInt8,
        weight_type=q.QuantType.QInt8, extra_options={"ActivationSymmetric": symmetric},
    )  # fmt: skip
    return dst


def _ort_run(path: Path, feeds: dict) -> np.ndarray:
    """onnxruntime's run of the Q/DQ model as written: its basic optimizations only (constant
    folding and the like). Its extended ones fuse Q/DQ pairs into integer kernels (QLinearConv,
    QGemm) whose answers, from onnxruntime 1.32 on, are up to tens of quantization steps away
    from the same model run unfused; the model's meaning is the unfused run."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("symmetric", [True, False])
def test_onnxruntime_qdq_models_run_as_onnxruntime_runs_them(tmp_path, symmetric) -> None:
    rng = np.random.default_rng()
    path = _ort_quantized(tmp_path, rng, symmetric)
    engine = Builder("reference").build(path)
    ops = [n.op for n in engine.graph.nodes]
    if symmetric:  # TensorRT's rule: symmetric int8 runs quantized
        assert ops.count("QConvAct") == 2 and ops.count("QGemmAct") == 1
        # the ReLUs moved ahead of their Q/DQ pairs and into the convolutions' epilogues
        assert "Relu" not in ops
        assert all(n.attrs.get("activation") == "Relu" for n in engine.graph.nodes
                   if n.op == "QConvAct")  # fmt: skip
        assert {n.precision for n in engine.graph.nodes if n.op.startswith("Q")} >= {"int8"}
    else:  # uint8 with zero points: run as written, in float
        assert "QConvAct" not in ops and "ConvAct" in ops
    # no weight or bias is dequantized at run time: they are folded or read quantized
    assert not [
        n for n in engine.graph.nodes if n.op == "DequantizeLinear" and n.inputs[0].is_const
    ]
    x = rng.standard_normal((4, 3, 12, 12)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    want = _ort_run(path, {"x": x})
    out_scale = np.abs(want).max() / 127  # (the output is quantized too: one step of it)
    assert np.abs(got - want).max() <= out_scale * 1.01


def _fp8(a: np.ndarray, name: str) -> onnx.TensorProto:
    q = a.astype(ml_dtypes.float8_e4m3fn)
    return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, q.shape, q.view(np.uint8).tobytes(),
                              raw=True)  # fmt: skip


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_weights_quantized_in_the_graph_are_fused(tmp_path, precision) -> None:
    """float32 weight -> QuantizeLinear -> DequantizeLinear -> Conv, as NVIDIA's toolkits export
    (per output channel), with FP8 E4M3 as well as INT8."""
    rng = np.random.default_rng()
    w = (rng.standard_normal((6, 4, 3, 3)) * 0.2).astype(np.float32)
    wmax = {"int8": 127.0, "fp8": 448.0}[precision]
    w_scale = (np.abs(w).reshape(6, -1).max(1) / wmax).astype(np.float32)
    x_scale = np.float32(3.0 / wmax)
    if precision == "int8":
        zero = numpy_helper.from_array(np.int8(0), "zp")
        wzero = numpy_helper.from_array(np.zeros(6, np.int8), "wzp")
    else:
        zero, wzero = _fp8(np.zeros(()), "zp"), _fp8(np.zeros(6), "wzp")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "zp"], ["xd"]),
        helper.make_node("QuantizeLinear", ["w", "ws", "wzp"], ["wq"], axis=0),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wzp"], ["wd"], axis=0),
        helper.make_node("Conv", ["xd", "wd"], ["c"], "conv", pads=[1] * 4),
        helper.make_node("Relu", ["c"], ["y"], "relu"),
    ]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_scale, "ws"),
             numpy_helper.from_array(x_scale, "xs"), zero, wzero]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 7, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    engine = Builder("reference").build(path)
    layers = [(n.op, n.attrs.get("activation", "")) for n in engine.graph.nodes]
    assert layers == [("QuantizeLinear", ""), ("QConvAct", "Relu")]  # Relu fused too
    x = rng.standard_normal((2, 4, 7, 7)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    want = _ort_run(path, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _v(name: str, dtype: DType, shape: tuple, const: np.ndarray | None = None) -> Value:
    return Value(name, TensorType(dtype, shape), const=const)


def test_before_and_expected() -> None:
    """Before: DQ(x_q) and DQ(W_q) into Conv, then Relu. Expected: one QConvAct reading x_q,
    its scale, W_q and W's scales, with the Relu in its epilogue; the DQs are left for dead
    code. A DQ with a non-zero zero point is not fused."""
    rng = np.random.default_rng()
    xq = _v("xq", DType.INT8, (1, 2, 5, 5))
    xs = _v("xs", DType.FLOAT, (), np.float32(0.1))
    wq = _v("wq", DType.INT8, (3, 2, 1, 1), rng.integers(-127, 128, (3, 2, 1, 1)).astype(np.int8))
    ws = _v("ws", DType.FLOAT, (3,), np.full(3, 0.02, np.float32))
    xd, wd = _v("xd", DType.FLOAT, (1, 2, 5, 5)), _v("wd", DType.FLOAT, (3, 2, 1, 1))
    c, y = _v("c", DType.FLOAT, (1, 3, 5, 5)), _v("y", DType.FLOAT, (1, 3, 5, 5))
    graph = Graph(
        inputs=[xq], outputs=[y], initializers=[xs, wq, ws], opsets={"": 21},
        nodes=[
            Node("DequantizeLinear", [xq, xs], [xd]),
            Node("DequantizeLinear", [wq, ws], [wd], {"axis": 0}),
            Node("Conv", [xd, wd], [c], name="conv"),
            Node("Relu", [c], [y], name="relu"),
        ],
    )  # fmt: skip
    assert fuse_quantized(graph) == 1 and fuse_conv_act(graph) == 1
    (fused,) = [n for n in graph.nodes if n.op == "QConvAct"]
    assert fused.inputs == [xq, xs, wq, ws] and fused.outputs == [y]
    assert fused.attrs["activation"] == "Relu" and fused.name == "conv"

    zp = _v("zp", DType.INT8, (), np.int8(3))
    graph.initializers.append(zp)
    other = Graph(
        inputs=[xq], outputs=[c], initializers=[xs, wq, ws, zp], opsets={"": 21},
        nodes=[Node("DequantizeLinear", [xq, xs, zp], [xd]),
               Node("DequantizeLinear", [wq, ws], [wd], {"axis": 0}),
               Node("Conv", [xd, wd], [c], name="conv")],
    )  # fmt: skip
    assert fuse_quantized(other) == 0


def _run_graph(graph: Graph, feeds: dict) -> list:
    from tensorkiln.backends import get_backend
    from tensorkiln.runtime.executor import Executor

    ex = Executor(graph, get_backend("reference"))
    return ex.run({v: feeds[v.name] for v in graph.inputs})


def test_propagation_moves_relu_ahead_and_drops_same_scale_requantization() -> None:
    """Before: y -> Q(s) -> DQ(s) -> Relu -> Q(s) -> out (int8). Expected: y -> Relu -> Q(s) ->
    out, the DQ -> Q pair gone; the same integers on fresh data (and with the second scale
    different, the requantization stays)."""
    import copy

    from tensorkiln.passes.cleanup import dead_code
    from tensorkiln.passes.fuse_qdq import propagate_qdq

    rng = np.random.default_rng()
    for s2 in (0.05, 0.07):
        y = _v("y", DType.FLOAT, (4, 64))
        s, t = _v("s", DType.FLOAT, (), np.float32(0.05)), _v("t", DType.FLOAT, (), np.float32(s2))
        zp = _v("zp", DType.INT8, (), np.int8(0))
        q1, d1 = _v("q1", DType.INT8, (4, 64)), _v("d1", DType.FLOAT, (4, 64))
        r, out = _v("r", DType.FLOAT, (4, 64)), _v("out", DType.INT8, (4, 64))
        graph = Graph(
            inputs=[y], outputs=[out], initializers=[s, t, zp], opsets={"": 21},
            nodes=[Node("QuantizeLinear", [y, s, zp], [q1], name="q1"),
                   Node("DequantizeLinear", [q1, s, zp], [d1], name="d1"),
                   Node("Relu", [d1], [r], name="relu"),
                   Node("QuantizeLinear", [r, t, zp], [out], name="q2")],
        )  # fmt: skip
        before = copy.deepcopy(graph)
        changed, step = 0, 1
        while step:  # (to the fixed point, as the PassManager runs it)
            step = propagate_qdq(graph)
            changed += step
        dead_code(graph)
        ops = [n.op for n in graph.nodes]
        if s2 == 0.05:
            assert changed == 2 and ops == ["Relu", "QuantizeLinear"], ops
        else:
            assert changed == 1 and ops == ["Relu", "QuantizeLinear", "DequantizeLinear",
                                            "QuantizeLinear"], ops  # fmt: skip
        x = (rng.standard_normal((4, 64)) * 3).astype(np.float32)
        np.testing.assert_array_equal(_run_graph(graph, {"y": x})[0],
                                      _run_graph(before, {"y": x})[0])  # fmt: skip


def _qconv_operands(rng, side: int) -> tuple[Value, ...]:
    """A QConvAct's X_q (2 x 4 x side x side int8 input), X_scale, W_q (6 x 4 x 3 x 3), W_scale
    per channel and bias."""
    w = rng.integers(-127, 128, (6, 4, 3, 3)).astype(np.int8)
    return (
        _v("xq", DType.INT8, (2, 4, side, side)),
        _v("xs", DType.FLOAT, (), np.float32(0.1)),
        _v("wq", DType.INT8, (6, 4, 3, 3), w),
        _v("ws", DType.FLOAT, (6,), rng.uniform(0.01, 0.03, 6).astype(np.float32)),
        _v("b", DType.FLOAT, (6,), rng.standard_normal(6).astype(np.float32)),
    )


def _requant_graph(rng, kind: DType, *, zp_value=0, extra_reader=False, per_axis=False):
    """x_q -> QConvAct (ReLU) -> QuantizeLinear(t) -> out (8-bit), optionally with a second
    reader of the float result, a non-zero zero point or a per-channel output scale."""
    np_t = np.int8 if kind == DType.INT8 else ml_dtypes.float8_e4m3fn
    xq, xs, wq, ws, b = _qconv_operands(rng, 5)
    t_data = rng.uniform(0.08, 0.15, 6 if per_axis else ()).astype(np.float32)
    t = _v("t", DType.FLOAT, t_data.shape, t_data)
    zp = _v("zp", kind, (), np.array(zp_value).astype(np_t))
    y, out = _v("y", DType.FLOAT, (2, 6, 5, 5)), _v("out", kind, (2, 6, 5, 5))
    layer = Node("QConvAct", [xq, xs, wq, ws, b], [y], {"pads": [1, 1, 1, 1],
                 "activation": "Relu"}, domain="tensorkiln", name="conv")  # fmt: skip
    q = Node("QuantizeLinear", [y, t, zp], [out], {"axis": 1}, name="q")
    outputs = [out, y] if extra_reader else [out]
    return Graph(inputs=[xq], outputs=outputs, initializers=[xs, wq, ws, b, t, zp],
                 opsets={"": 21, "tensorkiln": 1}, nodes=[layer, q])  # fmt: skip


@pytest.mark.parametrize("kind", [DType.INT8, DType.FLOAT8E4M3FN])
def test_requantization_moves_into_the_layer(kind) -> None:
    """Before: QConvAct -> QuantizeLinear. Expected: one QConvAct with Y_scale (input 6) and an
    8-bit out_dtype writing the Q's output; the same codes on fresh data (the reference computes
    both from the same float32 result). Not fused: a second reader of the float result, a
    non-zero zero point, a per-channel output scale."""
    import copy

    from tensorkiln.passes.fuse_qdq import fuse_requantize

    rng = np.random.default_rng()
    graph = _requant_graph(rng, kind)
    before = copy.deepcopy(graph)
    assert fuse_requantize(graph) == 1
    (fused,) = graph.nodes
    assert fused.op == "QConvAct" and fused.name == "conv" and len(fused.inputs) == 7
    assert fused.inputs[5] is None and fused.inputs[6].name == "t"
    assert fused.attrs["out_dtype"] == (3 if kind == DType.INT8 else 17)
    assert fused.outputs[0].name == "out"
    x = rng.integers(-15, 16, (2, 4, 5, 5)).astype(np.int8)  # (outputs mostly inside the range)
    got, want = _run_graph(graph, {"xq": x})[0], _run_graph(before, {"xq": x})[0]
    assert got.dtype == want.dtype and len(np.unique(want)) > 8
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))

    for other in (
        _requant_graph(rng, kind, extra_reader=True),
        _requant_graph(rng, kind, zp_value=3 if kind == DType.INT8 else 1.0),
        _requant_graph(rng, kind, per_axis=True),
    ):
        assert fuse_requantize(other) == 0


def test_pytorch_fake_quantized_export_runs_quantized(tmp_path) -> None:
    """PyTorch's quantization export (fake-quantized activations per tensor and weights per
    channel, TorchScript exporter): Q/DQ pairs around Conv, ReLU, a Flatten and a Gemm. Every
    layer runs quantized, the DequantizeLinear moved past the Flatten (dq_through_data_movement),
    and the outputs are onnxruntime's but where an activation sits on a rounding edge (exact
    integer sums here, float32 sums there: one step of one activation apart at most)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    torch.manual_seed(int(rng.integers(1 << 30)))

    def fq(t, scale):  # (per tensor, int8)
        return torch.fake_quantize_per_tensor_affine(t, scale, 0, -128, 127)

    def scales(w):  # (per output channel, held as a buffer as FakeQuantize modules hold it)
        return (w.detach().abs().reshape(w.shape[0], -1).amax(1) / 127).float()

    def fq_channels(w, scale):
        zero = torch.zeros(w.shape[0], dtype=torch.int32)
        return torch.fake_quantize_per_channel_affine(w, scale, zero, 0, -128, 127)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.fc = torch.nn.Linear(8 * 6 * 6, 10)
            self.register_buffer("conv_scale", scales(self.conv.weight))
            self.register_buffer("fc_scale", scales(self.fc.weight))

        def forward(self, x):
            x = fq(x, 0.05)
            w = fq_channels(self.conv.weight, self.conv_scale)
            y = torch.relu(torch.nn.functional.conv2d(x, w, self.conv.bias, padding=1))
            y = fq(y, 0.05).flatten(1)
            w2 = fq_channels(self.fc.weight, self.fc_scale)
            return torch.nn.functional.linear(y, w2, self.fc.bias)

    net = Net().eval()
    path = tmp_path / "fq.onnx"
    with torch.no_grad():
        torch.onnx.export(net, (torch.randn(16, 3, 6, 6),), str(path), opset_version=17,
                          dynamo=False, input_names=["x"], output_names=["y"])  # fmt: skip
    engine = Builder("reference").build(path)
    ops = [n.op for n in engine.graph.nodes]
    assert ops == ["QuantizeLinear", "QConvAct", "Flatten", "QGemmAct"], ops
    x = rng.standard_normal((16, 3, 6, 6)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    want = _ort_run(path, {"x": x})
    w_step = float(net.fc.weight.detach().abs().max()) * 0.05  # one activation step's worth
    diff = np.abs(got - want)
    assert diff.max() <= 2 * w_step + 1e-5
    # most samples have no activation on an edge: their outputs agree to float32 rounding
    assert (diff.max(axis=1) <= 1e-5).mean() >= 0.5


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_residual_read_through_dequantize_is_read_quantized(tmp_path, precision) -> None:
    """Before: Conv(DQ(x_q), DQ(W_q)) + DQ(r_q) -> Relu, as Model Optimizer writes a residual
    block. Expected: one QConvAct reading r_q with r's scale (Z_scale) and no DequantizeLinear
    layer left; the same result as onnxruntime's reference run."""
    rng = np.random.default_rng()
    wmax = {"int8": 127.0, "fp8": 448.0}[precision]
    w = (rng.standard_normal((6, 4, 3, 3)) * 0.2).astype(np.float32)
    w_scale = (np.abs(w).reshape(6, -1).max(1) / wmax).astype(np.float32)
    if precision == "int8":
        zeros = [numpy_helper.from_array(np.int8(0), "zp"),
                 numpy_helper.from_array(np.zeros(6, np.int8), "wzp")]  # fmt: skip
    else:
        zeros = [_fp8(np.zeros(()), "zp"), _fp8(np.zeros(6), "wzp")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "zp"], ["xd"]),
        helper.make_node("QuantizeLinear", ["w", "ws", "wzp"], ["wq"], axis=0),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wzp"], ["wd"], axis=0),
        helper.make_node("QuantizeLinear", ["r", "rs", "zp"], ["rq"]),
        helper.make_node("DequantizeLinear", ["rq", "rs", "zp"], ["rd"]),
        helper.make_node("Conv", ["xd", "wd"], ["c"], "conv", pads=[1] * 4),
        helper.make_node("Add", ["c", "rd"], ["s"], "residual"),
        helper.make_node("Relu", ["s"], ["y"], "relu"),
    ]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_scale, "ws"),
             numpy_helper.from_array(np.float32(3.0 / wmax), "xs"),
             numpy_helper.from_array(np.float32(2.0 / wmax), "rs"), *zeros]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 7, 7]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 6, 7, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    engine = Builder("reference").build(path)
    ops = [n.op for n in engine.graph.nodes]
    assert "DequantizeLinear" not in ops and ops.count("QConvAct") == 1
    (layer,) = [n for n in engine.graph.nodes if n.op == "QConvAct"]
    assert len(layer.inputs) == 8 and layer.inputs[5].dtype.name in ("INT8", "FLOAT8E4M3FN")
    assert layer.attrs["activation"] == "Relu"
    feeds = {"x": rng.standard_normal((2, 4, 7, 7)).astype(np.float32),
             "r": rng.standard_normal((2, 6, 7, 7)).astype(np.float32)}  # fmt: skip
    got = engine.create_execution_context().infer(feeds)["y"]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_growing_a_qconvact_keeps_its_residual_scale() -> None:
    """A QConvAct that reads a quantized residual (Z_scale) and is followed by a Relu: the
    grown layer keeps Z_scale with its residual (dropping it would read the codes as values)."""
    rng = np.random.default_rng()
    xq = _v("xq", DType.INT8, (1, 2, 5, 5))
    zq = _v("zq", DType.INT8, (1, 3, 5, 5))
    xs = _v("xs", DType.FLOAT, (), np.float32(0.1))
    zs = _v("zs", DType.FLOAT, (), np.float32(0.05))
    wq = _v("wq", DType.INT8, (3, 2, 1, 1), rng.integers(-127, 128, (3, 2, 1, 1)).astype(np.int8))
    ws = _v("ws", DType.FLOAT, (3,), np.full(3, 0.02, np.float32))
    c, y = _v("c", DType.FLOAT, (1, 3, 5, 5)), _v("y", DType.FLOAT, (1, 3, 5, 5))
    layer = Node("QConvAct", [xq, xs, wq, ws, None, zq, None, zs], [c], domain="tensorkiln",
                 name="conv")  # fmt: skip
    graph = Graph(
        inputs=[xq, zq], outputs=[y], initializers=[xs, zs, wq, ws], opsets={"": 21,
        "tensorkiln": 1}, nodes=[layer, Node("Relu", [c], [y], name="relu")],
    )  # fmt: skip
    feeds = {"xq": rng.integers(-127, 128, (1, 2, 5, 5)).astype(np.int8),
             "zq": rng.integers(-127, 128, (1, 3, 5, 5)).astype(np.int8)}  # fmt: skip
    want = _run_graph(graph, feeds)[0]
    assert fuse_conv_act(graph) == 1
    (grown,) = graph.nodes
    assert grown.inputs[5] is zq and grown.inputs[7] is zs and grown.attrs["activation"] == "Relu"
    np.testing.assert_array_equal(_run_graph(graph, feeds)[0], want)


def _pooled_graph(rng, kind: DType, *, extra_reader: bool = False) -> Graph:
    """x_q -> QConvAct (ReLU) -> y -> MaxPool 3x3/2 -> m -> QuantizeLinear(t) -> out (8-bit),
    optionally with y an output too."""
    np_t = np.int8 if kind == DType.INT8 else ml_dtypes.float8_e4m3fn
    xq, xs, wq, ws, b = _qconv_operands(rng, 9)
    t = _v("t", DType.FLOAT, (), np.float32(rng.uniform(0.08, 0.15)))
    zp = _v("zp", kind, (), np.array(0).astype(np_t))
    y, m = _v("y", DType.FLOAT, (2, 6, 9, 9)), _v("m", DType.FLOAT, (2, 6, 5, 5))
    out = _v("out", kind, (2, 6, 5, 5))
    layer = Node("QConvAct", [xq, xs, wq, ws, b], [y], {"pads": [1, 1, 1, 1],
                 "activation": "Relu"}, domain="tensorkiln", name="conv")  # fmt: skip
    pool = Node("MaxPool", [y], [m], {"kernel_shape": [3, 3], "strides": [2, 2],
                "pads": [1, 1, 1, 1]}, name="pool")  # fmt: skip
    q = Node("QuantizeLinear", [m, t, zp], [out], name="q")
    return Graph(inputs=[xq], outputs=[out, y] if extra_reader else [out],
                 initializers=[xs, wq, ws, b, t, zp], opsets={"": 21, "tensorkiln": 1},
                 nodes=[layer, pool, q])  # fmt: skip


@pytest.mark.parametrize("kind", [DType.INT8, DType.FLOAT8E4M3FN])
def test_quantization_moves_ahead_of_a_max_pool_into_the_layer(kind) -> None:
    """Before: QConvAct -> MaxPool -> QuantizeLinear. Expected: the QConvAct writes its output
    quantized (Y_scale = the Q's scale) and the pool pools the 8-bit codes into the Q's output:
    the same codes, bit for bit, on fresh data. Not moved: a second reader of the float
    result (the Q would then run on its own, on four times the values)."""
    import copy

    from tensorkiln.passes.fuse_qdq import fuse_requantize

    rng = np.random.default_rng()
    graph = _pooled_graph(rng, kind)
    before = copy.deepcopy(graph)
    changed = step = fuse_requantize(graph)
    while step:  # (to the fixed point, as the PassManager runs it)
        step = fuse_requantize(graph)
        changed += step
    assert changed == 2  # (the Q moved ahead of the pool, then into the layer)
    layer, pool = graph.nodes
    assert layer.op == "QConvAct" and layer.inputs[6].name == "t"
    assert pool.op == "MaxPool" and pool.inputs[0] is layer.outputs[0]
    assert pool.inputs[0].dtype == kind and pool.outputs[0].name == "out"
    x = rng.integers(-15, 16, (2, 4, 9, 9)).astype(np.int8)
    got, want = _run_graph(graph, {"xq": x})[0], _run_graph(before, {"xq": x})[0]
    assert got.dtype == want.dtype and len(np.unique(want)) > 8
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert fuse_requantize(_pooled_graph(rng, kind, extra_reader=True)) == 0


def _stem_graph(rng, kind: DType, *, activation_node: bool = True, **change) -> Graph:
    """:func:`_pooled_graph` with the ReLU as a node of its own after the QConvAct (as a
    quantized model has it before fuse_conv_act), and ``change`` applied to the pool's
    attributes or (``activation``) the layer's."""
    graph = _pooled_graph(rng, kind)
    layer, pool, _ = graph.nodes
    act = change.pop("activation", "Relu")
    pool.attrs.update(change)
    if activation_node:
        layer.attrs.pop("activation")
        y = layer.outputs[0]
        c = _v("c", DType.FLOAT, (2, 6, 9, 9))
        layer.outputs[0] = c
        graph.nodes.insert(1, Node(act, [c], [y], name="act"))
    else:
        layer.attrs["activation"] = act
    return graph


@pytest.mark.parametrize("kind", [DType.INT8, DType.FLOAT8E4M3FN])
def test_a_stem_and_its_pool_become_one_layer_on_cuda(kind) -> None:
    """Before: QConvAct (4 channels in, 3 x 3) -> Relu -> MaxPool 3x3/2 padded by 1 ->
    QuantizeLinear. Expected, from the cuda backend's passes: one QConvPool writing the Q's
    output, the ReLU and the quantization in its epilogue, the pool's attributes carried; the
    same codes, bit for bit, as the graph before, on fresh data (the reference kernels run
    both). The reference backend's passes keep the pool apart."""
    import copy

    from tensorkiln.passes import PassManager

    rng = np.random.default_rng()
    graph = _stem_graph(rng, kind)
    before = copy.deepcopy(graph)
    PassManager(level=3, backend="cuda", verify=True).run(graph)
    (layer,) = graph.nodes
    assert (layer.domain, layer.op) == ("tensorkiln", "QConvPool")
    assert layer.name == "conv" and layer.outputs[0].name == "out"
    assert layer.inputs[6].name == "t" and layer.attrs["activation"] == "Relu"
    assert list(layer.attrs["pool_kernel_shape"]) == [3, 3]
    assert list(layer.attrs["pool_strides"]) == [2, 2]
    assert layer.outputs[0].dtype == kind and layer.outputs[0].shape == (2, 6, 5, 5)
    x = rng.integers(-15, 16, (2, 4, 9, 9)).astype(np.int8)
    got, want = _run_graph(graph, {"xq": x})[0], _run_graph(before, {"xq": x})[0]
    assert got.dtype == want.dtype and len(np.unique(want)) > 8
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))

    reference = _stem_graph(rng, kind)
    PassManager(level=3, backend="reference").run(reference)
    assert [n.op for n in reference.nodes] == ["QConvAct", "MaxPool"]


@pytest.mark.parametrize(
    "change",
    [
        {"activation": "Sigmoid"},  # (values below 0: the pool's padding is not zero)
        {"kernel_shape": [2, 2]},
        {"strides": [1, 1]},
        {"pads": [0, 0, 0, 0]},
        {"ceil_mode": 1},
        {"dilations": [2, 2]},
    ],
)
def test_a_pool_a_stem_kernel_does_not_take_stays_apart(change) -> None:
    from tensorkiln.passes.fuse_qdq import fuse_requantize, fuse_stem_pool

    graph = _stem_graph(np.random.default_rng(), DType.INT8, activation_node=False, **change)
    while fuse_requantize(graph):
        pass
    assert fuse_stem_pool(graph) == 0
    assert [n.op for n in graph.nodes] == ["QConvAct", "MaxPool"]


def test_a_stem_pool_is_not_fused_past_a_second_reader_or_a_wide_image() -> None:
    """The convolution's output read by more than the pool, or an image of more channels than
    the stem kernel packs (a QConvAct of 5 channels), keep the layers apart."""
    from tensorkiln.passes.fuse_qdq import fuse_requantize, fuse_stem_pool

    rng = np.random.default_rng()
    graph = _pooled_graph(rng, DType.INT8, extra_reader=True)
    assert fuse_stem_pool(graph) == 0
    wide = _pooled_graph(rng, DType.INT8)
    layer = wide.nodes[0]
    w = rng.integers(-127, 128, (6, 5, 3, 3)).astype(np.int8)
    layer.inputs[0] = _v("xq5", DType.INT8, (2, 5, 9, 9))
    layer.inputs[2] = _v("wq5", DType.INT8, w.shape, w)
    wide.inputs = [layer.inputs[0]]
    wide.initializers.append(layer.inputs[2])
    while fuse_requantize(wide):
        pass
    assert fuse_stem_pool(wide) == 0
