"""tensorkiln.GemmAct on the cuda backend: one cuBLAS(Lt) GEMM with its bias and activation.

``Y = act(alpha * A' @ B' + beta * C)`` as :mod:`tensorkiln.kernels.reference.fused_gemm` defines
it: a 2-D A is Gemm's (``transA``, C broadcast to (M, N)); a higher-rank A is MatMul's, its leading
dims folded into the rows (C along the last axis only). Transposes are strided views that cuBLAS
reads as they are.

The GEMM and the bias are one ``addmm``. Relu, and on CUDA the tanh GELU, go into the GEMM's
epilogue too through ``torch._addmm_activation`` (cuBLASLt's RELU_BIAS / GELU_BIAS when the bias is
a contiguous row vector; torch falls back to addmm + the in-place activation otherwise). Its GELU is
the tanh form on CUDA but the erf form on the CPU, so the erf GELU, and every activation on the CPU
other than Relu, runs in place on the GEMM's fresh output instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from tensorkiln.kernels.common.fused import check_gemm_bias, check_gemm_operands
from tensorkiln.kernels.cpu import native as cpu_native
from tensorkiln.kernels.cuda.fused_conv import activate_
from tensorkiln.kernels.registry import register
from tensorkiln.ops.fused import check_activation


def _operands(
    a: torch.Tensor, b: torch.Tensor, trans_a: int, trans_b: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A as a 2-D (M, K) view (leading dims folded) and B as (K, N), transposes applied."""
    check_gemm_operands(a.shape, b.shape, trans_a, trans_b)
    a2 = a.reshape(math.prod(a.shape[:-1]), a.shape[-1])
    a2 = a2.t() if trans_a else a2
    b2 = b.t() if trans_b else b
    return a2, b2.to(a2.dtype)


def _bias(c: torch.Tensor | None, beta: float, n: int, rank: int, dtype) -> torch.Tensor | None:
    """C as addmm's input (broadcast by addmm), or None when it adds nothing."""
    if c is None or beta == 0.0:
        return None  # beta 0 ignores C, NaNs included, as the reference does
    check_gemm_bias(c.shape, n, rank)
    if rank > 2:  # MatMul form: along the last axis only
        c = c.reshape(-1)
    return c.to(dtype)


def _fused_epilogue(activation: str, y_device: torch.device) -> bool | None:
    """``use_gelu`` for torch._addmm_activation when it computes ``activation``, else None."""
    if activation == "Relu":
        return False
    if activation == "GeluTanh" and y_device.type == "cuda":
        return True
    return None


@register("GemmAct", domain="tensorkiln", since=1, backend="cuda")
def gemm_act(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
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
) -> torch.Tensor:
    """act(alpha * A' @ B' + beta * C), leading dims of A kept."""
    check_activation(activation, "GemmAct")
    a2, b2 = _operands(a, b, transA, transB)
    n = b2.shape[1]
    bias = _bias(c, beta, n, a.ndim, a2.dtype)
    # (an empty inner dimension skips the epilogue in torch's CUDA path: not fused then)
    fusable = bias is not None and a2.shape[1] > 0
    use_gelu = _fused_epilogue(activation, a2.device) if fusable else None
    if use_gelu is not None:
        y = torch._addmm_activation(bias, a2, b2, beta=beta, alpha=alpha, use_gelu=use_gelu)
    else:
        if bias is None:
            y = torch.mm(a2, b2)
            if alpha != 1.0:
                y.mul_(alpha)
        else:
            y = torch.addmm(bias, a2, b2, beta=beta, alpha=alpha)
        act = (activation_alpha, activation_beta, activation_min, activation_max)
        activate_(y, activation, *act)
    return y.reshape(*a.shape[:-1], n) if a.ndim > 2 else y


def _specialize_gemm_act(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    **attrs: Any,
) -> Callable[..., torch.Tensor] | None:
    """On the cpu backend, the native GEMM for these shapes and constants where it applies and
    is the faster (cpu_native.gemm: a classifier head's GEMV at batch 1); None otherwise."""
    return cpu_native.specialize_gemm(gemm_act, a, b, c, attrs)


# the executor asks for it on the cpu backend
gemm_act.specialize = _specialize_gemm_act  # type: ignore[attr-defined]
