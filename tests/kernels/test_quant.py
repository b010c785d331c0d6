"""The quantization reference kernels against onnxruntime on fresh random inputs.

onnxruntime's Python API cannot feed or return int4/float8 arrays, so those targets are checked
through a QuantizeLinear -> DequantizeLinear chain (zero point as an initializer, float32 out).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.kernels.ort_oracle import check_against_ort, one_node_model, run_kernel, run_ort

INT_TARGETS = [np.uint8, np.int8, np.uint16, np.int16]


def _rng():
    return np.random.default_rng()


def _x(shape, spread=300.0):
    # Mostly random, plus exact ties at half a quantization step (scale 0.5 -> x = 0.25 * odd)
    # so that round-half-to-even is exercised.
    x = _rng().uniform(-spread, spread, size=shape).astype(np.float32)
    flat = x.reshape(-1)
    ties = _rng().integers(-40, 40, size=flat.size // 3) * 2 + 1
    flat[: ties.size] = 0.25 * ties
    return x


def _zp(dtype, shape=()):
    info = np.iinfo(dtype)
    return _rng().integers(info.min // 4, info.max // 4 + 1, size=shape).astype(dtype)


@pytest.mark.parametrize("dtype", INT_TARGETS)
def test_quantize_per_tensor(dtype):
    inputs = {"x": _x((3, 17)), "s": np.array(0.5, np.float32), "zp": _zp(dtype)}
    check_against_ort("QuantizeLinear", inputs, opset=21)


def test_quantize_default_uint8_without_zero_point():
    inputs = {"x": _x((5, 4), 40.0), "s": np.array(0.5, np.float32)}
    check_against_ort("QuantizeLinear", inputs, opset=13)


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_quantize_per_axis(axis, dtype):
    x = _x((3, 4, 5))
    n = x.shape[axis]
    s = _rng().uniform(0.2, 2.0, size=n).astype(np.float32)
    inputs = {"x": x, "s": s, "zp": _zp(dtype, (n,))}
    check_against_ort("QuantizeLinear", inputs, {"axis": axis}, opset=13)


@pytest.mark.parametrize("block_size", [2, 4])
@pytest.mark.parametrize("axis", [0, 1])
def test_quantize_blocked(block_size, axis):
    x = _x((6, 6))
    sshape = [6, 6]
    sshape[axis] = -(-6 // block_size)
    s = _rng().uniform(0.2, 2.0, size=sshape).astype(np.float32)
    inputs = {"x": x, "s": s, "zp": _zp(np.int8, sshape)}
    attrs = {"axis": axis, "block_size": block_size}
    check_against_ort("QuantizeLinear", inputs, attrs, opset=21)


@pytest.mark.parametrize("dtype", [*INT_TARGETS, np.int32])
@pytest.mark.parametrize("granularity", ["tensor", "axis"])
def test_dequantize(dtype, granularity):
    info = np.iinfo(dtype)
    lo, hi = max(info.min, -(2**20)), min(info.max, 2**20)
    x = _rng().integers(lo, hi, size=(4, 5)).astype(dtype)
    shape = () if granularity == "tensor" else (5,)
    s = _rng().uniform(0.01, 2.0, size=shape).astype(np.float32)
    inputs = {"x": x, "s": s}
    if dtype != np.int32:
        inputs["zp"] = _zp(dtype, shape)
    check_against_ort("DequantizeLinear", inputs, {"axis": 1}, opset=21)


def test_dequantize_blocked():
    x = _rng().integers(-128, 128, size=(4, 7)).astype(np.int8)
    s = _rng().uniform(0.01, 2.0, size=(4, 3)).astype(np.float32)
    inputs = {"x": x, "s": s, "zp": _zp(np.int8, (4, 3))}
    check_against_ort("DequantizeLinear", inputs, {"axis": 1, "block_size": 3}, opset=21)


def _q_dq_model(zp: np.ndarray, attrs: dict, opset: int) -> onnx.ModelProto:
    q_attrs = dict(attrs)
    dq_attrs = {k: v for k, v in attrs.items() if k != "saturate"}
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], **q_attrs),
        helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], **dq_attrs),
    ]
    graph = helper.make_graph(
        nodes,
        "q_dq",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(zp, "zp")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


@pytest.mark.parametrize(
    "dtype,saturate",
    [
        (ml_dtypes.int4, None),
        (ml_dtypes.uint4, None),
        (ml_dtypes.float8_e4m3fn, 1),
        (ml_dtypes.float8_e4m3fn, 0),
        (ml_dtypes.float8_e5m2, 1),
        (ml_dtypes.float8_e5m2, 0),
    ],
)
def test_narrow_targets_round_trip(dtype, saturate):
    # Wide enough to overflow every float8 target; scale 0.5 so int4 sees both ranges and ties.
    x = _x((4, 8), spread=6.0)
    x[0, :4] = [1e5, -1e5, 300.0, -500.0]
    s = np.array(0.5, np.float32)
    zp = np.zeros((), dtype)
    attrs = {} if saturate is None else {"saturate": saturate}
    (want,) = run_ort(_q_dq_model(zp, attrs, 21), {"x": x, "s": s})
    (q,) = run_kernel("QuantizeLinear", {"x": x, "s": s, "zp": zp}, attrs, opset=21)
    assert q.dtype == np.dtype(dtype)
    (got,) = run_kernel("DequantizeLinear", {"q": q, "s": s, "zp": zp}, opset=21)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["mixed", "positive", "negative"])
def test_dynamic_quantize_linear(kind):
    x = _rng().uniform(-4, 7, size=(3, 9)).astype(np.float32)
    if kind == "positive":
        x = np.abs(x) + 0.5
    elif kind == "negative":
        x = -np.abs(x) - 0.5
    check_against_ort("DynamicQuantizeLinear", {"x": x}, n_outputs=3, opset=11)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("shapes", [((3, 8), (8, 5)), ((2, 3, 8), (2, 8, 5)), ((2, 3, 8), (8, 4))])
def test_qlinear_matmul(dtype, shapes):
    info = np.iinfo(dtype)
    a = _rng().integers(info.min, info.max + 1, size=shapes[0]).astype(dtype)
    b = _rng().integers(info.min, info.max + 1, size=shapes[1]).astype(dtype)

    def scale():
        return np.array(_rng().uniform(0.005, 0.05), np.float32)

    inputs = {
        "a": a,
        "a_scale": scale(),
        "a_zero_point": _zp(dtype),
        "b": b,
        "b_scale": scale(),
        "b_zero_point": _zp(dtype),
        "y_scale": np.array(_rng().uniform(0.5, 2.0), np.float32),
        "y_zero_point": _zp(dtype),
    }
    (want,) = run_ort(one_node_model("QLinearMatMul", inputs, opset=21), inputs)
    (got,) = run_kernel("QLinearMatMul", inputs, opset=21)
    assert got.dtype == want.dtype and got.shape == want.shape
    # onnxruntime rescales in float32, this kernel in float64: a product within a float32 ulp
    # of a rounding tie may land one step apart. Anything more is a bug.
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max() <= 1 and np.count_nonzero(diff) <= max(1, diff.size // 100)
