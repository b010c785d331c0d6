"""The elementwise reference kernels against onnxruntime (and math.erf) on fresh random inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.kernels.ort_oracle import check_against_ort, one_node_model, run_kernel, run_ort

TOL = {
    np.float16: {"rtol": 2e-3, "atol": 2e-3},
    np.float32: {"rtol": 1e-5, "atol": 1e-6},
    np.float64: {"rtol": 1e-12, "atol": 1e-12},
}


def check_float64_via_float32(op: str, x: np.ndarray, attrs=None, opset: int = 21) -> None:
    """For ops onnxruntime has no double kernel for: the float64 kernel against ORT's float32."""
    x32 = x.astype(np.float32)
    (expected,) = run_ort(one_node_model(op, {"X": x32}, attrs, opset=opset), {"X": x32})
    (got,) = run_kernel(op, {"X": x}, attrs, opset=opset)
    assert got.dtype == np.float64 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-6, err_msg=op)


def _rand(shape, dtype=np.float32, low=-3.0, high=3.0):
    rng = np.random.default_rng()
    if np.dtype(dtype).kind in "iu":
        return rng.integers(low, high, size=shape, endpoint=True).astype(dtype)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.uniform(low, high, size=shape).astype(dtype)


# (op, low, high, opset) covering each op's domain
UNARY = [
    ("Abs", -3, 3, 13),
    ("Acos", -0.99, 0.99, 22),
    ("Acosh", 1.01, 5, 22),
    ("Asin", -0.99, 0.99, 22),
    ("Asinh", -5, 5, 22),
    ("Atan", -5, 5, 22),
    ("Atanh", -0.99, 0.99, 22),
    ("Ceil", -5, 5, 13),
    ("Cos", -5, 5, 22),
    ("Cosh", -5, 5, 22),
    ("Exp", -10, 10, 13),
    ("Floor", -5, 5, 13),
    ("Log", 0.01, 100, 13),
    ("Neg", -5, 5, 13),
    ("Reciprocal", 0.1, 5, 13),
    ("Round", -5, 5, 22),
    ("Sign", -5, 5, 13),
    ("Sin", -5, 5, 22),
    ("Sinh", -5, 5, 22),
    ("Sqrt", 0, 100, 13),
    ("Tan", -1.5, 1.5, 22),
    ("Tanh", -10, 10, 13),
    ("Erf", -5, 5, 13),
    ("Sigmoid", -30, 30, 13),
    ("Softplus", -30, 30, 22),
    ("Softsign", -10, 10, 22),
    ("HardSwish", -8, 8, 22),
    ("Mish", -10, 10, 22),
    ("Relu", -5, 5, 14),
]


ORT_HAS_DOUBLE = {"Abs", "Ceil", "Cos", "Exp", "Floor", "Log", "Neg", "Reciprocal", "Round",
                  "Sign", "Sin", "Sqrt", "Tanh", "Sigmoid", "Relu"}  # fmt: skip


@pytest.mark.parametrize("op,low,high,opset", UNARY, ids=[u[0] for u in UNARY])
def test_unary_float32(op, low, high, opset):
    x = _rand((3, 4, 5), np.float32, low, high)
    check_against_ort(op, {"X": x}, opset=opset, **TOL[np.float32])


@pytest.mark.parametrize("op,low,high,opset", UNARY, ids=[u[0] for u in UNARY])
def test_unary_float64(op, low, high, opset):
    x = _rand((3, 4, 5), np.float64, low, high)
    if op in ORT_HAS_DOUBLE:
        check_against_ort(op, {"X": x}, opset=opset, **TOL[np.float64])
    else:
        check_float64_via_float32(op, x, opset=opset)


@pytest.mark.parametrize("op", ["Abs", "Neg", "Sign", "Relu", "Ceil", "Sqrt", "Exp", "Sigmoid"])
def test_unary_float16(op):
    x = _rand((4, 7), np.float16, 0.01 if op == "Sqrt" else -5, 5)
    check_against_ort(op, {"X": x}, opset=14, **TOL[np.float16])


@pytest.mark.parametrize("op", ["Abs", "Neg", "Sign"])
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_unary_int(op, dtype):
    check_against_ort(op, {"X": _rand((3, 5), dtype, -100, 100)}, opset=13)


def test_unary_keeps_0d_arrays():
    x = np.array(0.25, dtype=np.float32)
    (y,) = run_kernel("Sqrt", {"X": x}, opset=13)
    assert isinstance(y, np.ndarray) and y.shape == () and y.dtype == np.float32
    assert y == np.float32(0.5)


def test_round_half_to_even():
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.4, -2.6], dtype=np.float32)
    x += _rand((8,), np.int32, -3, 3).astype(np.float32) * 2  # even shifts keep the halves
    check_against_ort("Round", {"X": x}, opset=11)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_erf_against_math_erf(dtype):
    rng = np.random.default_rng()
    x = np.concatenate(
        [rng.uniform(-6, 6, 4000), rng.standard_normal(4000) * 1e-3, [0.0, -0.0, 1e-30]]
    ).astype(dtype)
    (got,) = run_kernel("Erf", {"X": x}, opset=13)
    exact = np.array([math.erf(v) for v in x.astype(np.float64).tolist()])
    ulps = np.abs(got.astype(np.float64) - exact) / np.spacing(np.abs(exact).astype(dtype))
    assert got.dtype == dtype
    assert ulps.max() <= (8 if dtype == np.float32 else 4), f"Erf max error {ulps.max()} ulp"


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_isnan_isinf(dtype):
    x = _rand((20,), dtype)
    x[::5] = np.nan
    x[1::5] = np.inf
    x[2::5] = -np.inf
    check_against_ort("IsNaN", {"X": x}, opset=20)
    for pos in (0, 1):
        for neg in (0, 1):
            attrs = {"detect_positive": pos, "detect_negative": neg}
            check_against_ort("IsInf", {"X": x}, attrs, opset=20)


# attribute values exact in float32, as the proto stores them
ACTIVATIONS = [
    ("LeakyRelu", {"alpha": 0.125}, 16),
    ("LeakyRelu", {}, 16),
    ("Elu", {"alpha": 0.75}, 22),
    ("Elu", {}, 22),
    ("Celu", {"alpha": 1.5}, 12),
    ("Selu", {}, 22),
    ("Selu", {"alpha": 1.25, "gamma": 0.875}, 22),
    ("HardSigmoid", {"alpha": 0.375, "beta": 0.625}, 22),
    ("HardSigmoid", {}, 22),
    ("ThresholdedRelu", {"alpha": 0.75}, 22),
    ("Shrink", {"bias": 0.5, "lambd": 1.25}, 9),
    ("Gelu", {}, 20),
    ("Gelu", {"approximate": "tanh"}, 20),
]


@pytest.mark.parametrize("op,attrs,opset", ACTIVATIONS, ids=[f"{a[0]}{a[1]}" for a in ACTIVATIONS])
def test_activation(op, attrs, opset):
    x = _rand((2, 3, 8), np.float32, -6, 6)
    check_against_ort(op, {"X": x}, attrs, opset=opset, **TOL[np.float32])
    check_float64_via_float32(op, x.astype(np.float64), attrs, opset=opset)


def test_shrink_int():
    x = _rand((30,), np.int32, -10, 10)
    check_against_ort("Shrink", {"X": x}, {"bias": 2.0, "lambd": 3.0}, opset=9)


@pytest.mark.parametrize("slope_shape", [(), (1,), (5,), (4, 1, 1), (1, 4, 1, 5)])
def test_prelu(slope_shape):
    x = _rand((2, 4, 3, 5))
    slope = _rand(slope_shape, np.float32, 0.05, 0.5)
    check_against_ort("PRelu", {"X": x, "slope": slope}, opset=16)


def test_swish_and_swiglu_match_their_definition():
    a, b = _rand((3, 16), np.float64, -8, 8), _rand((3, 16), np.float64)
    (s,) = run_kernel("Swish", {"X": a}, {"alpha": 1.7}, opset=24)
    np.testing.assert_allclose(s, a / (1 + np.exp(-1.7 * a)), rtol=1e-13)
    (g,) = run_kernel("SwiGLU", {"A": a, "B": b}, {"alpha": 1.7}, opset=28)
    np.testing.assert_allclose(g, a * b / (1 + np.exp(-1.7 * a)), rtol=1e-13)
    with pytest.raises(ValueError, match="same shape"):
        run_kernel("SwiGLU", {"A": a, "B": b[:1]}, opset=28)


SHAPES = [((3, 4, 5), (3, 4, 5)), ((3, 4, 5), (5,)), ((2, 1, 4), (3, 1)), ((), (3, 2)), ((4,), ())]


@pytest.mark.parametrize("sa,sb", SHAPES)
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32, np.int64])
def test_arithmetic(op, dtype, sa, sb):
    a = _rand(sa, dtype, -50, 50)
    b = _rand(sb, dtype, 1, 9)
    if np.dtype(dtype).kind == "i":
        b[...] = b * np.where(_rand(sb, np.int64, 0, 1) == 0, -1, 1)  # both signs of divisor
    check_against_ort(op, {"A": a, "B": b}, opset=14, **TOL.get(dtype, {}))


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.uint32, np.uint64])
def test_arithmetic_small_ints(op, dtype):
    a, b = _rand((4, 6), dtype, 0, 120), _rand((6,), dtype, 1, 7)
    check_against_ort(op, {"A": a, "B": b}, opset=14)


def test_legacy_broadcast_axis():
    a, b = _rand((2, 3, 4, 5)), _rand((3, 4))
    (y,) = run_kernel("Add", {"A": a, "B": b}, {"broadcast": 1, "axis": 1}, opset=6)
    np.testing.assert_array_equal(y, a + b[None, :, :, None])
    (y,) = run_kernel("Mul", {"A": a, "B": b[:, 0]}, {"broadcast": 1, "axis": -3}, opset=6)
    np.testing.assert_array_equal(y, a * b[:, 0][None, :, None, None])


@pytest.mark.parametrize("op", ["Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64, np.uint8])
def test_comparison(op, dtype):
    a, b = _rand((3, 4), dtype, 0, 4), _rand((4,), dtype, 0, 4)
    check_against_ort(op, {"A": a, "B": b}, opset=19)


def test_equal_strings():
    words = np.array(["a", "bb", "c", ""], dtype=object)
    rng = np.random.default_rng()
    a = rng.choice(words, size=(3, 4)).astype(object)
    check_against_ort("Equal", {"A": a, "B": words}, opset=19)


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logical(op):
    a, b = _rand((2, 3, 4), np.bool_), _rand((3, 1), np.bool_)
    check_against_ort(op, {"A": a, "B": b}, opset=7)
    check_against_ort("Not", {"X": a}, opset=1)


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int16, np.uint64])
def test_bitwise(op, dtype):
    a, b = _rand((3, 4), dtype, 0, 120), _rand((4,), dtype, 0, 120)
    check_against_ort(op, {"A": a, "B": b}, opset=18)
    check_against_ort("BitwiseNot", {"X": a}, opset=18)


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_bitshift(direction, dtype):
    bits = np.dtype(dtype).itemsize * 8
    x, y = _rand((4, 5), dtype, 0, 255), _rand((5,), dtype, 0, bits - 1)
    check_against_ort("BitShift", {"X": x, "Y": y}, {"direction": direction}, opset=11)


def test_bitshift_signed_and_out_of_range():
    x = np.array([-128, -7, 5, 127, -1, 64, -3, 9], dtype=np.int8)
    y = np.array([1, 2, 8, 9, -1, 3, 7, 0], dtype=np.int8)
    (right,) = run_kernel("BitShift", {"X": x, "Y": y}, {"direction": "RIGHT"}, opset=28)
    (left,) = run_kernel("BitShift", {"X": x, "Y": y}, {"direction": "LEFT"}, opset=28)
    np.testing.assert_array_equal(right, [-64, -2, 0, 0, -1, 8, -1, 9])
    np.testing.assert_array_equal(left, [0, -28, 0, 0, 0, 0, -128, 9])


@pytest.mark.parametrize(
    "xt,yt", [(np.float32, np.float32), (np.float32, np.int64), (np.int64, np.int64),
              (np.int32, np.float32), (np.float64, np.float64), (np.float32, np.int32)]
)  # fmt: skip
def test_pow(xt, yt):
    x = _rand((3, 4), xt, 1, 4)
    y = _rand((4,), yt, 0, 3)
    check_against_ort("Pow", {"X": x, "Y": y}, opset=15, rtol=1e-5)
    check_against_ort("Pow", {"X": x, "Y": np.array(2, dtype=yt)}, opset=15, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint16])
@pytest.mark.parametrize("fmod", [0, 1])
def test_mod_int(dtype, fmod):
    a = _rand((5, 6), dtype, 0 if np.dtype(dtype).kind == "u" else -50, 50)
    b = _rand((6,), dtype, 1, 9)
    if np.dtype(dtype).kind == "i":
        b[::2] *= -1
    check_against_ort("Mod", {"A": a, "B": b}, {"fmod": fmod}, opset=13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_mod_float(dtype):
    a, b = _rand((5, 6), dtype, -20, 20), _rand((6,), dtype, 0.5, 4)
    b[::2] *= -1
    check_against_ort("Mod", {"A": a, "B": b}, {"fmod": 1}, opset=13, **TOL[dtype])
    # fmod=0 (onnxruntime rejects it for floats): the result takes the divisor's sign
    (y,) = run_kernel("Mod", {"A": a, "B": b}, opset=13)
    exact = a.astype(np.float64) - np.floor(a.astype(np.float64) / b) * b
    np.testing.assert_allclose(y, exact, **TOL[dtype])
    assert y.dtype == dtype and np.all((y == 0) | (np.sign(y) == np.sign(b)))


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_variadic(op, n, dtype):
    shapes = [(3, 1, 5), (4, 5), (1,)][:n]
    inputs = {f"x{i}": _rand(s, dtype) for i, s in enumerate(shapes)}
    if op == "Mean" and dtype == np.float64:  # no double Mean in onnxruntime
        (got,) = run_kernel(op, inputs, opset=13)
        np.testing.assert_allclose(got, sum(inputs.values()) / n, rtol=1e-15)
        return
    check_against_ort(op, inputs, opset=13, **TOL[dtype])


@pytest.mark.parametrize("op", ["Max", "Min"])
@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.uint32])
def test_max_min_int(op, dtype):
    inputs = {"a": _rand((3, 4), dtype, 0, 100), "b": _rand((4,), dtype, 0, 100)}
    check_against_ort(op, inputs, opset=13)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8])
def test_where(dtype):
    c = _rand((2, 1, 4), np.bool_)
    x, y = _rand((3, 4), dtype), _rand((2, 3, 1), dtype)
    check_against_ort("Where", {"C": c, "X": x, "Y": y}, opset=16)


@pytest.mark.parametrize("bounds", [(-1.0, 1.5), (None, 0.5), (-0.5, None), (None, None), (2, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.int64, np.float16])
def test_clip(bounds, dtype):
    x = _rand((3, 4, 5), dtype, -3, 3)
    lo, hi = (None if b is None else np.array(b, dtype=dtype) for b in bounds)
    check_against_ort("Clip", {"X": x, "min": lo, "max": hi}, opset=13)


def test_clip_legacy_attributes():
    x = _rand((4, 5))
    check_against_ort("Clip", {"X": x}, {"min": -0.5, "max": 0.75}, opset=6)


@pytest.mark.parametrize(
    "op,attrs,opset",
    [("Gelu", {}, 20), ("Erf", {}, 13), ("Sigmoid", {}, 13), ("LeakyRelu", {"alpha": 0.25}, 16),
     ("Mish", {}, 22), ("Elu", {}, 22), ("Pow3", {}, 15)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_large_inputs_processed_in_pieces(op, attrs, opset, dtype):
    x = _rand((301, 457), dtype, -6, 6)  # > 64K elements, not a multiple of the piece size
    x.flat[::1000] = np.nan
    inputs = {"X": x}
    if op == "Pow3":
        op, inputs = "Pow", {"X": x, "Y": np.array(3.0, dtype=dtype)}
    tol = TOL[dtype] if dtype == np.float16 else {"rtol": 1e-5, "atol": 1e-5}
    if dtype == np.float16 and op in ("Gelu", "Erf", "Mish", "Elu"):
        (y,) = run_kernel(op, inputs, attrs, opset=opset)  # no float16 kernel in onnxruntime
        (y32,) = run_ort(one_node_model(op, {"X": x.astype(np.float32)}, attrs, opset=opset),
                         {"X": x.astype(np.float32)})  # fmt: skip
        assert y.dtype == np.float16 and y.shape == x.shape
        np.testing.assert_allclose(y.astype(np.float32), y32, **tol)
        return
    check_against_ort(op, inputs, attrs, opset=opset, **tol)
