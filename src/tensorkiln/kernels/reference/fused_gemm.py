"""Gemm and tensorkiln.GemmAct: a GEMM with its scale, bias and activation, in one kernel.

``Y = act(alpha * A' @ B' + beta * C)``. The entries (signatures, checks, transposes, bias layout,
integer path) are :mod:`tensorkiln.kernels.common.gemm`'s, shared with the cuda tree; this module
supplies the numpy product: narrow floats multiply in float32 (numpy has no BLAS for them), the
GEMM writes a fresh array and the epilogue (bias, activation) runs in place on blocks of rows
while they are in cache.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.kernels.common import bind
from tensorkiln.kernels.common import gemm as common
from tensorkiln.kernels.reference.fused_conv import activate
from tensorkiln.kernels.reference.math import compute_dtype
from tensorkiln.kernels.registry import register

_BLOCK = 1 << 16  # elements per epilogue block (256 KiB of float32)


class NumpyGemmArrays:
    """:class:`tensorkiln.kernels.common.gemm.GemmArrays` on numpy arrays."""

    integer_dtypes = frozenset(
        np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64)
    ) | frozenset(np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64))

    def int_matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.matmul(a, b)  # wraps in the operands' type

    float64 = np.dtype(np.float64)

    def astype(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return x.astype(dtype)

    def affine(
        self,
        a: np.ndarray,
        b: np.ndarray,
        bias: np.ndarray | None,
        alpha: float,
        beta: float,
        act: tuple,
        dtype: np.dtype,
    ) -> np.ndarray:
        ct = compute_dtype(dtype)
        y = np.matmul(a.astype(ct, copy=False), b.astype(ct, copy=False))
        if alpha != 1.0:
            y *= ct.type(alpha)
        if bias is not None:
            bias = bias.astype(ct, copy=False)
            bias = np.broadcast_to(bias if beta == 1.0 else bias * ct.type(beta), y.shape)
        step = max(1, _BLOCK // max(y.shape[1], 1))
        for r0 in range(0, y.shape[0], step):
            blk = y[r0 : r0 + step]
            if bias is not None:
                blk += bias[r0 : r0 + step]
            activate(blk, *act)
        return y.astype(dtype, copy=False)


gemm = bind(common.gemm, NumpyGemmArrays(), __name__)
gemm_act = bind(common.gemm_act, NumpyGemmArrays(), __name__)
register("Gemm", since=1)(gemm)
register("GemmAct", domain="tensorkiln", since=1)(gemm_act)
