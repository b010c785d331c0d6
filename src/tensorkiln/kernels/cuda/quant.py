"""Linear quantization on the device: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear,
QLinearMatMul, bit-exact with the reference.

Scales and zero points are per-tensor, per-axis or blocked. Rounding is half to even
(``torch.round``). The 2/4/6-bit types have no torch dtype, so their values live on the host as
numpy arrays: dequantizing them uploads the codes widened to int8/float32 (they are weights, on the
host already), and quantizing to them runs the reference kernel on host copies. QLinearMatMul is
kernels/common/quant.py's, over torch operations. QuantizeLinear with one float32 scale (every
activation an INT8/FP8 engine quantizes) runs as one Triton kernel (kernels/triton/quantize.py),
the same values in one pass instead of six.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch
from onnx import TensorProto
from onnx.helper import tensor_dtype_to_np_dtype

from tensorkiln.kernels import triton as tk_triton
from tensorkiln.kernels.common.quant import QLinearMatMul, quant_target, scale_layout
from tensorkiln.kernels.cuda.convert import (
    numpy_dtype,
    on_device,
    to_numpy,
    to_torch,
    torch_dtype,
)
from tensorkiln.kernels.reference import quant as reference
from tensorkiln.kernels.registry import register

if tk_triton.available():  # (QuantizeLinear of one scale in one pass)
    from tensorkiln.kernels.triton import quantize as one_pass
else:
    one_pass = None

Value = torch.Tensor | np.ndarray

_INT_RANGES = {
    torch.uint8: (0, 255),
    torch.int8: (-128, 127),
    torch.uint16: (0, 65535),
    torch.int16: (-32768, 32767),
}
_FLOAT8 = {
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e4m3fnuz: ml_dtypes.float8_e4m3fnuz,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
    torch.float8_e5m2fnuz: ml_dtypes.float8_e5m2fnuz,
}


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the narrow floats (and for 8-bit values), else ``dtype`` itself."""
    if dtype in (torch.float16, torch.bfloat16) or dtype in _FLOAT8:
        return torch.float32
    return dtype


def _on_device(v: Value, device: torch.device) -> torch.Tensor:
    """A value as a device tensor; host-only (2/4/6-bit) arrays are uploaded widened, exactly."""
    if isinstance(v, torch.Tensor):
        return v
    wide = np.int8 if v.dtype.kind in "iu" or "int" in v.dtype.name else np.float32
    return to_torch(v.astype(wide), device)


def _broadcastable(
    v: torch.Tensor, shape: tuple[int, ...], axis: int, block_size: int, what: str
) -> torch.Tensor:
    """``v`` (a scale or zero point) reshaped or repeated to broadcast against ``shape``."""
    kind, axis, dims = scale_layout(tuple(v.shape), shape, axis, block_size, what)
    if kind == "tensor":
        return v.reshape(())
    if kind == "axis":
        return v.reshape(dims)
    return v.repeat_interleave(block_size, dim=axis).narrow(axis, 0, shape[axis])


def _float8_cast(q: torch.Tensor, target: torch.dtype, saturate: bool) -> torch.Tensor:
    """Cast to a float8 type as ml_dtypes does: torch saturates float8_e4m3fn's overflow, the
    reference (and the spec, with saturate=0) gives NaN."""
    if q.dtype not in (torch.float32, torch.float64):
        q = q.to(torch.float32)
    fmax = float(ml_dtypes.finfo(_FLOAT8[target]).max)
    if saturate:
        return q.clamp(-fmax, fmax).to(target)
    out = q.to(target)
    if target == torch.float8_e4m3fn:  # values rounding past 448 (ties at 464 round down) are NaN
        nan = torch.full((), math.nan, dtype=target, device=q.device)
        out = torch.where(q.abs() > 464, nan, out)
    return out


def _saturate_cast(q: torch.Tensor, target: torch.dtype, saturate: bool) -> torch.Tensor:
    """Cast an (already rounded for integer targets) float tensor to ``target``, clipping it to the
    target's range (float8 only when ``saturate``)."""
    if target in _INT_RANGES:
        lo, hi = _INT_RANGES[target]
        return q.clamp(lo, hi).to(target)
    return _float8_cast(q, target, saturate)


def _quant_target(zero_point: Value | None, output_dtype: int) -> np.dtype:
    if zero_point is None:
        return quant_target(None, output_dtype)
    dtype = zero_point.dtype
    return quant_target(
        numpy_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype, output_dtype
    )


@register("QuantizeLinear", since=10, backend="cuda")
def quantize_linear(
    x: torch.Tensor,
    y_scale: torch.Tensor,
    y_zero_point: Value | None = None,
    *,
    axis: int = 1,
    saturate: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
    precision: int = 0,
) -> Value:
    """y = saturate(round(x / y_scale) + y_zero_point), the division in ``precision``
    (default: y_scale's type)."""
    attrs = dict(axis=axis, saturate=saturate, block_size=block_size, output_dtype=output_dtype,
                 precision=precision)  # fmt: skip
    target_np = _quant_target(y_zero_point, output_dtype)
    if not on_device(target_np):  # 2/4/6-bit results live on the host
        return reference.quantize_linear(
            to_numpy(x), to_numpy(y_scale), to_numpy(y_zero_point), **attrs
        )
    target = torch_dtype(target_np)
    if target not in _INT_RANGES and target not in _FLOAT8:
        raise ValueError(f"QuantizeLinear cannot quantize to {target_np}")
    zp = y_zero_point if isinstance(y_zero_point, torch.Tensor) else None
    if (
        one_pass is not None
        and precision in (0, TensorProto.FLOAT)
        and (y_zero_point is None or zp is not None)
        and (x.is_cuda or tk_triton.interpreting())
        and one_pass.applies(x, y_scale, zp, target, bool(saturate))
    ):
        return one_pass.quantize(x, y_scale, zp, target)
    div = torch_dtype(tensor_dtype_to_np_dtype(precision)) if precision else y_scale.dtype
    shape = tuple(x.shape)
    scale = _broadcastable(y_scale, shape, axis, block_size, "y_scale")
    q = x.to(div) / scale.to(div)
    # rounding and adding the zero point in float32 is exact for every integer target
    q = q.to(_compute_dtype(q.dtype))
    if target in _INT_RANGES:
        q = torch.round(q)
    if y_zero_point is not None:
        zp = _broadcastable(y_zero_point, shape, axis, block_size, "y_zero_point").to(q.dtype)
        # adding a zero zero-point is skipped, so float8's -0 stays -0
        q = torch.where(zp == 0, q, q + zp)
    return _saturate_cast(q, target, bool(saturate))


@register("DequantizeLinear", since=10, backend="cuda")
def dequantize_linear(
    x: Value,
    x_scale: torch.Tensor,
    x_zero_point: Value | None = None,
    *,
    axis: int = 1,
    block_size: int = 0,
    output_dtype: int = 0,
) -> torch.Tensor:
    """y = (x - x_zero_point) * x_scale, in ``output_dtype`` (default: x_scale's type)."""
    if output_dtype:
        out = torch_dtype(tensor_dtype_to_np_dtype(output_dtype))
    else:
        out = x_scale.dtype
    # float32 holds every 2-16 bit integer and float8/6/4 value exactly; int32 needs float64
    is_int32 = isinstance(x, torch.Tensor) and x.dtype == torch.int32
    wide = torch.float64 if is_int32 else _compute_dtype(out)
    shape = tuple(x.shape)
    dx = _on_device(x, x_scale.device).to(wide)
    if x_zero_point is not None:  # subtracting a zero keeps -0 (x - 0 == x), no test needed
        zp = _on_device(x_zero_point, x_scale.device)
        dx = dx - _broadcastable(zp, shape, axis, block_size, "x_zero_point").to(wide)
    dx = dx * _broadcastable(x_scale, shape, axis, block_size, "x_scale").to(wide)
    return dx.to(out)


@register("DynamicQuantizeLinear", since=11, backend="cuda")
def dynamic_quantize_linear(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize to uint8 with a scale and zero point from the range of ``x`` (including 0)."""
    x = x.to(torch.float32)
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    if x.numel():
        hi, lo = torch.maximum(x.amax(), zero), torch.minimum(x.amin(), zero)
    else:
        hi = lo = zero
    # as onnxruntime: an all-zero input gets scale 1 rather than a division by zero
    scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 255)
    zp = torch.round(torch.clamp(zero - lo / scale, 0, 255))
    y = torch.clamp(torch.round(x / scale) + zp, 0, 255).to(torch.uint8)
    return y, scale, zp.to(torch.uint8)


class TorchQuantArrays:
    """:class:`tensorkiln.kernels.common.quant.QuantArrays` on torch tensors."""

    m = torch
    float64, int32 = torch.float64, torch.int32

    def astype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    def is_integer_target(self, dtype: torch.dtype) -> bool:
        return dtype in _INT_RANGES

    def add_zero_point(self, y: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
        zp = zero_point.to(torch.float64)  # (no host read of the zero point)
        return torch.where(zp == 0, y, y + zp)

    def saturate(self, y: torch.Tensor, target: torch.dtype) -> torch.Tensor:
        return _saturate_cast(y, target, True)


_MATMUL = QLinearMatMul(TorchQuantArrays())
register("QLinearMatMul", since=10, backend="cuda")(_MATMUL.qlinear_matmul)
register("MatMulInteger", since=10, backend="cuda")(_MATMUL.matmul_integer)
