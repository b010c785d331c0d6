"""tensorkiln.GemmAct: Gemm or MatMul with a 2-D weight, + bias + activation, in one kernel.

``Y = act(alpha * A' @ B' + beta * C)``. A of rank 2 is Gemm's A (``transA`` allowed, C broadcast
to (M, N) as Gemm does); A of higher rank is MatMul's, its leading dims folded into the rows
(``transA`` must be 0, C broadcast along the last axis only). The GEMM writes a fresh array and the
epilogue (scale, bias, activation) runs in place on blocks of rows while they are in cache.
"""

from __future__ import annotations

import math

import numpy as np

from tensorkiln.kernels.common.fused import check_gemm_bias, check_gemm_operands
from tensorkiln.kernels.reference._window import compute_dtype
from tensorkiln.kernels.reference.fused_conv import activate
from tensorkiln.kernels.registry import register
from tensorkiln.ops.fused import check_activation

_BLOCK = 1 << 16  # elements per epilogue block (256 KiB of float32)


def _operands(a: np.ndarray, b: np.ndarray, trans_a: int, trans_b: int) -> tuple:
    check_gemm_operands(a.shape, b.shape, trans_a, trans_b)
    ct = compute_dtype(a.dtype)
    # rows given explicitly: reshape(-1, 0) cannot infer them when K=0
    a2 = a.reshape(math.prod(a.shape[:-1]), a.shape[-1]).astype(ct, copy=False)
    a2 = a2.T if trans_a else a2
    b2 = b.astype(ct, copy=False)
    b2 = b2.T if trans_b else b2
    return a2, b2


def _bias(c: np.ndarray | None, beta: float, y: np.ndarray, rank: int) -> np.ndarray | None:
    if c is None or beta == 0.0:
        return None
    c = c.astype(y.dtype, copy=False)
    if beta != 1.0:
        c = c * y.dtype.type(beta)
    check_gemm_bias(c.shape, y.shape[1], rank)
    if rank > 2:  # MatMul form: along the last axis only
        c = c.reshape(-1)
    return np.broadcast_to(c, y.shape)


@register("GemmAct", domain="tensorkiln", since=1)
def gemm_act(
    a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    transA: int = 0,
    transB: int = 0,
    activation: str = "",
    activation_alpha: float | None = None,  # None: the op's default (LeakyRelu 0.01, ...)
    activation_beta: float | None = None,
    activation_min: float | None = None,
    activation_max: float | None = None,
) -> np.ndarray:
    """act(alpha * A' @ B' + beta * C), leading dims of A kept."""
    check_activation(activation, "GemmAct")
    a2, b2 = _operands(a, b, transA, transB)
    y = np.matmul(a2, b2)
    if alpha != 1.0:
        y *= y.dtype.type(alpha)
    cb = _bias(c, beta, y, a.ndim)
    act = (activation, activation_alpha, activation_beta, activation_min, activation_max)
    step = max(1, _BLOCK // max(y.shape[1], 1))
    for r0 in range(0, y.shape[0], step):
        blk = y[r0 : r0 + step]
        if cb is not None:
            blk += cb[r0 : r0 + step]
        activate(blk, *act)
    shape = (*a.shape[:-1], b2.shape[1]) if a.ndim > 2 else y.shape
    return y.reshape(shape).astype(a.dtype, copy=False)
