"""Cast, CastLike and BitCast reference kernels against onnxruntime on fresh random inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto

from tests.kernels.ort_oracle import check_against_ort, one_node_model, run_kernel, run_ort

NUMERIC = {
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.FLOAT16: np.float16,
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT32: np.int32,
    TensorProto.INT64: np.int64,
    TensorProto.BOOL: np.bool_,
}


def _rand(shape, dtype):
    rng = np.random.default_rng()
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape).astype(dtype)
    x = rng.uniform(-100, 100, size=shape)
    x[..., 0] = 0.0  # a zero for the bool targets
    return x.astype(dtype)


@pytest.mark.parametrize("src", list(NUMERIC), ids=[TensorProto.DataType.Name(t) for t in NUMERIC])
@pytest.mark.parametrize("dst", list(NUMERIC), ids=[TensorProto.DataType.Name(t) for t in NUMERIC])
def test_cast_numeric(src, dst):
    x = _rand((3, 7), NUMERIC[src])
    if np.dtype(NUMERIC[src]).kind == "f" and np.dtype(NUMERIC[dst]).kind == "u":
        x = np.abs(x)  # negative floats to unsigned are undefined behaviour
    if NUMERIC[src] == np.float64 and NUMERIC[dst] == np.float16:
        # onnxruntime rounds double to float16 through float32 (twice), the kernel once; values
        # that float32 holds exactly round the same both ways (about one draw in 1,500 did not)
        x = x.astype(np.float32).astype(np.float64)
    check_against_ort("Cast", {"X": x}, {"to": dst}, opset=21, rtol=0, atol=0)


def test_cast_int_wraps_on_overflow():
    x = _rand((40,), np.int32) * 97
    check_against_ort("Cast", {"X": x}, {"to": TensorProto.INT8}, opset=21)
    check_against_ort("Cast", {"X": x}, {"to": TensorProto.UINT16}, opset=21)


def test_cast_float_truncates_toward_zero():
    x = np.random.default_rng().uniform(-50, 50, size=(64,)).astype(np.float32)
    check_against_ort("Cast", {"X": x}, {"to": TensorProto.INT32}, opset=21)


@pytest.mark.parametrize("saturate", [0, 1])
def test_cast_to_float8e4m3fn(saturate):
    rng = np.random.default_rng()
    x = (rng.standard_normal(64) * np.exp2(rng.integers(-12, 12, size=64))).astype(np.float32)
    # Without saturation onnxruntime maps [480, 496) to 448 but (464, 480) to NaN; the spec (and
    # ONNX's reference) overflow everything above 464. Keep random values out of that band.
    band = (np.abs(x) > 448) & (np.abs(x) < 512)
    x[band] = np.copysign(300.0, x[band])
    x[:6] = [np.inf, -np.inf, np.nan, 520.0, -1e6, -0.0]
    attrs = {"to": TensorProto.FLOAT8E4M3FN, "saturate": saturate}
    # onnxruntime hands float8 results back as their raw bytes
    (expected,) = run_ort(one_node_model("Cast", {"X": x}, attrs, opset=21), {"X": x})
    (got,) = run_kernel("Cast", {"X": x}, attrs, opset=21)
    assert got.dtype == ml_dtypes.float8_e4m3fn
    exp_bits = expected.view(np.uint8)
    nan = np.isnan(got.astype(np.float32))
    np.testing.assert_array_equal(nan, (exp_bits & 0x7F) == 0x7F)
    np.testing.assert_array_equal(got.view(np.uint8)[~nan], exp_bits[~nan])


def test_cast_float8e4m3fn_overflow_without_saturation_follows_the_spec():
    """Values past 464 (the midpoint above the largest finite 448) overflow to NaN; 464 itself
    rounds to even, i.e. to 448."""
    x = np.array([447.0, 455.0, 464.0, 465.0, 470.0, 480.0, 490.0, -470.0], np.float32)
    (got,) = run_kernel("Cast", {"X": x}, {"to": TensorProto.FLOAT8E4M3FN, "saturate": 0}, opset=21)
    as_f32 = got.astype(np.float32)
    np.testing.assert_array_equal(as_f32[:3], [448.0, 448.0, 448.0])
    assert np.isnan(as_f32[3:]).all()


def test_cast_float8_roundtrip_through_float32():
    x = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e5m2)
    (y,) = run_kernel("Cast", {"X": x}, {"to": TensorProto.FLOAT}, opset=21)
    (back,) = run_kernel("Cast", {"X": y}, {"to": TensorProto.FLOAT8E5M2, "saturate": 0}, opset=21)
    finite = np.isfinite(y)
    np.testing.assert_array_equal(back.view(np.uint8)[finite], x.view(np.uint8)[finite])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32, np.bool_])
def test_cast_to_string(dtype):
    rng = np.random.default_rng()
    x = _rand((4, 5), dtype)
    if np.dtype(dtype).kind == "f":
        x = (x * 10.0 ** rng.integers(-9, 9, size=x.shape)).astype(dtype)
        x.flat[:3] = [np.inf, -np.inf, np.nan]
    check_against_ort("Cast", {"X": x}, {"to": TensorProto.STRING}, opset=21)


@pytest.mark.parametrize("to", [TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64])
def test_cast_from_string(to):
    rng = np.random.default_rng()
    if to == TensorProto.INT64:
        words = [str(v) for v in rng.integers(-(2**62), 2**62, size=12)]
    else:
        words = [repr(float(v)) for v in rng.standard_normal(8) * 1e4]
        words += ["INF", "-inf", "+INF", "NaN", "1e-5", "3E8"]
    x = np.array(words, dtype=object).reshape(2, -1)
    check_against_ort("Cast", {"X": x}, {"to": to}, opset=21, rtol=0, atol=0)


def test_cast_opset1_type_name():
    x = _rand((5,), np.float32)
    (y,) = run_kernel("Cast", {"X": x}, {"to": "INT32"}, opset=1)
    np.testing.assert_array_equal(y, np.trunc(x).astype(np.int64))
    assert y.dtype == np.int32


@pytest.mark.parametrize("target", [np.float16, np.int64, np.float64, np.uint8])
def test_castlike(target):
    x = np.abs(_rand((3, 4), np.float32))
    like = np.zeros((2,), dtype=target) + 1
    check_against_ort("CastLike", {"X": x, "T": like}, opset=21, rtol=0, atol=0)


def test_bitcast_known_patterns():
    x = np.array([[1.0, -2.0], [0.0, np.inf]], dtype=np.float32)
    (y,) = run_kernel("BitCast", {"X": x}, {"to": TensorProto.INT32}, opset=26)
    np.testing.assert_array_equal(y, [[0x3F800000, -0x40000000], [0, 0x7F800000]])
    assert y.dtype == np.int32 and y.shape == (2, 2)
    s = np.array(-1, dtype=np.int16)
    (u,) = run_kernel("BitCast", {"X": s}, {"to": TensorProto.UINT16}, opset=26)
    assert u.shape == () and u.dtype == np.uint16 and u == 0xFFFF
    i4 = np.array([-1, 7, -8], dtype=ml_dtypes.int4)
    (u4,) = run_kernel("BitCast", {"X": i4}, {"to": TensorProto.UINT4}, opset=26)
    np.testing.assert_array_equal(u4.astype(np.int32), [15, 7, 8])
    with pytest.raises(ValueError, match="bit width"):
        run_kernel("BitCast", {"X": x}, {"to": TensorProto.INT64}, opset=26)
