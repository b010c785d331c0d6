"""The cuda backend's elementwise and cast kernels against the numpy reference, on fresh random
inputs: every dtype ONNX allows (the unsigned 16/32/64-bit ones torch barely supports among them),
float16, broadcast and non-contiguous inputs, and edge cases the conformance suite leaves out."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf/NaN/overflow

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOATS = [np.float16, np.float32, np.float64]
TOL = {np.dtype(np.float16): 2e-3, np.dtype(ml_dtypes.bfloat16): 1e-2, np.dtype(np.float64): 1e-12}


def _dev(a):
    """``a`` on the device; 0-d arrays stay 0-d, strings and sub-byte types stay numpy."""
    t = to_torch(a, DEVICE)
    return t.reshape(a.shape) if isinstance(t, torch.Tensor) else t


def _run(op, args, attrs=None, *, opset=25, backend="cuda"):
    attrs = attrs or {}
    if backend == "cuda":
        args = [_dev(a) for a in args]
    return invoke(lookup(op, "", opset, backend), args, attrs, 1)[0]


def _compare(op, args, attrs=None, *, opset=25, rtol=None, atol=None, transpose=False):
    """Run ``op`` on both backends and check dtype, shape and values (NaNs at the same places)."""
    ref = _run(op, args, attrs, opset=opset, backend="reference")
    if transpose:  # the same values through non-contiguous tensors
        cuda_args = [_dev(np.ascontiguousarray(a.T)).T for a in args]
        got = invoke(lookup(op, "", opset, "cuda"), cuda_args, attrs or {}, 1)[0]
    else:
        got = _run(op, args, attrs, opset=opset)
    got = to_numpy(got)
    assert got.dtype == ref.dtype, (op, got.dtype, ref.dtype)
    assert got.shape == ref.shape, (op, got.shape, ref.shape)
    if ref.dtype.kind in "biuO":
        np.testing.assert_array_equal(got, ref, err_msg=op)
        return got
    tol = TOL.get(ref.dtype, 1e-6)
    rtol = tol if rtol is None else rtol
    atol = tol if atol is None else atol
    np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=rtol,
                               atol=atol, err_msg=op)  # fmt: skip
    return got


def _ints(rng, dtype, shape, lo=None, hi=None):
    info = np.iinfo(dtype)
    lo = info.min if lo is None else lo
    hi = info.max if hi is None else hi
    return rng.integers(lo, hi, size=shape, dtype=dtype, endpoint=True)


# ---------------------------------------------------------------------------------------------
# Unary math and activations

# op -> (low, high) of the random inputs (the op's domain)
_UNARY = {
    "Abs": (-3, 3), "Acos": (-0.99, 0.99), "Acosh": (1.01, 4), "Asin": (-0.99, 0.99),
    "Asinh": (-3, 3), "Atan": (-3, 3), "Atanh": (-0.99, 0.99), "Ceil": (-5, 5), "Cos": (-3, 3),
    "Cosh": (-3, 3), "Exp": (-3, 3), "Floor": (-5, 5), "Log": (0.01, 5), "Neg": (-3, 3),
    "Reciprocal": (0.2, 5), "Round": (-5, 5), "Sign": (-3, 3), "Sin": (-3, 3), "Sinh": (-3, 3),
    "Sqrt": (0, 5), "Tan": (-1.4, 1.4), "Tanh": (-3, 3), "Erf": (-3, 3), "Sigmoid": (-6, 6),
    "Relu": (-3, 3), "Softplus": (-25, 25), "Softsign": (-3, 3), "Mish": (-5, 5),
    "HardSwish": (-5, 5), "IsNaN": (-3, 3),
}  # fmt: skip


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", sorted(_UNARY))
def test_unary_float(op, dtype):
    rng = np.random.default_rng()
    lo, hi = _UNARY[op]
    x = rng.uniform(lo, hi, size=(5, 7)).astype(dtype)
    if op == "Round":
        x[0, :4] = np.array([0.5, 1.5, 2.5, -2.5], dtype=dtype)  # halves go to even
    _compare(op, [x], transpose=True)


# op -> attribute sets beyond the defaults
_ACTIVATIONS = {
    "LeakyRelu": [{}, {"alpha": 0.3}, {"alpha": 1.7}, {"alpha": -0.5}],
    "Elu": [{}, {"alpha": 0.7}],
    "Celu": [{}, {"alpha": 2.0}],
    "Selu": [{}, {"alpha": 1.2, "gamma": 0.8}],
    "HardSigmoid": [{}, {"alpha": 1 / 6, "beta": 0.5}],
    "ThresholdedRelu": [{}, {"alpha": 0.4}],
    "Shrink": [{}, {"bias": 0.3, "lambd": 0.8}],
    "Swish": [{}, {"alpha": 1.5}],
    "Gelu": [{}, {"approximate": "tanh"}],
    "IsInf": [{}, {"detect_negative": 0}, {"detect_positive": 0}],
}


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("op", sorted(_ACTIVATIONS))
def test_activations(op, dtype):
    rng = np.random.default_rng()
    x = rng.uniform(-4, 4, size=(3, 4, 5)).astype(dtype)
    # (torch's vectorized CPU Gelu gives NaN for +inf; its CUDA kernel and the reference give inf)
    special = [np.nan] if op == "Gelu" and DEVICE == "cpu" else [np.inf, -np.inf, np.nan]
    x.reshape(-1)[: len(special)] = np.array(special).astype(dtype)
    # float32 Gelu: 1 + erf(x/sqrt(2)) cancels for negative x, and torch's float32 erf (a few
    # ulps) then differs from the reference's by up to ~1e-6 absolute at |x| near 4
    atol = 4e-6 if op == "Gelu" and dtype == np.float32 else None
    for attrs in _ACTIVATIONS[op]:
        _compare(op, [x], attrs, atol=atol)


def test_float8_predicates():
    rng = np.random.default_rng()
    for dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        x = rng.uniform(-4, 4, size=(6,)).astype(dtype)
        x[0] = np.nan
        _compare("IsNaN", [x])
        _compare("IsInf", [x])


@pytest.mark.parametrize("dtype", INTS)
def test_unary_integer(dtype):
    rng = np.random.default_rng()
    x = _ints(rng, dtype, (4, 6))
    x.reshape(-1)[0] = 0
    for op in ("Abs", "Sign", "BitwiseNot", "Relu"):
        _compare(op, [x])
    if np.dtype(dtype).kind == "i":
        _compare("Neg", [x])
    _compare("Shrink", [x // 4], {"bias": 1.5, "lambd": 20.0})  # // 4: exact in float64
    _compare("Clip", [x, np.array(-7).astype(dtype), np.array(90).astype(dtype)], opset=13)


def test_logical_and_empty():
    rng = np.random.default_rng()
    a, b = rng.random((3, 4)) > 0.5, rng.random((4,)) > 0.5
    for op in ("And", "Or", "Xor", "Equal"):
        _compare(op, [a, b])
    _compare("Not", [a])
    e = np.zeros((0, 3), dtype=np.float32)
    for op in ("Exp", "Relu", "Gelu"):
        _compare(op, [e])
    _compare("Add", [e, rng.standard_normal(3).astype(np.float32)])


# ---------------------------------------------------------------------------------------------
# Binary arithmetic


@pytest.mark.parametrize("dtype", INTS)
def test_integer_arithmetic(dtype):
    """Wrap-around, truncating division, both Mod modes, comparisons and bitwise ops, broadcast."""
    rng = np.random.default_rng()
    a = _ints(rng, dtype, (3, 1, 5))
    b = _ints(rng, dtype, (4, 5))
    b[b == 0] = 3  # integer division by zero is undefined
    b[0, :2] = np.array([1, 7]).astype(dtype)
    if np.dtype(dtype).kind == "i":  # the lowest value over -1 overflows (a CPU trap)
        a[a == np.iinfo(dtype).min] += 1
    for op in ("Add", "Sub", "Mul", "Div", "Equal", "Greater", "GreaterOrEqual", "Less",
               "LessOrEqual", "BitwiseAnd", "BitwiseOr", "BitwiseXor"):  # fmt: skip
        _compare(op, [a, b])
    _compare("Mod", [a, b], {"fmod": 0})
    _compare("Mod", [a, b], {"fmod": 1})
    for op in ("Max", "Min", "Sum", "Mean"):
        _compare(op, [a, b, _ints(rng, dtype, (5,))])


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int32])
@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bit_shift(dtype, direction):
    rng = np.random.default_rng()
    bits = np.dtype(dtype).itemsize * 8
    x = _ints(rng, dtype, (4, 8))
    y = rng.integers(0, bits + 2, size=(8,)).astype(dtype)  # some shifts past the width
    _compare("BitShift", [x, y], {"direction": direction})


def test_float_mod_and_div():
    rng = np.random.default_rng()
    a = rng.uniform(-10, 10, size=(4, 6)).astype(np.float32)
    b = rng.uniform(-3, 3, size=(6,)).astype(np.float32)
    _compare("Mod", [a, b], {"fmod": 1})
    _compare("Mod", [a, b], {"fmod": 0})
    _compare("Div", [a, b], transpose=False)
    _compare("Div", [a.astype(np.float16), b.astype(np.float16)])


def test_pow_mixed_types():
    rng = np.random.default_rng()
    x = rng.uniform(0.1, 3, size=(3, 4)).astype(np.float32)
    for y in (np.array(2.0, dtype=np.float32), np.array([3.0], dtype=np.float64),
              rng.integers(-3, 4, size=(4,)), rng.uniform(-2, 2, size=(3, 4)).astype(np.float32)):  # fmt: skip
        _compare("Pow", [x, y])
        _compare("Pow", [x.astype(np.float16), y])
    xi = rng.integers(-5, 6, size=(3, 4)).astype(np.int32)
    _compare("Pow", [xi, rng.integers(0, 6, size=(4,)).astype(np.int64)])
    _compare("Pow", [xi, rng.integers(0, 6, size=(4,)).astype(np.uint32)])
    _compare("Pow", [xi, np.array([0.5, 2.0, 1.0, 3.0], dtype=np.float32)])
    xi[xi == 0] = 2
    _compare("Pow", [xi, rng.integers(-2, 4, size=(3, 4)).astype(np.int64)])  # negative powers
    _compare(
        "Pow", [rng.integers(0, 9, size=(5,)).astype(np.uint64), np.arange(5, dtype=np.uint64)]
    )


def test_legacy_broadcast_axis():
    rng = np.random.default_rng()
    a = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    b = rng.standard_normal((3, 4)).astype(np.float32)
    for op in ("Add", "Mul", "Sub", "Div", "Pow"):
        _compare(op, [np.abs(a) + 0.5, b], {"broadcast": 1, "axis": 1}, opset=6)
    slope = rng.standard_normal(3).astype(np.float32)
    _compare("PRelu", [a, slope], opset=6)


def test_prelu_and_swiglu():
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 3, 4)).astype(np.float16)
    _compare("PRelu", [x, rng.standard_normal((3, 1)).astype(np.float16)], opset=16)
    xi = rng.integers(-9, 9, size=(2, 3)).astype(np.int32)
    _compare("PRelu", [xi, np.array([2, -1, 3], dtype=np.int32)], opset=16)
    a = rng.standard_normal((3, 8)).astype(np.float16)
    _compare(
        "SwiGLU", [a, rng.standard_normal((3, 8)).astype(np.float16)], {"alpha": 1.3}, opset=28
    )
    with pytest.raises(ValueError):
        _run("PRelu", [x, rng.standard_normal((5,)).astype(np.float16)], opset=16)


# ---------------------------------------------------------------------------------------------
# Where, Clip, strings


def test_where_broadcast_and_strings():
    rng = np.random.default_rng()
    cond = rng.random((3, 1, 4)) > 0.5
    for dtype in (np.float16, np.int64, np.uint32, ml_dtypes.bfloat16, np.bool_):
        x = (rng.standard_normal((2, 4)) * 5).astype(dtype)
        _compare("Where", [cond, x, (rng.standard_normal((4,)) * 5).astype(dtype)], opset=16)
    words = np.array(["a", "bb", "c", "dd"], dtype=object)
    got = _compare("Where", [cond, words, np.array(["z"], dtype=object)], opset=16)
    assert isinstance(got, np.ndarray) and got.dtype == object
    _compare("Equal", [words, np.array(["bb"], dtype=object)], opset=19)


def test_clip_variants():
    rng = np.random.default_rng()
    x = rng.uniform(-5, 5, size=(4, 5)).astype(np.float32)
    x[0, 0] = np.nan
    lo, hi = np.array(-1.5, dtype=np.float32), np.array(2.0, dtype=np.float32)
    _compare("Clip", [x, lo, hi], opset=13)
    _compare("Clip", [x, hi, lo], opset=13)  # min > max: everything becomes max
    _compare("Clip", [x, None, hi], opset=13)
    _compare("Clip", [x, lo], opset=13)
    _compare("Clip", [x], opset=13)
    _compare("Clip", [x.astype(np.float16), lo.astype(np.float16)], opset=13)
    _compare("Clip", [x], {"min": -0.3, "max": 0.7}, opset=6)
    _compare("Clip", [x], {"max": 0.1}, opset=6)
    u = _ints(rng, np.uint64, (6,))
    _compare("Clip", [u, np.array(2**40, dtype=np.uint64), np.array(2**63 + 5, dtype=np.uint64)])


# ---------------------------------------------------------------------------------------------
# Cast, CastLike, BitCast

_FLOAT8 = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2,
           ml_dtypes.float8_e5m2fnuz]  # fmt: skip
_CAST_TARGETS = [
    TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE,
    TensorProto.INT8, TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8,
    TensorProto.UINT16, TensorProto.UINT64, TensorProto.BOOL,
]  # fmt: skip


def _float8_probe(rng) -> np.ndarray:
    """Values that exercise float8 rounding: overflow near each type's limit, ties, tiny values."""
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 448, 464, 465, 480, 240, 248, 249, 57344,
               61439, 61440, 70000, -1e6, 1e-9, 2**-10, 3 * 2**-10, 0.0625 + 2**-8]  # fmt: skip
    return np.concatenate([special, rng.standard_normal(40) * 50]).astype(np.float32)


@pytest.mark.parametrize("to", _CAST_TARGETS)
def test_cast_numbers(to):
    rng = np.random.default_rng()
    floats = np.clip(rng.standard_normal((3, 5)) * 40, -120, 120).astype(np.float32)
    ints = rng.integers(0, 120, size=(3, 5)).astype(np.int64)
    for x in (floats, floats.astype(np.float16), floats.astype(ml_dtypes.bfloat16), ints,
              ints.astype(np.uint32), ints.astype(bool)):  # fmt: skip
        floating = np.dtype(x.dtype).kind == "f" or x.dtype == ml_dtypes.bfloat16  # (kind "V")
        if floating and to not in (1, 10, 16, 11, 9):
            x = np.abs(x)  # negative floats to unsigned are undefined
        _compare("Cast", [x], {"to": to}, rtol=0, atol=0)


@pytest.mark.parametrize("saturate", [0, 1])
@pytest.mark.parametrize("dtype", _FLOAT8)
def test_cast_float8(dtype, saturate):
    rng = np.random.default_rng()
    to = {ml_dtypes.float8_e4m3fn: 17, ml_dtypes.float8_e4m3fnuz: 18, ml_dtypes.float8_e5m2: 19,
          ml_dtypes.float8_e5m2fnuz: 20}[dtype]  # fmt: skip
    x = _float8_probe(rng)
    for src in (x, x.astype(np.float16)):
        _compare("Cast", [src], {"to": to, "saturate": saturate}, opset=19, rtol=0, atol=0)
        like = np.zeros(1, dtype=dtype)
        _compare("CastLike", [src, like], {"saturate": saturate}, opset=19, rtol=0, atol=0)
    _compare("Cast", [rng.integers(-300, 300, size=9)], {"to": to, "saturate": saturate},
             opset=19, rtol=0, atol=0)  # fmt: skip
    f8 = x.astype(dtype)
    for back in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
        _compare("Cast", [f8], {"to": back}, opset=19, rtol=0, atol=0)


def test_cast_strings_and_sub_byte_on_host():
    x = np.array([[1.5, -2.0], [np.inf, 1e10]], dtype=np.float32)
    text = _compare("Cast", [x], {"to": TensorProto.STRING})
    assert text.dtype == object
    _compare("Cast", [np.array(["1.5", "-7", "NaN"], dtype=object)], {"to": TensorProto.FLOAT})
    _compare("Cast", [np.array(["12", "-7"], dtype=object)], {"to": TensorProto.INT64})
    _compare("Cast", [np.array([3.7, -2.2, 9.0], dtype=np.float32)], {"to": TensorProto.INT4},
             opset=21)  # fmt: skip
    four = np.array([1, -3, 7], dtype=ml_dtypes.int4)
    _compare("Cast", [four], {"to": TensorProto.FLOAT}, opset=21)


def test_bit_cast():
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 4)).astype(np.float32)
    _compare("BitCast", [x], {"to": TensorProto.INT32}, opset=26)
    _compare("BitCast", [x.astype(np.float16)], {"to": TensorProto.BFLOAT16}, opset=26)
    _compare("BitCast", [rng.random(5) > 0.5], {"to": TensorProto.UINT8}, opset=26)
    _compare("BitCast", [_ints(rng, np.uint64, (2, 3))], {"to": TensorProto.DOUBLE}, opset=26,
             rtol=0, atol=0)  # fmt: skip
    xt = _dev(x).T  # non-contiguous
    got = invoke(lookup("BitCast", "", 26, "cuda"), [xt], {"to": TensorProto.INT32}, 1)[0]
    np.testing.assert_array_equal(to_numpy(got), x.T.view(np.int32))
    with pytest.raises(ValueError):
        _run("BitCast", [x], {"to": TensorProto.INT64}, opset=26)
