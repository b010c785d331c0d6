"""The axes of the Reduce* ops, resolved once for both kernel trees, and the selections (ArgMax,
ArgMin, TopK) written once over each tree's :class:`SelectionArrays`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tensorkiln.kernels.common.tensor import norm_axis

Axes = tuple[int, ...]


def reduce_axes(ndim: int, axes: Sequence[int] | None, noop_with_empty_axes: int) -> Axes:
    """Normalized, sorted axes to reduce (from the ``axes`` attribute of older opsets or the
    optional input of newer ones, read on the host); () when they are empty and
    ``noop_with_empty_axes`` is set. Reducing over () still applies the op's element-wise steps:
    ReduceLogSum gives log(x), ReduceSumSquare x * x, as the spec says."""
    if not axes:
        return () if noop_with_empty_axes else tuple(range(ndim))
    bad = [a for a in axes if not -ndim <= a < ndim]
    if bad:
        raise ValueError(f"axes {bad} out of range for a tensor of rank {ndim}")
    return tuple(sorted({a % ndim for a in axes}))


class SelectionArrays(Protocol):
    """What ArgMax, ArgMin and TopK need from one backend."""

    def host_int(self, v: Any) -> int:
        """The first value of the 1-element tensor ``v`` (TopK's K input) on the host."""

    def arg_reduce(self, x: Any, axis: int, keepdims: int, last: int, largest: bool) -> Any:
        """int64 index of the first (``last``: the last) maximum (``largest``) or minimum along
        the non-negative ``axis``."""

    def topk(self, x: Any, axis: int, k: int, largest: int) -> tuple[Any, Any]:
        """The ``k`` largest (smallest) values along ``axis``, sorted, ties in index order, and
        their int64 indices."""


class Selection:
    """ArgMax, ArgMin and TopK over one backend's :class:`SelectionArrays`: the signatures, the
    axis and k checks, written once."""

    def __init__(self, xp: SelectionArrays) -> None:
        self.xp = xp

    def argmax(self, data: Any, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0):
        """Index (int64) of the first (or last) maximum along ``axis``."""
        ax = norm_axis(axis, max(data.ndim, 1), "ArgMax")
        return self.xp.arg_reduce(data, ax, keepdims, select_last_index, True)

    def argmin(self, data: Any, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0):
        """Index (int64) of the first (or last) minimum along ``axis``."""
        ax = norm_axis(axis, max(data.ndim, 1), "ArgMin")
        return self.xp.arg_reduce(data, ax, keepdims, select_last_index, False)

    def topk(
        self,
        x: Any,
        k_in: Any = None,
        *,
        axis: int = -1,
        largest: int = 1,
        sorted: int = 1,
        k: int | None = None,  # opset 1: k is an attribute
    ) -> tuple[Any, Any]:
        """The k largest (or smallest) values along ``axis`` and their int64 indices; always
        sorted, among equal values the lower index first."""
        ax = norm_axis(axis, max(x.ndim, 1), "TopK")
        kk = self.xp.host_int(k_in) if k_in is not None else k
        if kk is None or not 0 <= kk <= x.shape[ax]:
            raise ValueError(f"TopK: k={kk} must be in [0, {x.shape[ax]}] for axis {ax}")
        return self.xp.topk(x, ax, kk, largest)
