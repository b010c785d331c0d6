"""Reference kernels for the Reduce* ops.

One kernel per op serves every opset: ``axes`` comes as an attribute in older opsets and as an
optional second input from opset 13 (ReduceSum) or 18 (the others). Reducing an empty set gives
the op's identity (0, 1, -inf for max and the logs, +inf for min).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tensorkiln.kernels.common.reduce import Axes, reduce_axes
from tensorkiln.kernels.reference.math import compute_dtype, widen
from tensorkiln.kernels.registry import register


def _reduction(op: str) -> Callable:
    """Register ``core(x, axes, keepdims) -> array`` as the kernel of ``op`` for every opset."""

    def decorator(core: Callable[[np.ndarray, Axes, bool], np.ndarray]) -> Callable:
        def kernel(
            data: np.ndarray,
            axes_in: np.ndarray | None = None,
            *,
            axes: list[int] | None = None,
            keepdims: int = 1,
            noop_with_empty_axes: int = 0,
        ) -> np.ndarray:
            if axes_in is not None:
                axes = [int(a) for a in np.asarray(axes_in).reshape(-1)]
            ax = reduce_axes(data.ndim, axes, noop_with_empty_axes)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                y = core(data, ax, bool(keepdims))
            return np.asarray(y).astype(data.dtype, copy=False)

        kernel.__name__ = kernel.__qualname__ = core.__name__
        kernel.__doc__ = core.__doc__
        register(op, since=1)(kernel)
        return kernel

    return decorator


def _sum(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    return np.sum(x, axis=axes, dtype=compute_dtype(x.dtype), keepdims=keepdims)


@_reduction("ReduceSum")
def reduce_sum(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """Sum over ``axes``."""
    return _sum(x, axes, keepdims)


@_reduction("ReduceSumSquare")
def reduce_sum_square(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """Sum of squares over ``axes``."""
    w = widen(x)
    return _sum(w * w, axes, keepdims)


@_reduction("ReduceL1")
def reduce_l1(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """Sum of absolute values over ``axes``."""
    return _sum(np.abs(widen(x)), axes, keepdims)


@_reduction("ReduceL2")
def reduce_l2(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """Euclidean norm over ``axes``."""
    w = widen(x)
    return np.sqrt(_sum(w * w, axes, keepdims))


@_reduction("ReduceLogSum")
def reduce_log_sum(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """log(sum(x)) over ``axes``."""
    return np.log(_sum(x, axes, keepdims))


@_reduction("ReduceLogSumExp")
def reduce_log_sum_exp(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """log(sum(exp(x))) over ``axes``, shifted by the maximum for stability."""
    w = widen(x)
    if w.dtype.kind not in "fc":
        w = w.astype(np.float64)
    m = np.asarray(np.max(w, axis=axes, keepdims=True, initial=-np.inf))  # 0-d: an array too
    m[~np.isfinite(m)] = 0  # all -inf (or empty) slices: no shift, log(0) = -inf as wanted
    y = np.log(np.sum(np.exp(w - m), axis=axes, keepdims=True)) + m
    return y if keepdims else np.squeeze(y, axis=axes)


def _extreme(x: np.ndarray, fn: Callable, low: bool, axes: Axes, keepdims: bool) -> np.ndarray:
    if x.size:
        return fn(x, axis=axes, keepdims=keepdims)
    # Empty slices reduce to the identity: the lowest value for max, the highest for min.
    if x.dtype == np.bool_:
        initial = not low
    elif x.dtype.kind in "iu":
        info = np.iinfo(x.dtype)
        initial = info.min if low else info.max
    else:
        initial = -np.inf if low else np.inf
    return fn(x, axis=axes, keepdims=keepdims, initial=initial)


@_reduction("ReduceMax")
def reduce_max(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """Maximum over ``axes`` (-inf, or the type's lowest value, for an empty set)."""
    return _extreme(x, np.max, True, axes, keepdims)


@_reduction("ReduceMin")
def reduce_min(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """Minimum over ``axes`` (+inf, or the type's highest value, for an empty set)."""
    return _extreme(x, np.min, False, axes, keepdims)


@_reduction("ReduceMean")
def reduce_mean(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """Mean over ``axes``; integer means truncate toward zero."""
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    return _sum(x, axes, keepdims) / count if count else _sum(x, axes, keepdims) * np.nan


@_reduction("ReduceProd")
def reduce_prod(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """Product over ``axes``."""
    return np.prod(x, axis=axes, dtype=compute_dtype(x.dtype), keepdims=keepdims)
