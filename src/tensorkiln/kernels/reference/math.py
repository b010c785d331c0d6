"""Reference kernels for linear algebra, scans, softmax-like ops and arg/top-k selection."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tensorkiln.kernels.common.cast import FLOAT8, dtypes
from tensorkiln.kernels.common.reduce import Selection
from tensorkiln.kernels.registry import register

# Narrow float types are computed in float32 and cast back: numpy has no BLAS for them and
# accumulating in them loses precision the oracle cannot afford.
_NARROW_FLOATS = FLOAT8 | dtypes(np.float16, ml_dtypes.bfloat16, ml_dtypes.float4_e2m1fn)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype to compute in for inputs of ``dtype`` (float32 for narrow floats)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in _NARROW_FLOATS else dtype


def widen(x: np.ndarray) -> np.ndarray:
    """``x`` in its compute dtype (no copy when it already is)."""
    return x.astype(compute_dtype(x.dtype), copy=False)


def _axis_of(axis: np.ndarray | int, ndim: int) -> int:
    a = int(np.asarray(axis).reshape(-1)[0])
    if not -max(ndim, 1) <= a < max(ndim, 1):
        raise ValueError(f"axis {a} is out of range for a tensor of rank {ndim}")
    return a % max(ndim, 1)


# ---------------------------------------------------------------- matrix products


@register("MatMul", since=1)
def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """numpy.matmul semantics (1-D operands promoted and squeezed, batch dims broadcast)."""
    if a.dtype in _NARROW_FLOATS:
        return np.matmul(widen(a), widen(b)).astype(a.dtype)
    return np.matmul(a, b)


# Gemm: reference/fused_gemm.py, beside GemmAct (kernels/common/gemm.py writes both once).


# MatMulInteger: reference/quant.py, beside QLinearMatMul (kernels/common/quant.py writes
# both).


@register("Einsum", since=12)
def einsum(*inputs: np.ndarray, equation: str) -> np.ndarray:
    """numpy.einsum with the same implicit-output rule as ONNX (letters in alphabetical order)."""
    eq = equation.replace(" ", "")
    dtype = inputs[0].dtype
    args = [widen(x) for x in inputs]
    y = np.einsum(eq, *args, optimize=len(args) > 1)
    return np.asarray(y).astype(dtype, copy=False)


@register("Det", since=11)
def det(x: np.ndarray) -> np.ndarray:
    """Determinant of the last two dims."""
    wide = x.astype(np.float64) if x.dtype in _NARROW_FLOATS else x
    return np.asarray(np.linalg.det(wide)).astype(x.dtype, copy=False)


# ---------------------------------------------------------------- scans


def _scan(
    x: np.ndarray, axis, exclusive: int, reverse: int, ufunc: np.ufunc, identity: int
) -> np.ndarray:
    ax = _axis_of(axis, x.ndim)
    acc = compute_dtype(x.dtype)
    src = np.flip(x, ax) if reverse else x
    y = ufunc.accumulate(src, axis=ax, dtype=acc)
    if exclusive:
        shifted = np.full_like(y, identity)
        dst = [slice(None)] * y.ndim
        dst[ax] = slice(1, None)
        stop = [slice(None)] * y.ndim
        stop[ax] = slice(0, -1)
        shifted[tuple(dst)] = y[tuple(stop)]
        y = shifted
    if reverse:
        y = np.flip(y, ax)
    return np.ascontiguousarray(y, dtype=x.dtype)


@register("CumSum", since=11)
def cumsum(x: np.ndarray, axis: np.ndarray, *, exclusive: int = 0, reverse: int = 0) -> np.ndarray:
    """Cumulative sum along ``axis`` (a scalar tensor input)."""
    return _scan(x, axis, exclusive, reverse, np.add, 0)


@register("CumProd", since=26)
def cumprod(x: np.ndarray, axis: np.ndarray, *, exclusive: int = 0, reverse: int = 0) -> np.ndarray:
    """Cumulative product along ``axis`` (a scalar tensor input)."""
    return _scan(x, axis, exclusive, reverse, np.multiply, 1)


# ---------------------------------------------------------------- softmax family


def _softmax_along(x: np.ndarray, axis: int, log: bool) -> np.ndarray:
    y = np.subtract(x, x.max(axis=axis, keepdims=True), dtype=compute_dtype(x.dtype))
    if log:
        s = np.exp(y).sum(axis=axis, keepdims=True)
        y -= np.log(s, out=s)
    else:
        np.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
    return y.astype(x.dtype, copy=False)


def _coerced_2d(fn, x: np.ndarray, axis: int) -> np.ndarray:
    # Opset < 13: flatten to [prod(shape[:axis]), prod(shape[axis:])] and work along dim 1.
    ax = _axis_of(axis, x.ndim) if x.ndim else 0
    rows = int(np.prod(x.shape[:ax], dtype=np.int64))
    flat = x.reshape(rows, -1) if x.size else x.reshape(rows, int(np.prod(x.shape[ax:])))
    return fn(flat, 1).reshape(x.shape)


def _hardmax_along(x: np.ndarray, axis: int) -> np.ndarray:
    idx = np.expand_dims(np.argmax(x, axis=axis), axis)
    y = np.zeros_like(x)
    np.put_along_axis(y, idx, 1, axis=axis)
    return y


# Before opset 13 these ops work on the input coerced to 2-D at ``axis`` (and the default axis is 1,
# which the op's record gives); from 13 on, along ``axis`` itself.
_AXIS_ONLY = 13


@register("Softmax")
def softmax(x: np.ndarray, *, axis: int = -1, _opset: int = _AXIS_ONLY) -> np.ndarray:
    """Numerically stable softmax along ``axis`` (over the 2-D view before opset 13)."""
    if _opset < _AXIS_ONLY:
        return _coerced_2d(lambda t, a: _softmax_along(t, a, log=False), x, axis)
    return _softmax_along(x, _axis_of(axis, x.ndim), log=False)


@register("LogSoftmax")
def log_softmax(x: np.ndarray, *, axis: int = -1, _opset: int = _AXIS_ONLY) -> np.ndarray:
    """Numerically stable log-softmax along ``axis`` (over the 2-D view before opset 13)."""
    if _opset < _AXIS_ONLY:
        return _coerced_2d(lambda t, a: _softmax_along(t, a, log=True), x, axis)
    return _softmax_along(x, _axis_of(axis, x.ndim), log=True)


@register("Hardmax")
def hardmax(x: np.ndarray, *, axis: int = -1, _opset: int = _AXIS_ONLY) -> np.ndarray:
    """One-hot of the first maximum along ``axis`` (of each row of the 2-D view before 13)."""
    if _opset < _AXIS_ONLY:
        return _coerced_2d(_hardmax_along, x, axis)
    return _hardmax_along(x, _axis_of(axis, x.ndim))


# ---------------------------------------------------------------- selection


class NumpySelectionArrays:
    """:class:`tensorkiln.kernels.common.reduce.SelectionArrays` on numpy arrays."""

    def host_int(self, v: np.ndarray) -> int:
        return int(np.asarray(v).reshape(-1)[0])

    def arg_reduce(self, x: np.ndarray, axis: int, keepdims: int, last: int, largest: bool):
        fn = np.argmax if largest else np.argmin
        if last:
            idx = x.shape[axis] - 1 - fn(np.flip(x, axis), axis=axis)
        else:
            idx = fn(x, axis=axis)
        if keepdims:
            idx = np.expand_dims(idx, axis)
        return np.asarray(idx, dtype=np.int64)

    def topk(self, x: np.ndarray, axis: int, k: int, largest: int) -> tuple[np.ndarray, np.ndarray]:
        n = x.shape[axis]
        if largest:
            # Stable ascending sort of the flipped data, read backwards: descending values, and
            # equal values in increasing original index. Works for unsigned and bool (no negation).
            order = np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
            idx = (n - 1) - np.take(order, np.arange(k), axis=axis)
        else:
            idx = np.take(np.argsort(x, axis=axis, kind="stable"), np.arange(k), axis=axis)
        idx = idx.astype(np.int64, copy=False)
        return np.take_along_axis(x, idx, axis=axis), idx


_SELECTION = Selection(NumpySelectionArrays())
register("ArgMax", since=1)(_SELECTION.argmax)
register("ArgMin", since=1)(_SELECTION.argmin)
register("TopK", since=1)(_SELECTION.topk)
