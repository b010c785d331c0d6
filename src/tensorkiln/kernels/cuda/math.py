"""Torch kernels for linear algebra, scans, softmax-like ops and arg/top-k selection.

They mirror :mod:`tensorkiln.kernels.reference.math`. Float matrix products go to cuBLAS through
torch.matmul/addmm in the inputs' own type (cuBLAS accumulates float16/bfloat16 in float32);
integer products, which cuBLAS lacks, multiply and sum in int64 (wrapping like numpy) and
MatMulInteger goes through float64 (exact for any realistic K). Softmax-like ops compute narrow
floats in float32. Axis and k inputs are read to the host: they pick the output's shape.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tensorkiln.kernels.common.reduce import Selection
from tensorkiln.kernels.cuda.tensor import from_order_key, host_scalar, order_key
from tensorkiln.kernels.registry import register

_NARROW = frozenset({torch.float16, torch.bfloat16})


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _NARROW else dtype


def _axis_of(axis: Any, ndim: int) -> int:
    a = int(host_scalar(axis)) if not isinstance(axis, int) else axis
    if not -max(ndim, 1) <= a < max(ndim, 1):
        raise ValueError(f"axis {a} is out of range for a tensor of rank {ndim}")
    return a % max(ndim, 1)


# ---------------------------------------------------------------- matrix products


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """numpy.matmul of integer tensors, in int64 (cuBLAS has no integer GEMM); int64 wraps
    modulo 2**64, so casting back gives numpy's wrapped result in the narrower type."""
    dtype = a.dtype
    a64, b64 = a.to(torch.int64), b.to(torch.int64)
    vec_a, vec_b = a64.dim() == 1, b64.dim() == 1
    if vec_a:
        a64 = a64.unsqueeze(0)
    if vec_b:
        b64 = b64.unsqueeze(1)
    y = (a64.unsqueeze(-1) * b64.unsqueeze(-3)).sum(-2)
    if vec_a:
        y = y.squeeze(-2)
    if vec_b:
        y = y.squeeze(-1)
    return y.to(dtype)


@register("MatMul", since=1, backend="cuda")
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """numpy.matmul semantics (1-D operands promoted and squeezed, batch dims broadcast)."""
    if a.dtype.is_floating_point:
        return torch.matmul(a, b)
    return int_matmul(a, b)


# Gemm: cuda/fused_gemm.py, beside GemmAct (kernels/common/gemm.py writes both once).


# MatMulInteger: cuda/quant.py, beside QLinearMatMul (kernels/common/quant.py writes both).


@register("Einsum", since=12, backend="cuda")
def einsum(*inputs: torch.Tensor, equation: str) -> torch.Tensor:
    """torch.einsum (numpy's implicit-output rule); integers go through float64, which cuBLAS
    multiplies exactly for values below 2**53."""
    eq = equation.replace(" ", "")
    dtype = inputs[0].dtype
    if dtype.is_floating_point:
        return torch.einsum(eq, *inputs)
    y = torch.einsum(eq, *[x.to(torch.float64) for x in inputs])
    return y.round().to(dtype)


@register("Det", since=11, backend="cuda")
def det(x: torch.Tensor) -> torch.Tensor:
    """Determinant of the last two dims (narrow floats in float64)."""
    wide = x.to(torch.float64) if x.dtype in _NARROW else x
    return torch.linalg.det(wide).to(x.dtype)


# ---------------------------------------------------------------- scans

_SCAN_AS_INT64 = frozenset({torch.bool, torch.uint16, torch.uint32, torch.uint64})


def _scan(x: torch.Tensor, axis: Any, exclusive: int, reverse: int, prod: bool) -> torch.Tensor:
    ax = _axis_of(axis, x.dim())
    x_in = x.reshape(1) if x.dim() == 0 else x
    # unsigned types torch cannot scan wrap the same way in int64
    acc = torch.int64 if x.dtype in _SCAN_AS_INT64 else _compute_dtype(x.dtype)
    src = x_in.flip(ax) if reverse else x_in
    y = torch.cumprod(src, ax, dtype=acc) if prod else torch.cumsum(src, ax, dtype=acc)
    if exclusive:
        first = torch.full_like(y.narrow(ax, 0, min(1, y.shape[ax])), 1 if prod else 0)
        y = torch.cat([first, y.narrow(ax, 0, max(y.shape[ax] - 1, 0))], dim=ax)
    if reverse:
        y = y.flip(ax)
    return y.reshape(x.shape).to(x.dtype)


@register("CumSum", since=11, backend="cuda")
def cumsum(x: torch.Tensor, axis: Any, *, exclusive: int = 0, reverse: int = 0) -> torch.Tensor:
    """Cumulative sum along ``axis`` (a scalar tensor input)."""
    return _scan(x, axis, exclusive, reverse, prod=False)


@register("CumProd", since=26, backend="cuda")
def cumprod(x: torch.Tensor, axis: Any, *, exclusive: int = 0, reverse: int = 0) -> torch.Tensor:
    """Cumulative product along ``axis`` (a scalar tensor input)."""
    return _scan(x, axis, exclusive, reverse, prod=True)


# ---------------------------------------------------------------- softmax family


def _softmax_along(x: torch.Tensor, axis: int, log: bool) -> torch.Tensor:
    # float16/bfloat16 compute in float32 (their exp-sum overflows) and round once at the end
    fn = torch.log_softmax if log else torch.softmax
    if x.dtype in _NARROW:
        return fn(x, axis, dtype=torch.float32).to(x.dtype)
    return fn(x, axis)


def _coerced_2d(fn, x: torch.Tensor, axis: int) -> torch.Tensor:
    # Opset < 13: flatten to [prod(shape[:axis]), prod(shape[axis:])] and work along dim 1.
    ax = _axis_of(axis, x.dim()) if x.dim() else 0
    rows, cols = math.prod(x.shape[:ax]), math.prod(x.shape[ax:])
    return fn(x.reshape(rows, cols), 1).reshape(x.shape)


def _hardmax_along(x: torch.Tensor, axis: int) -> torch.Tensor:
    idx = torch.argmax(order_key(x), dim=axis, keepdim=True)
    return torch.zeros_like(x).scatter_(axis, idx, 1)


# Before opset 13 these ops work on the input coerced to 2-D at ``axis`` (and the default axis is 1,
# which the op's record gives); from 13 on, along ``axis`` itself.
_AXIS_ONLY = 13


@register("Softmax", backend="cuda")
def softmax(x: torch.Tensor, *, axis: int = -1, _opset: int = _AXIS_ONLY) -> torch.Tensor:
    """Numerically stable softmax along ``axis`` (over the 2-D view before opset 13)."""
    if _opset < _AXIS_ONLY:
        return _coerced_2d(lambda t, a: _softmax_along(t, a, log=False), x, axis)
    return _softmax_along(x, _axis_of(axis, x.dim()), log=False)


@register("LogSoftmax", backend="cuda")
def log_softmax(x: torch.Tensor, *, axis: int = -1, _opset: int = _AXIS_ONLY) -> torch.Tensor:
    """Numerically stable log-softmax along ``axis`` (over the 2-D view before opset 13)."""
    if _opset < _AXIS_ONLY:
        return _coerced_2d(lambda t, a: _softmax_along(t, a, log=True), x, axis)
    return _softmax_along(x, _axis_of(axis, x.dim()), log=True)


@register("Hardmax", backend="cuda")
def hardmax(x: torch.Tensor, *, axis: int = -1, _opset: int = _AXIS_ONLY) -> torch.Tensor:
    """One-hot of the first maximum along ``axis`` (of each row of the 2-D view before 13)."""
    if _opset < _AXIS_ONLY:
        return _coerced_2d(_hardmax_along, x, axis)
    return _hardmax_along(x, _axis_of(axis, x.dim()))


# ---------------------------------------------------------------- selection


class TorchSelectionArrays:
    """:class:`tensorkiln.kernels.common.reduce.SelectionArrays` on torch tensors."""

    def host_int(self, v: torch.Tensor) -> int:
        return int(host_scalar(v))

    def arg_reduce(
        self, x: torch.Tensor, axis: int, keepdims: int, last: int, largest: bool
    ) -> torch.Tensor:
        fn = torch.argmax if largest else torch.argmin
        key = order_key(x)
        if last:
            return (x.shape[axis] - 1) - fn(key.flip(axis), dim=axis, keepdim=bool(keepdims))
        return fn(key, dim=axis, keepdim=bool(keepdims))

    def topk(
        self, x: torch.Tensor, axis: int, k: int, largest: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # a stable sort: torch.topk leaves the order of ties open
        key = order_key(x)
        values, idx = torch.sort(key, dim=axis, descending=bool(largest), stable=True)
        values, idx = values.narrow(axis, 0, k), idx.narrow(axis, 0, k)
        return from_order_key(values.contiguous(), x.dtype), idx.contiguous()


_SELECTION = Selection(TorchSelectionArrays())
register("ArgMax", since=1, backend="cuda")(_SELECTION.argmax)
register("ArgMin", since=1, backend="cuda")(_SELECTION.argmin)
register("TopK", since=1, backend="cuda")(_SELECTION.topk)
