"""The Reduce* ops of the cuda backend, matching ``kernels/reference/reduce.py``.

One kernel per op serves every opset: ``axes`` is an attribute in older opsets and an optional
second input later; that input is read to the host (a handful of ints, needed to shape the
result). Narrow floats (float16, bfloat16, float8) accumulate in float32 and round once; integers
sum and multiply in their own type, wrapping as the reference does. Reducing over no axes (empty
``axes`` with ``noop_with_empty_axes``) still applies the element-wise steps (log, square...);
reducing an empty set gives the op's identity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tensorkiln.kernels.common.reduce import Axes, reduce_axes
from tensorkiln.kernels.cuda.elementwise import (
    NARROW,
    UNSIGNED,
    arith,
    full,
    ordered,
    unarith,
    unordered,
)
from tensorkiln.kernels.cuda.tensor import host_ints
from tensorkiln.kernels.registry import register

Tensor = torch.Tensor


def _reduction(op: str) -> Callable:
    """Register ``core(x, axes, keepdims) -> tensor`` as the kernel of ``op`` for every opset."""

    def decorator(core: Callable[[Tensor, Axes, bool], Tensor]) -> Callable:
        def kernel(
            data: Tensor,
            axes_in: Tensor | None = None,
            *,
            axes: list[int] | None = None,
            keepdims: int = 1,
            noop_with_empty_axes: int = 0,
        ) -> Tensor:
            if axes_in is not None:
                axes = host_ints(axes_in)  # known on the host for constant axes: no device sync
            ax = reduce_axes(data.ndim, axes, noop_with_empty_axes)
            return unarith(core(data, ax, bool(keepdims)), data.dtype)

        kernel.__name__ = kernel.__qualname__ = core.__name__
        kernel.__doc__ = core.__doc__
        register(op, since=1, backend="cuda")(kernel)
        return kernel

    return decorator


def _acc(x: Tensor) -> Tensor:
    """``x`` in the dtype it accumulates in: float32 for narrow floats, see ``arith`` for ints."""
    return x.float() if x.dtype in NARROW else arith(x)


def _sum(v: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """Sum of ``v`` (already in its accumulation dtype) over ``axes``; () sums nothing."""
    if not axes:
        return v
    return torch.sum(v, dim=axes, keepdim=keepdims, dtype=v.dtype)


def _to_float(s: Tensor) -> Tensor:
    """An integer result in float64 for sqrt and log (truncated back to the integer type later)."""
    return s if s.is_floating_point() else s.double()


@_reduction("ReduceSum")
def reduce_sum(x: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """Sum over ``axes``."""
    return _sum(_acc(x), axes, keepdims)


@_reduction("ReduceSumSquare")
def reduce_sum_square(x: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """Sum of squares over ``axes``."""
    v = _acc(x)
    return _sum(v * v, axes, keepdims)


@_reduction("ReduceL1")
def reduce_l1(x: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """Sum of absolute values over ``axes``."""
    v = _acc(x)
    return _sum(v if x.dtype in UNSIGNED else v.abs(), axes, keepdims)


@_reduction("ReduceL2")
def reduce_l2(x: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """Euclidean norm over ``axes``."""
    v = _acc(x)
    return torch.sqrt(_to_float(_sum(v * v, axes, keepdims)))


@_reduction("ReduceLogSum")
def reduce_log_sum(x: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """log(sum(x)) over ``axes``."""
    return torch.log(_to_float(_sum(_acc(x), axes, keepdims)))


@_reduction("ReduceLogSumExp")
def reduce_log_sum_exp(x: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """log(sum(exp(x))) over ``axes``, shifted by the maximum for stability."""
    w = _to_float(_acc(x))
    m = _extreme(w, axes, True, largest=True)
    m = torch.where(torch.isfinite(m), m, 0.0)  # all -inf (or empty): no shift, log(0) = -inf
    y = torch.log(_sum(torch.exp(w - m), axes, True)) + m
    return y.squeeze(axes) if axes and not keepdims else y


def _identity(dtype: torch.dtype, largest: bool) -> bool | int | float:
    """The value reducing an empty set gives: the lowest value for max, the highest for min."""
    if dtype == torch.bool:
        return not largest
    if dtype.is_floating_point:
        return -float("inf") if largest else float("inf")
    info = torch.iinfo(dtype)
    return info.min if largest else info.max


def _extreme(x: Tensor, axes: Axes, keepdims: bool, largest: bool) -> Tensor:
    if not axes:
        return x
    if any(x.shape[a] == 0 for a in axes):
        shape = [1 if a in axes else n for a, n in enumerate(x.shape) if keepdims or a not in axes]
        fill = full((), _identity(x.dtype, largest), x.dtype, x.device)
        return fill.expand(shape).clone()
    reduce = torch.amax if largest else torch.amin
    return unordered(reduce(ordered(x), dim=axes, keepdim=keepdims), x.dtype)


@_reduction("ReduceMax")
def reduce_max(x: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """Maximum over ``axes`` (-inf, or the type's lowest value, for an empty set)."""
    return _extreme(x, axes, keepdims, largest=True)


@_reduction("ReduceMin")
def reduce_min(x: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """Minimum over ``axes`` (+inf, or the type's highest value, for an empty set)."""
    return _extreme(x, axes, keepdims, largest=False)


@_reduction("ReduceMean")
def reduce_mean(x: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """Mean over ``axes``; integer means truncate toward zero."""
    count = 1
    for a in axes:
        count *= x.shape[a]
    s = _sum(_acc(x), axes, keepdims)
    if s.is_floating_point():
        return s / count if count else s * float("nan")
    if not count:
        return (s.double() * float("nan")).to(s.dtype)
    # the sum wraps in x's own type first, as the reference's does
    return torch.div(arith(unarith(s, x.dtype)), count, rounding_mode="trunc")


@_reduction("ReduceProd")
def reduce_prod(x: Tensor, axes: Axes, keepdims: bool) -> Tensor:
    """Product over ``axes``."""
    y = _acc(x)
    for a in sorted(axes, reverse=True):  # torch.prod takes one axis at a time
        y = torch.prod(y, dim=a, keepdim=keepdims, dtype=y.dtype)
    return y
