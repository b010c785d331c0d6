"""tensorkiln.QConvAct and QGemmAct: quantized convolution and GEMM with a float epilogue.

The operands are quantized symmetrically: X (or A) per tensor, W (or B) per output channel, in
int8 or float8 (E4M3). The products are summed exactly: every int8 or E4M3 value and every
product of two is exact in float64, and so are sums of up to 2**35 int8 products, which is what
an integer accumulator (int32 on the GPU) holds. The sum is then scaled by ``X_scale * W_scale``
per channel and finished in float32 as ConvAct and GemmAct finish theirs (bias, residual,
activation). With an output scale (Y_scale, the last input) the float32 result is quantized to it
(int8 or E4M3, out_dtype 3 or 17): the QuantizeLinear of the next quantized layer's input, fused
(passes/fuse_qdq.py's fuse_requantize).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from onnx.helper import tensor_dtype_to_np_dtype

from tensorkiln.kernels.common.quant import check_quantized_output, check_quantized_residual
from tensorkiln.kernels.reference.fused_conv import _epilogue, activate, conv_act
from tensorkiln.kernels.reference.fused_gemm import gemm_act
from tensorkiln.kernels.reference.pool import max_pool
from tensorkiln.kernels.reference.quant import quantize_linear
from tensorkiln.kernels.registry import register
from tensorkiln.ops.fused import conv_attrs, pool_attrs

_QUANTIZED = frozenset(
    np.dtype(t) for t in (np.int8, np.uint8, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
)


def _exact(q: np.ndarray, what: str) -> np.ndarray:
    if q.dtype not in _QUANTIZED:
        raise ValueError(f"{what} must be int8 or float8, got {q.dtype}")
    return q.astype(np.float64)


def _scales(x_scale: np.ndarray, w_scale: np.ndarray, channels: int, what: str) -> np.ndarray:
    """X_scale * W_scale per output channel, in float64."""
    xs = np.asarray(x_scale, np.float64)
    ws = np.asarray(w_scale, np.float64).reshape(-1)
    if xs.size != 1:
        raise ValueError(f"{what}: the activation's scale must be one value, got shape {xs.shape}")
    if ws.size not in (1, channels):
        raise ValueError(
            f"{what}: the weight's scale has {ws.size} values; it needs 1 or one per output "
            f"channel ({channels})"
        )
    return np.broadcast_to(xs.reshape(()) * ws, (channels,))


@register("QConvAct", domain="tensorkiln", since=1)
def qconv_act(
    x_q: np.ndarray,
    x_scale: np.ndarray,
    w_q: np.ndarray,
    w_scale: np.ndarray,
    b: np.ndarray | None = None,
    z: np.ndarray | None = None,
    y_scale: np.ndarray | None = None,
    z_scale: np.ndarray | None = None,
    *,
    auto_pad: str = "NOTSET",
    dilations=None,
    group: int = 1,
    kernel_shape=None,
    pads=None,
    strides=None,
    activation: str = "",
    activation_alpha: float | None = None,
    activation_beta: float | None = None,
    activation_min: float | None = None,
    activation_max: float | None = None,
    residual_order: str = "add_act",
    out_dtype: int = 1,
) -> np.ndarray:
    """act(conv(X_q, W_q) * X_scale * W_scale + B + Z) (or act(...) + Z), computed in float32,
    returned in ``out_dtype``; with ``y_scale``, quantized to it (:func:`_as_out`); with
    ``z_scale``, Z is quantized and read as DequantizeLinear reads it (:func:`residual`)."""
    acc = conv_act(
        _exact(x_q, "QConvAct's X"),
        _exact(w_q, "QConvAct's W"),
        auto_pad=auto_pad,
        dilations=dilations,
        group=group,
        kernel_shape=kernel_shape,
        pads=pads,
        strides=strides,
    )
    m = acc.shape[1]
    y = np.ascontiguousarray(acc, np.float64).reshape(acc.shape[0], m, -1)
    y *= _scales(x_scale, w_scale, m, "QConvAct")[None, :, None]
    y = y.astype(np.float32)
    if z is not None and tuple(z.shape) != acc.shape:
        raise ValueError(
            f"QConvAct: residual Z of shape {z.shape} must have the output's {acc.shape}"
        )
    bb = None if b is None else b.astype(np.float32).reshape(m)
    zz = None if z is None else residual(z, z_scale).reshape(y.shape)
    act = (activation, activation_alpha, activation_beta, activation_min, activation_max)
    _epilogue(y, bb, zz, act, residual_order == "act_add")
    return _as_out(y.reshape(acc.shape), out_dtype, y_scale)


@register("QConvPool", domain="tensorkiln", since=1)
def qconv_pool(*inputs: np.ndarray | None, **attrs) -> np.ndarray:
    """MaxPool(QConvAct(...)) of QConvAct's inputs (X_q, X_scale, W_q, W_scale, B, no Z,
    Y_scale): the layer's result (quantized to Y_scale where given) pooled with the ``pool_``
    attributes. (Quantizing with a positive scale keeps order, so pooling the quantized values
    gives what quantizing the pooled ones would.)"""
    if len(inputs) > 5 and inputs[5] is not None:
        raise ValueError("QConvPool takes no residual Z")
    y = qconv_act(*inputs, **conv_attrs(attrs))
    return max_pool(y, **pool_attrs(attrs))


def residual(z: np.ndarray, z_scale: np.ndarray | None) -> np.ndarray:
    """A residual as float32: with ``z_scale`` (one value), an int8 or float8 Z times it in
    float32, as DequantizeLinear computes it (zero point 0)."""
    if z_scale is None:
        return z.astype(np.float32)
    check_quantized_residual(z.dtype in _QUANTIZED, str(z.dtype), int(np.size(z_scale)))
    return z.astype(np.float32) * np.asarray(z_scale, np.float32).reshape(())


def _as_out(y: np.ndarray, out_dtype: int, y_scale: np.ndarray | None = None) -> np.ndarray:
    """The float32 result in ``out_dtype``: a float type, or with ``y_scale`` int8 or E4M3,
    ``QuantizeLinear(y, y_scale)`` (saturating, zero point 0): the quantization of the next
    layer's input, fused into this one's epilogue."""
    check_quantized_output(out_dtype, None if y_scale is None else int(np.size(y_scale)))
    if y_scale is None:
        return y if out_dtype == 1 else y.astype(tensor_dtype_to_np_dtype(out_dtype))
    return quantize_linear(y, np.asarray(y_scale, np.float32).reshape(()), output_dtype=out_dtype)


@register("QGemmAct", domain="tensorkiln", since=1)
def qgemm_act(
    a_q: np.ndarray,
    a_scale: np.ndarray,
    b_q: np.ndarray,
    b_scale: np.ndarray,
    c: np.ndarray | None = None,
    y_scale: np.ndarray | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    transA: int = 0,
    transB: int = 0,
    activation: str = "",
    activation_alpha: float | None = None,
    activation_beta: float | None = None,
    activation_min: float | None = None,
    activation_max: float | None = None,
    out_dtype: int = 1,
) -> np.ndarray:
    """act(alpha * (A_q' @ B_q') * A_scale * B_scale + beta * C), computed in float32, returned
    in ``out_dtype``."""
    acc = gemm_act(
        _exact(a_q, "QGemmAct's A"), _exact(b_q, "QGemmAct's B"), transA=transA, transB=transB
    )
    n = acc.shape[-1]
    y = (acc * (alpha * _scales(a_scale, b_scale, n, "QGemmAct"))).astype(np.float32)
    if c is not None:
        y += np.float32(beta) * c.astype(np.float32)
    y = np.ascontiguousarray(y)
    act = (activation, activation_alpha, activation_beta, activation_min, activation_max)
    if math.prod(y.shape):
        activate(y.reshape(-1, n), *act)
    return _as_out(y, out_dtype, y_scale)
