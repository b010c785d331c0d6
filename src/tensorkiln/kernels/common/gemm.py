"""Gemm and tensorkiln.GemmAct written once, over one backend's :class:`GemmArrays`.

``Y = act(alpha * A' @ B' + beta * C)`` (GemmAct: ``+ Z``, a residual of Y's shape, where there
is no activation). A of rank 2 is Gemm's A (``transA`` allowed, C broadcast
to (M, N) as Gemm does); A of higher rank is MatMul's (GemmAct only), its leading dims folded into
the rows (``transA`` must be 0, C broadcast along the last axis only). The checks, the operand
transposes (views), the bias layout and the integer path live here; a backend supplies only the
product itself (numpy matmul in a widened type, torch addmm / _addmm_activation, a Triton launch).

A tree registers the entries bound to its arrays (:func:`tensorkiln.kernels.common.bind`): a partial keeps the entry's
signature (the registry reads the keywords from it) and takes the cpu backend's ``specialize``
hook as an attribute.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from tensorkiln.kernels.common.fused import check_gemm_bias, check_gemm_operands
from tensorkiln.ops.fused import check_activation


class GemmArrays(Protocol):
    """What Gemm and GemmAct need from one backend."""

    # the integer dtypes (Gemm's int32/int64/uint32/uint64 forms): a set, as the membership test
    # is the cheapest on the per-call path
    integer_dtypes: frozenset

    def int_matmul(self, a: Any, b: Any) -> Any:
        """A @ B of 2-D integer operands in their own type, wrapping like numpy."""

    float64: Any  # the float64 dtype, for the integer path's scaling

    def astype(self, x: Any, dtype: Any) -> Any: ...

    def affine(
        self, a: Any, b: Any, bias: Any, alpha: float, beta: float, act: tuple, dtype: Any
    ) -> Any:
        """act(alpha * A @ B + beta * bias) of float 2-D operands as a fresh (M, N) array of
        ``dtype``; ``bias`` is None or broadcasts to (M, N); ``act`` is (activation,
        activation_alpha, activation_beta, activation_min, activation_max), activation "" for
        none.

        Arrays may also have ``affine_residual(a, b, bias, alpha, beta, dtype, z)``: alpha *
        A @ B + beta * bias + z (z of (M, N)) in one pass, or None where they cannot; without
        it (or on None) z is added to :meth:`affine`'s result."""


def gemm_layout(
    a: Any, b: Any, c: Any, beta: float, trans_a: int, trans_b: int, op: str = "GemmAct"
) -> tuple[Any, Any, Any]:
    """(A as a 2-D (M, K) view, B as (K, N), C as the bias that broadcasts to (M, N) or None
    when it adds nothing), after checking that they fit."""
    shape = a.shape  # (read once: a torch tensor builds it anew on each read)
    check_gemm_operands(shape, b.shape, trans_a, trans_b, op)
    rank = len(shape)
    # rows given explicitly: reshape(-1, 0) cannot infer them when K=0
    a2 = a if rank == 2 else a.reshape(math.prod(shape[:-1]), shape[-1])
    a2 = a2.T if trans_a else a2
    b2 = b.T if trans_b else b
    if c is None or beta == 0.0:
        return a2, b2, None  # beta 0 ignores C, NaNs included
    if rank == 2:
        return a2, b2, c  # Gemm's form: C broadcasts to (M, N)
    check_gemm_bias(c.shape, b2.shape[1], rank, op)
    return a2, b2, c.reshape(-1)  # MatMul's form: along the last axis only


def _integer(xp: GemmArrays, a2: Any, b2: Any, bias: Any, alpha: float, beta: float) -> Any:
    """The integer product, exact where alpha and beta are 1, else scaled in float64 (as the
    ONNX reference does) and cast back."""
    y = xp.int_matmul(a2, b2)
    if alpha == 1.0 and (bias is None or beta == 1.0):
        return y if bias is None else y + bias
    wide = xp.astype(y, xp.float64) * alpha
    if bias is not None:
        wide = wide + xp.astype(bias, xp.float64) * beta
    return xp.astype(wide, y.dtype)


def _gemm(
    xp: GemmArrays, a: Any, b: Any, c: Any, alpha, beta, trans_a, trans_b, act, op, z: Any = None
) -> Any:
    a2, b2, bias = gemm_layout(a, b, c, beta, trans_a, trans_b, op)
    dtype = a.dtype
    if z is not None:
        y = _with_residual(xp, a, a2, b2, bias, alpha, beta, act, z)
    elif dtype in xp.integer_dtypes:
        y = _integer(xp, a2, b2, bias, alpha, beta)
    else:
        y = xp.affine(a2, b2, bias, alpha, beta, act, dtype)
    return y if a.ndim == 2 else y.reshape(*a.shape[:-1], y.shape[1])


def _with_residual(xp: GemmArrays, a, a2, b2, bias, alpha, beta, act, z) -> Any:
    """alpha * A @ B + beta * C + Z as (M, N): in the arrays' one pass where they have one,
    else Z added to the product (rounded to the output's type first, as a separate Add)."""
    if a.dtype in xp.integer_dtypes or act[0]:
        raise ValueError("GemmAct: a residual Z is taken by a float GemmAct without activation")
    m, n = a2.shape[0], b2.shape[1]
    want = (m, n) if a.ndim == 2 else (*a.shape[:-1], n)
    if tuple(z.shape) != tuple(want):
        raise ValueError(f"GemmAct: the residual Z has shape {tuple(z.shape)}, the output {want}")
    z2 = z.reshape(m, n)
    if z2.dtype != a.dtype:
        z2 = xp.astype(z2, a.dtype)
    fused = getattr(xp, "affine_residual", None)
    y = fused(a2, b2, bias, alpha, beta, a.dtype, z2) if fused is not None else None
    if y is None:
        y = xp.affine(a2, b2, bias, alpha, beta, act, a.dtype)
        y += z2  # (the product is a fresh array)
    return y


_NO_ACTIVATION = ("", None, None, None, None)


def gemm(
    xp: GemmArrays,
    a: Any,
    b: Any,
    c: Any = None,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    transA: int = 0,
    transB: int = 0,
    broadcast: int = 0,  # opset < 7; C always broadcasts unidirectionally here
) -> Any:
    """Gemm: Y = alpha * A' @ B' + beta * C, with A', B' optionally transposed (views)."""
    return _gemm(xp, a, b, c, alpha, beta, transA, transB, _NO_ACTIVATION, "Gemm")


def gemm_act(
    xp: GemmArrays,
    a: Any,
    b: Any,
    c: Any = None,
    z: Any = None,
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
) -> Any:
    """tensorkiln.GemmAct: act(alpha * A' @ B' + beta * C) (+ Z, the residual of the output's
    shape, where there is no activation), leading dims of A kept."""
    check_activation(activation, "GemmAct")
    act = (activation, activation_alpha, activation_beta, activation_min, activation_max)
    return _gemm(xp, a, b, c, alpha, beta, transA, transB, act, "GemmAct", z)
