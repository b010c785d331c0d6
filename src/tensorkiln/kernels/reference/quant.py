"""Reference kernels for linear quantization: QuantizeLinear, DequantizeLinear,
DynamicQuantizeLinear, QLinearMatMul.

Scales and zero points are per-tensor (one element), per-axis (1-D, length of ``axis``) or blocked
(same rank as the input, ``ceil(D/block_size)`` along ``axis``). Rounding is half to even.
QLinearMatMul is kernels/common/quant.py's, over numpy.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx.helper import tensor_dtype_to_np_dtype

from tensorkiln.kernels.common.cast import FLOAT8, dtypes
from tensorkiln.kernels.common.quant import QLinearMatMul, quant_target, scale_layout
from tensorkiln.kernels.reference.math import compute_dtype
from tensorkiln.kernels.registry import register

_INT_TARGETS = dtypes(
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    ml_dtypes.uint4,
    ml_dtypes.int4,
    ml_dtypes.uint2,
    ml_dtypes.int2,
)
_FLOAT_TARGETS = FLOAT8 | dtypes(
    ml_dtypes.float4_e2m1fn, ml_dtypes.float6_e2m3fn, ml_dtypes.float6_e3m2fn
)


def _broadcastable(
    v: np.ndarray, shape: tuple[int, ...], axis: int, block_size: int, what: str
) -> np.ndarray:
    """``v`` (a scale or zero point) reshaped or repeated to broadcast against ``shape``."""
    kind, axis, dims = scale_layout(v.shape, shape, axis, block_size, what)
    if kind == "tensor":
        return v.reshape(())
    if kind == "axis":
        return v.reshape(dims)
    return np.repeat(v, block_size, axis=axis)[(slice(None),) * axis + (slice(0, shape[axis]),)]


def _nonzero(zp: np.ndarray | None) -> bool:
    return zp is not None and bool(np.any(zp.astype(np.float32)))


def _saturate_cast(q: np.ndarray, target: np.dtype, saturate: bool) -> np.ndarray:
    """Cast a (fresh, already rounded for integer targets) float array to ``target``, clipping
    it in place to the target's range (float8 only when ``saturate``)."""
    if target in _INT_TARGETS:
        info = ml_dtypes.iinfo(target)
        return np.clip(q, info.min, info.max, out=q).astype(target)
    if q.dtype not in (np.float32, np.float64):
        q = q.astype(np.float32)
    if saturate:
        fmax = float(ml_dtypes.finfo(target).max)
        np.clip(q, -fmax, fmax, out=q)
    return q.astype(target)


def _quant_target(zero_point: np.ndarray | None, output_dtype: int) -> np.dtype:
    target = quant_target(None if zero_point is None else zero_point.dtype, output_dtype)
    if target not in _INT_TARGETS | _FLOAT_TARGETS:
        raise ValueError(f"QuantizeLinear cannot quantize to {target}")
    return target


@register("QuantizeLinear", since=10)
def quantize_linear(
    x: np.ndarray,
    y_scale: np.ndarray,
    y_zero_point: np.ndarray | None = None,
    *,
    axis: int = 1,
    saturate: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
    precision: int = 0,
) -> np.ndarray:
    """y = saturate(round(x / y_scale) + y_zero_point), the division in ``precision``
    (default: y_scale's type)."""
    target = _quant_target(y_zero_point, output_dtype)
    div = np.dtype(tensor_dtype_to_np_dtype(precision)) if precision else y_scale.dtype
    scale = _broadcastable(y_scale, x.shape, axis, block_size, "y_scale")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = x.astype(div, copy=False) / scale.astype(div, copy=False)
        # Rounding and adding the zero point in float32 is exact for every integer target: float32
        # holds all of int16/uint16, and larger values are clipped anyway.
        q = q.astype(compute_dtype(q.dtype), copy=False)
        if target in _INT_TARGETS:
            np.rint(q, out=q)
        if _nonzero(y_zero_point):
            q += _broadcastable(y_zero_point, x.shape, axis, block_size, "y_zero_point").astype(
                q.dtype
            )
        return _saturate_cast(q, target, bool(saturate))


@register("DequantizeLinear", since=10)
def dequantize_linear(
    x: np.ndarray,
    x_scale: np.ndarray,
    x_zero_point: np.ndarray | None = None,
    *,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
) -> np.ndarray:
    """y = (x - x_zero_point) * x_scale, in ``output_dtype`` (default: x_scale's type)."""
    out = np.dtype(tensor_dtype_to_np_dtype(output_dtype)) if output_dtype else x_scale.dtype
    # float32 holds every 2-16 bit integer and float8/6/4 value exactly; int32 needs float64.
    wide = np.dtype(np.float64) if x.dtype == np.int32 else compute_dtype(out)
    dx = x.astype(wide)
    if _nonzero(x_zero_point):  # skipped when zero, so float8's -0 stays -0
        dx -= _broadcastable(x_zero_point, x.shape, axis, block_size, "x_zero_point").astype(wide)
    dx *= _broadcastable(x_scale, x.shape, axis, block_size, "x_scale").astype(wide)
    return dx.astype(out, copy=False)


@register("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize to uint8 with a scale and zero point from the range of ``x`` (including 0)."""
    x = x.astype(np.float32, copy=False)
    hi = np.float32(max(0.0, float(x.max()))) if x.size else np.float32(0)
    lo = np.float32(min(0.0, float(x.min()))) if x.size else np.float32(0)
    # As onnxruntime: an all-zero input gets scale 1 rather than a division by zero.
    scale = np.float32(1.0) if hi == lo else (hi - lo) / np.float32(255)
    zp = np.rint(np.clip(np.float32(0) - lo / scale, 0, 255))
    y = np.clip(np.rint(x / scale) + zp, 0, 255).astype(np.uint8)
    return y, np.asarray(scale, dtype=np.float32), np.asarray(zp, dtype=np.uint8)


class NumpyQuantArrays:
    """:class:`tensorkiln.kernels.common.quant.QuantArrays` on numpy arrays."""

    m = np
    float64, int32 = np.dtype(np.float64), np.dtype(np.int32)

    def astype(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return x.astype(dtype)

    def is_integer_target(self, dtype: np.dtype) -> bool:
        return dtype in _INT_TARGETS

    def add_zero_point(self, y: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
        return y + zero_point.astype(np.float64) if _nonzero(zero_point) else y

    def saturate(self, y: np.ndarray, target: np.dtype) -> np.ndarray:
        return _saturate_cast(y, np.dtype(target), True)


_MATMUL = QLinearMatMul(NumpyQuantArrays())
register("QLinearMatMul", since=10)(_MATMUL.qlinear_matmul)
register("MatMulInteger", since=10)(_MATMUL.matmul_integer)
