"""tensorkiln.QConvAct and QGemmAct on the cuda backend: exact sums of the quantized products.

The products of int8 or float8 (E4M3) operands are summed in float64 here, where every such sum
is exact (the reference kernels' contract; an int32 accumulator holds the same values), then
scaled per output channel and finished in float32 with ConvAct's and GemmAct's epilogues. These
are the kernels every graph with quantized layers can run with; the tensor-core tactics (int8
GEMMs through torch._int_mm, FP8 through torch._scaled_mm, Triton implicit-GEMM convolutions)
are timed against them by the autotuner.
"""

from __future__ import annotations

import math

import torch

from tensorkiln.kernels.common.conv import check_conv_act
from tensorkiln.kernels.common.gemm import gemm_layout
from tensorkiln.kernels.cuda.fused_conv import activate_, conv_epilogue_, geometry_of
from tensorkiln.kernels.cuda.nn import conv_nd
from tensorkiln.kernels.registry import register

_QUANTIZED = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def _exact(q: torch.Tensor, what: str) -> torch.Tensor:
    if q.dtype not in _QUANTIZED:
        raise ValueError(f"{what} must be int8 or float8, got {q.dtype}")
    return q.to(torch.float64)


def _scales(x_scale: torch.Tensor, w_scale: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """X_scale * W_scale per output channel, float64, shape (n,)."""
    if x_scale.numel() != 1:
        raise ValueError(
            f"{what}: the activation's scale must be one value, got {tuple(x_scale.shape)}"
        )
    ws = w_scale.reshape(-1).to(torch.float64)
    if ws.numel() not in (1, n):
        raise ValueError(
            f"{what}: the weight's scale has {ws.numel()} values; it needs 1 or one per output "
            f"channel ({n})"
        )
    return (x_scale.reshape(()).to(torch.float64) * ws).expand(n)


@register("QConvAct", domain="tensorkiln", since=1, backend="cuda")
def qconv_act(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    b: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
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
) -> torch.Tensor:
    """act(conv(X_q, W_q) * X_scale * W_scale + B + Z) (or act(...) + Z), computed in float32,
    returned in ``out_dtype``."""
    b_size = None if b is None else b.numel()
    check_conv_act(tuple(x_q.shape), tuple(w_q.shape), b_size, group, activation, residual_order)
    g = geometry_of(x_q, w_q, auto_pad, dilations, kernel_shape, pads, strides)
    acc = conv_nd(_exact(x_q, "QConvAct's X"), _exact(w_q, "QConvAct's W"), None, g, group)
    m = acc.shape[1]
    scale = _scales(x_scale, w_scale, m, "QConvAct").reshape(1, m, *(1,) * (acc.ndim - 2))
    y = (acc * scale).to(torch.float32)
    bias = None if b is None else b.reshape(m).to(torch.float32)
    act = (activation_alpha, activation_beta, activation_min, activation_max)
    zz = None if z is None else z.to(torch.float32)
    return as_out(conv_epilogue_(y, bias, zz, activation, act, residual_order == "act_add"),
                  out_dtype)  # fmt: skip


_OUT = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16}


def as_out(y: torch.Tensor, out_dtype: int) -> torch.Tensor:
    """``y`` (float32) in the layer's output type (ONNX's code)."""
    want = _OUT.get(int(out_dtype))
    if want is None:
        raise ValueError(
            f"quantized layers output float32, float16 or bfloat16, not type {out_dtype}"
        )
    return y if y.dtype == want else y.to(want)


@register("QGemmAct", domain="tensorkiln", since=1, backend="cuda")
def qgemm_act(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    c: torch.Tensor | None = None,
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
) -> torch.Tensor:
    """act(alpha * (A_q' @ B_q') * A_scale * B_scale + beta * C), computed in float32, returned
    in ``out_dtype``."""
    a2, b2, bias = gemm_layout(a_q, b_q, c, beta, transA, transB, "QGemmAct")
    acc = torch.mm(_exact(a2, "QGemmAct's A"), _exact(b2, "QGemmAct's B"))
    n = acc.shape[1]
    y = (acc * (alpha * _scales(a_scale, b_scale, n, "QGemmAct"))).to(torch.float32)
    if bias is not None:
        y.add_(bias.to(torch.float32), alpha=beta)
    if activation and math.prod(y.shape):
        activate_(y, activation, activation_alpha, activation_beta, activation_min, activation_max)
    y = as_out(y, out_dtype)
    return y if a_q.ndim == 2 else y.reshape(*a_q.shape[:-1], n)
