"""Elementwise reference kernels: unary math, activations, arithmetic, comparison, logic, bitwise.

Every kernel keeps the input's dtype. Transcendental activations compute float16, bfloat16 and
float8 inputs in float32 and round once at the end; float32 stays float32 and float64 stays float64.
Opset 1-6 binary ops took ``broadcast``/``axis`` attributes; they are accepted and honoured.
Cast, CastLike and BitCast live in ``cast.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tensorkiln.kernels.common.elementwise import (
    CLIP_BOUNDS_AS_INPUTS,
    PRELU_BROADCASTS,
    check_clip_bound,
    check_prelu_slope,
    prelu_slope_shape,
)
from tensorkiln.kernels.registry import register


def _narrow(y, dtype: np.dtype) -> np.ndarray:
    """``y`` as an ndarray of ``dtype`` (ufuncs return numpy scalars for 0-d inputs)."""
    if not isinstance(y, np.ndarray):
        return np.asarray(y, dtype=dtype)
    return y if y.dtype == dtype else y.astype(dtype)


def _arr(y) -> np.ndarray:
    """A fresh ufunc result as an ndarray, so that later steps may write into it."""
    return y if isinstance(y, np.ndarray) else np.asarray(y)


_BLOCK = 1 << 16


def _apply(core: Callable, x: np.ndarray, *args) -> np.ndarray:
    """``core(v, *args)``, float math on a 1-D float32/float64 array returning a fresh array,
    applied to ``x`` piece by piece and returned in x's dtype.

    float64 stays float64; everything else (float16, bfloat16, float8, integers) is computed in
    float32 and rounded once. Pieces of 64K elements keep a multi-pass formula's temporaries in
    cache, which makes Erf/Gelu/Mish about 2.5x faster than whole-array passes.
    """
    wide = np.float64 if x.dtype == np.float64 else np.float32
    flat = x.reshape(-1)
    if flat.size <= _BLOCK:
        return _narrow(core(flat.astype(wide, copy=False), *args), x.dtype).reshape(x.shape)
    out = np.empty(flat.shape, dtype=x.dtype)
    for i in range(0, flat.size, _BLOCK):
        out[i : i + _BLOCK] = core(flat[i : i + _BLOCK].astype(wide, copy=False), *args)
    return out.reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# Unary math


def _unary(ufunc: Callable) -> Callable:
    def kernel(x: np.ndarray, *, consumed_inputs: list[int] | None = None) -> np.ndarray:
        with np.errstate(all="ignore"):
            return _narrow(ufunc(x), x.dtype)

    kernel.__name__ = kernel.__qualname__ = ufunc.__name__
    kernel.__doc__ = f"Elementwise ``np.{ufunc.__name__}``, dtype kept."
    return kernel


# fmt: off
_UNARY = {
    "Abs": np.abs, "Acos": np.arccos, "Acosh": np.arccosh, "Asin": np.arcsin,
    "Asinh": np.arcsinh, "Atan": np.arctan, "Atanh": np.arctanh, "Ceil": np.ceil, "Cos": np.cos,
    "Cosh": np.cosh, "Exp": np.exp, "Floor": np.floor, "Log": np.log, "Neg": np.negative,
    "Reciprocal": np.reciprocal, "Round": np.rint,  # rint rounds half to even, as ONNX asks
    "Sign": np.sign, "Sin": np.sin, "Sinh": np.sinh, "Sqrt": np.sqrt, "Tan": np.tan,
    "Tanh": np.tanh, "Not": np.logical_not, "BitwiseNot": np.invert,
}
# fmt: on
for _op, _ufunc in _UNARY.items():
    register(_op, since=1)(_unary(_ufunc))


@register("IsNaN", since=9)
def isnan(x: np.ndarray) -> np.ndarray:
    """True where ``x`` is NaN."""
    return np.asarray(np.isnan(x))


@register("IsInf", since=10)
def isinf(x: np.ndarray, *, detect_negative: int = 1, detect_positive: int = 1) -> np.ndarray:
    """True where ``x`` is an infinity of a detected sign."""
    if detect_negative and detect_positive:
        return np.asarray(np.isinf(x))
    if detect_positive:
        return np.asarray(np.isposinf(x))
    if detect_negative:
        return np.asarray(np.isneginf(x))
    return np.zeros(x.shape, dtype=bool)


# Erf. float32 (and narrower) uses Eigen's rational approximation on [-4, 4] (erf is +-1 in
# float32 outside), at most 7 float32 ulp (4e-7 absolute) from the true value; float64 uses
# Cephes' ndtr.c rational approximations (erf on |x| < 1, 1 - erfc above), within 3 float64 ulp.
# fmt: off
_ERF32_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
            -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
            -1.60960333262415e-02)
_ERF32_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
            -7.37332916720468e-03, -1.42647390514189e-02)
_ERF64_T = (9.60497373987051638749e0, 9.00260197203842689217e1, 2.23200534594684319226e3,
            7.00332514112805075473e3, 5.55923013010394962768e4)
_ERF64_U = (1.0, 3.35617141647503099647e1, 5.21357949780152679795e2, 4.59432382970980127987e3,
            2.26290000613890934246e4, 4.92673942608635921086e4)
_ERFC64_P = (2.46196981473530512524e-10, 5.64189564831068821977e-1, 7.46321056442269912687e0,
             4.86371970985681366614e1, 1.96520832956077098242e2, 5.26445194995477358631e2,
             9.34528527171957607540e2, 1.02755188689515710272e3, 5.57535335369399327526e2)
_ERFC64_Q = (1.0, 1.32281951154744992508e1, 8.67072140885989742329e1, 3.54937778887819891062e2,
             9.75708501743205489753e2, 1.82390916687909736289e3, 2.24633760818710981792e3,
             1.65666309194161350182e3, 5.57535340817727675546e2)
# fmt: on


def _horner(coeffs: tuple[float, ...], z: np.ndarray) -> np.ndarray:
    """Evaluate the polynomial with ``coeffs`` (highest power first) at ``z``, in z's dtype."""
    t = z.dtype.type
    y = np.multiply(z, t(coeffs[0]))
    for c in coeffs[1:-1]:
        y += t(c)
        y *= z
    y += t(coeffs[-1])
    return y


def _erf32(x: np.ndarray) -> np.ndarray:
    x = np.clip(x, np.float32(-4.0), np.float32(4.0))
    z = x * x
    p = _horner(_ERF32_P, z)
    p *= x
    p /= _horner(_ERF32_Q, z)
    return p


def _erf64(x: np.ndarray) -> np.ndarray:
    a = np.abs(x)
    out = np.empty_like(x)
    small = a < 1.0
    xs = x[small]
    z = xs * xs
    out[small] = xs * _horner(_ERF64_T, z) / _horner(_ERF64_U, z)
    big = ~small
    ab = np.minimum(a[big], 6.0)  # erf(6) is 1 in float64
    erfc = np.exp(-ab * ab) * _horner(_ERFC64_P, ab) / _horner(_ERFC64_Q, ab)
    out[big] = np.copysign(1.0 - erfc, x[big])
    return out


def _erf(v: np.ndarray) -> np.ndarray:
    return _erf64(v) if v.dtype == np.float64 else _erf32(v)


@register("Erf", since=9)
def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise."""
    if x.dtype.kind in "iu":  # erf of an integer truncates back to 0 for any value
        return _narrow(_apply(_erf, x.astype(np.float64)), x.dtype)
    return _apply(_erf, x)


# ---------------------------------------------------------------------------------------------
# Activations (the cores run on 1-D float32/float64 pieces, see _apply)


def _sigmoid(v: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    """1 / (1 + exp(-alpha v)); exact to rounding for all v (exp overflow gives 0)."""
    y = np.multiply(v, -alpha)
    with np.errstate(over="ignore"):
        np.exp(y, out=y)
    y += 1
    return np.reciprocal(y, out=y)


def _swish(v: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    y = _sigmoid(v, alpha)
    y *= v
    return y


@register("Sigmoid", since=1)
def sigmoid(x: np.ndarray, *, consumed_inputs: list[int] | None = None) -> np.ndarray:
    """Logistic sigmoid."""
    return _apply(_sigmoid, x)


@register("Swish", since=24)
def swish(x: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    """x * sigmoid(alpha x)."""
    return _apply(_swish, x, alpha)


@register("SwiGLU", since=28)
def swiglu(a: np.ndarray, b: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    """Swish(a) * b, for same-shaped gate ``a`` and value ``b``."""
    if a.shape != b.shape:
        raise ValueError(f"SwiGLU needs A and B of the same shape, got {a.shape} and {b.shape}")
    y = _apply(_swish, a, alpha)
    if a.dtype.kind == "f" and a.dtype.itemsize >= 4:
        y *= b
        return y
    return _narrow(y.astype(np.float32) * b.astype(np.float32), a.dtype)


@register("Relu", since=1)
def relu(x: np.ndarray, *, consumed_inputs: list[int] | None = None) -> np.ndarray:
    """max(x, 0); NaN stays NaN."""
    return _narrow(np.maximum(x, x.dtype.type(0)), x.dtype)


def _leaky(v: np.ndarray, alpha: float) -> np.ndarray:
    y = np.multiply(v, alpha)
    if 0 <= alpha <= 1:  # branch-free: max(x, alpha x) is x above 0 and alpha x below
        return np.maximum(y, v, out=y)
    return np.where(v >= 0, v, y)


@register("LeakyRelu", since=1)
def leaky_relu(
    x: np.ndarray,
    *,
    alpha: float = 0.009999999776482582,  # float32(0.01), as the attribute is stored
    consumed_inputs: list[int] | None = None,
) -> np.ndarray:
    """x where x >= 0, alpha x elsewhere."""
    return _apply(_leaky, x, alpha)


@register("PRelu")
def prelu(
    x: np.ndarray,
    slope: np.ndarray,
    *,
    consumed_inputs: list[int] | None = None,
    _opset: int = PRELU_BROADCASTS,
) -> np.ndarray:
    """x where x >= 0, slope x elsewhere; ``slope`` broadcasts to ``x`` (before opset 7 a 1-D
    slope of length C is laid along axis 1)."""
    view = prelu_slope_shape(slope.shape, x.shape, _opset)
    if view is not None:
        slope = slope.reshape(view)
    check_prelu_slope(slope.shape, x.shape)
    zero = x.dtype.type(0)
    y = _arr(np.minimum(x, zero))  # branch-free: max(x, 0) + slope * min(x, 0)
    y *= slope
    y += np.maximum(x, zero)
    return y


def _elu(v: np.ndarray, alpha: float, gamma: float = 1.0, scale: float = 1.0) -> np.ndarray:
    """gamma (max(v, 0) + alpha expm1(min(v, 0) / scale)): Elu, Selu and Celu, branch-free."""
    neg = np.minimum(v, 0)
    if scale != 1.0:
        neg /= v.dtype.type(scale)
    np.expm1(neg, out=neg)
    neg *= alpha
    neg += np.maximum(v, 0)
    if gamma != 1.0:
        neg *= gamma
    return neg


@register("Elu", since=1)
def elu(
    x: np.ndarray, *, alpha: float = 1.0, consumed_inputs: list[int] | None = None
) -> np.ndarray:
    """x where x > 0, alpha (exp(x) - 1) elsewhere."""
    return _apply(_elu, x, alpha)


@register("Celu", since=12)
def celu(x: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    """max(0, x) + min(0, alpha (exp(x / alpha) - 1))."""
    return _apply(_elu, x, alpha, 1.0, alpha)


@register("Selu", since=1)
def selu(
    x: np.ndarray,
    *,
    alpha: float = 1.67326319217681884765625,
    gamma: float = 1.05070102214813232421875,
    consumed_inputs: list[int] | None = None,
) -> np.ndarray:
    """gamma x where x > 0, gamma alpha (exp(x) - 1) elsewhere."""
    return _apply(_elu, x, alpha, gamma)


def _hard_sigmoid(v: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    y = np.multiply(v, alpha)
    y += beta
    return np.clip(y, 0, 1, out=y)


@register("HardSigmoid", since=1)
def hard_sigmoid(
    x: np.ndarray,
    *,
    alpha: float = 0.20000000298023224,  # float32(0.2)
    beta: float = 0.5,
    consumed_inputs: list[int] | None = None,
) -> np.ndarray:
    """max(0, min(1, alpha x + beta))."""
    return _apply(_hard_sigmoid, x, alpha, beta)


def _hard_swish(v: np.ndarray) -> np.ndarray:
    y = _hard_sigmoid(v, v.dtype.type(1 / 6), 0.5)
    y *= v
    return y


@register("HardSwish", since=14)
def hard_swish(x: np.ndarray) -> np.ndarray:
    """x * max(0, min(1, x / 6 + 1 / 2))."""
    return _apply(_hard_swish, x)


@register("ThresholdedRelu", since=10)
def thresholded_relu(x: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    """x where x > alpha, 0 elsewhere (compared exactly: alpha is not rounded to x's type)."""
    v = x.astype(np.float64) if x.dtype.kind == "f" or x.dtype.itemsize < 4 else x
    return _narrow(np.where(v > alpha, x, x.dtype.type(0)), x.dtype)


def _shrink(v: np.ndarray, bias: float, lambd: float) -> np.ndarray:
    return np.where(v < -lambd, v + bias, np.where(v > lambd, v - bias, 0))


@register("Shrink", since=9)
def shrink(x: np.ndarray, *, bias: float = 0.0, lambd: float = 0.5) -> np.ndarray:
    """x + bias below -lambd, x - bias above lambd, 0 between (integer inputs too)."""
    if x.dtype.kind in "iu":
        return _narrow(_shrink(x.astype(np.float64), bias, lambd), x.dtype)
    return _apply(_shrink, x, bias, lambd)


def _softplus(v: np.ndarray) -> np.ndarray:
    """log(1 + exp(v)) without overflow: max(v, 0) + log1p(exp(-|v|))."""
    t = np.abs(v)
    np.negative(t, out=t)
    np.exp(t, out=t)
    np.log1p(t, out=t)
    t += np.maximum(v, 0)
    return t


@register("Softplus", since=1)
def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x))."""
    return _apply(_softplus, x)


def _softsign(v: np.ndarray) -> np.ndarray:
    d = np.abs(v)
    d += 1
    return np.divide(v, d, out=d)


@register("Softsign", since=1)
def softsign(x: np.ndarray) -> np.ndarray:
    """x / (1 + |x|)."""
    return _apply(_softsign, x)


def _mish(v: np.ndarray) -> np.ndarray:
    y = _softplus(v)
    np.tanh(y, out=y)
    y *= v
    return y


@register("Mish", since=18)
def mish(x: np.ndarray) -> np.ndarray:
    """x * tanh(softplus(x))."""
    return _apply(_mish, x)


def _gelu(v: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":  # tanh(sqrt(2 / pi) (x + 0.044715 x^3))
        y = v * v
        y *= 0.044715
        y += 1
        y *= v
        y *= 0.7978845608028654
        np.tanh(y, out=y)
    else:  # erf(x / sqrt(2))
        y = _erf(v * v.dtype.type(0.7071067811865476))
    y += 1
    y *= v
    y *= 0.5
    return y


@register("Gelu", since=20)
def gelu(x: np.ndarray, *, approximate: str = "none") -> np.ndarray:
    """x Phi(x) with the exact erf form (``none``) or the tanh approximation (``tanh``)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"Gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return _apply(_gelu, x, approximate)


# ---------------------------------------------------------------------------------------------
# Binary arithmetic, comparison and logic (multidirectional broadcasting)


def _legacy_b(a: np.ndarray, b: np.ndarray, broadcast: int, axis: int | None) -> np.ndarray:
    """Opset 1-6 ``broadcast=1, axis=k``: ``b``'s dims line up with ``a``'s from axis k on."""
    if broadcast and axis is not None and 0 < b.ndim < a.ndim:
        axis = axis + a.ndim if axis < 0 else axis
        trailing = a.ndim - axis - b.ndim
        if trailing < 0:
            raise ValueError(f"axis={axis} puts B of shape {b.shape} outside A of shape {a.shape}")
        b = b.reshape(b.shape + (1,) * trailing)
    return b


def _binary(fn: Callable, name: str) -> Callable:
    """A kernel applying ``fn(a, b)`` that also accepts the opset 1-6 broadcast attributes."""

    def kernel(
        a: np.ndarray,
        b: np.ndarray,
        *,
        broadcast: int = 0,
        axis: int | None = None,
        consumed_inputs: list[int] | None = None,
    ) -> np.ndarray:
        if axis is not None:
            b = _legacy_b(a, b, broadcast, axis)
        with np.errstate(all="ignore"):
            return _arr(fn(a, b))

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"Elementwise {name} with numpy broadcasting."
    return kernel


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Float division, or integer division truncating toward zero (C semantics, as ONNX)."""
    if a.dtype.kind == "i":
        q = np.floor_divide(a, b)
        # floor and trunc differ where the remainder is nonzero and the signs differ
        q += (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
        return q
    if a.dtype.kind == "u":
        return np.floor_divide(a, b)
    return np.true_divide(a, b)


_BINARY = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": _div,
    "Equal": np.equal,
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
    "Less": np.less,
    "LessOrEqual": np.less_equal,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Xor": np.logical_xor,
    "BitwiseAnd": np.bitwise_and,
    "BitwiseOr": np.bitwise_or,
    "BitwiseXor": np.bitwise_xor,
}
# the kernels by op name: the cuda tree runs some of them on the host (strings)
BINARY_KERNELS = {_op: register(_op, since=1)(_binary(_fn, _op)) for _op, _fn in _BINARY.items()}


@register("Pow", since=1)
def pow_(
    x: np.ndarray, y: np.ndarray, *, broadcast: int = 0, axis: int | None = None
) -> np.ndarray:
    """x ** y in x's dtype (the exponent may be of another numeric type)."""
    if axis is not None:
        y = _legacy_b(x, y, broadcast, axis)
    with np.errstate(all="ignore"):
        if x.dtype.kind in "iu":
            if y.dtype.kind in "iu" and (y.size == 0 or y.min() >= 0):
                return _arr(np.power(x, y.astype(x.dtype, copy=False)))
            return _narrow(np.power(x.astype(np.float64), y.astype(np.float64)), x.dtype)
        if y.size == 1 and y.ndim <= x.ndim:
            e = float(y.reshape(-1)[0])
            if e in (2.0, 3.0):  # x^2 in LayerNorm, x^3 in tanh-Gelu; onnxruntime multiplies too
                return _apply(np.square if e == 2.0 else _cube, x)
        # a double exponent is applied in double, as std::pow(double, double) would
        t = np.float64 if np.float64 in (x.dtype, y.dtype) else np.float32
        return _narrow(np.power(x.astype(t, copy=False), y.astype(t, copy=False)), x.dtype)


def _cube(v: np.ndarray) -> np.ndarray:
    y = np.square(v)  # powf is ~50x slower than this for negative bases
    y *= v
    return y


@register("Mod", since=10)
def mod(a: np.ndarray, b: np.ndarray, *, fmod: int = 0) -> np.ndarray:
    """Remainder with the divisor's sign (``fmod=0``) or the dividend's (``fmod=1``, C fmod)."""
    if fmod not in (0, 1):
        raise ValueError(f"Mod fmod must be 0 or 1, got {fmod}")
    with np.errstate(all="ignore"):
        return _arr(np.fmod(a, b) if fmod else np.remainder(a, b))


@register("BitShift", since=11)
def bit_shift(x: np.ndarray, y: np.ndarray, *, direction: str) -> np.ndarray:
    """Shift ``x`` left or right by ``y`` bits; shifts outside [0, bits) give the sign fill."""
    bits = x.dtype.itemsize * 8
    out_of_range = (y < 0) | (y >= bits)
    amount = np.where(out_of_range, 0, y).astype(x.dtype)
    if direction == "LEFT":
        unsigned = np.dtype(f"u{x.dtype.itemsize}")
        # shift the bit pattern unsigned: bits moved past the sign bit are dropped, no overflow
        r = np.left_shift(x.view(unsigned), amount.view(unsigned)).view(x.dtype)
        fill = x.dtype.type(0)
    elif direction == "RIGHT":
        r = np.right_shift(x, amount)
        fill = np.where(x < 0, x.dtype.type(-1), x.dtype.type(0)) if x.dtype.kind == "i" else 0
    else:
        raise ValueError(f"BitShift direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    return _narrow(np.where(out_of_range, fill, r), x.dtype)


# ---------------------------------------------------------------------------------------------
# Variadic, Where, Clip


def _fold(ufunc: Callable, inputs: tuple[np.ndarray, ...], op: str) -> np.ndarray:
    """``ufunc`` folded over ``inputs`` with broadcasting, writing into one fresh result."""
    if not inputs:
        raise ValueError(f"{op} needs at least one input")
    out = _arr(ufunc(inputs[0], inputs[1])) if len(inputs) > 1 else inputs[0].copy()
    for x in inputs[2:]:
        if np.broadcast_shapes(out.shape, x.shape) == out.shape:
            ufunc(out, x, out=out)
        else:
            out = ufunc(out, x)
    return out


@register("Max", since=1)
def max_(*data: np.ndarray, consumed_inputs: list[int] | None = None) -> np.ndarray:
    """Elementwise maximum of all inputs (NaN propagates)."""
    return _fold(np.maximum, data, "Max")


@register("Min", since=1)
def min_(*data: np.ndarray, consumed_inputs: list[int] | None = None) -> np.ndarray:
    """Elementwise minimum of all inputs (NaN propagates)."""
    return _fold(np.minimum, data, "Min")


@register("Sum", since=1)
def sum_(*data: np.ndarray, consumed_inputs: list[int] | None = None) -> np.ndarray:
    """Elementwise sum of all inputs."""
    return _fold(np.add, data, "Sum")


@register("Mean", since=1)
def mean(*data: np.ndarray, consumed_inputs: list[int] | None = None) -> np.ndarray:
    """Elementwise mean of all inputs."""
    out = _fold(np.add, data, "Mean")
    if out.dtype.kind in "iu":
        return _arr(out // len(data))
    out /= out.dtype.type(len(data))
    return out


@register("Where", since=9)
def where(condition: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x where ``condition`` holds, y elsewhere (all three broadcast)."""
    return _arr(np.where(condition, x, y))


def _clip(x: np.ndarray, lo, hi) -> np.ndarray:
    """min(max(x, lo), hi): where lo > hi everything becomes hi, as ONNX specifies."""
    if lo is not None and hi is not None:
        return _arr(np.clip(x, lo, hi))  # one pass, same min(max()) order
    if lo is not None:
        return _arr(np.maximum(x, lo))
    return _arr(np.minimum(x, hi)) if hi is not None else x.copy()


@register("Clip")
def clip(
    x: np.ndarray,
    min: np.ndarray | float | None = None,  # ONNX's names, of the inputs and the old attributes
    max: np.ndarray | float | None = None,
    *,
    consumed_inputs: list[int] | None = None,
    _opset: int = CLIP_BOUNDS_AS_INPUTS,
) -> np.ndarray:
    """min(max(x, min), max): the bounds are optional scalar inputs from opset 11 on, float
    attributes before."""
    if _opset < CLIP_BOUNDS_AS_INPUTS:
        t = x.dtype.type
        return _clip(x, None if min is None else t(min), None if max is None else t(max))
    for name, bound in (("min", min), ("max", max)):
        if bound is not None:
            check_clip_bound(name, bound.size, bound.shape)
    lo = None if min is None else min.reshape(()).astype(x.dtype, copy=False)
    hi = None if max is None else max.reshape(()).astype(x.dtype, copy=False)
    return _clip(x, lo, hi)
