"""The axes of the Reduce* ops, resolved once for both kernel trees."""

from __future__ import annotations

from collections.abc import Sequence

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
