"""Pooling: MaxPool, AveragePool, LpPool, the global pools, MaxUnpool, MaxRoiPool.

The windowed pools pad once and then combine one strided view per kernel tap (a 3x3 pool is nine
vectorized ``np.maximum`` / ``np.add`` calls over the whole output), so no window tensor is built.
Geometry, LpPool's powers and MaxUnpool are kernels/common/pool.py's, shared with the cuda tree.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import ml_dtypes
import numpy as np

from tensorkiln.kernels.common.pool import MaxUnpool, pool_geometry, pow_p, root_p
from tensorkiln.kernels.common.window import Geometry, tap_slices
from tensorkiln.kernels.reference._window import compute_dtype, pad
from tensorkiln.kernels.registry import register


def _taps(xp: np.ndarray, g: Geometry) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
    """(tap, strided view of ``xp`` read by that tap for every output position)."""
    for tap in itertools.product(*(range(k) for k in g.kernel)):
        yield tap, xp[(Ellipsis, *tap_slices(g, tap))]


def _lowest(dtype: np.dtype):
    """The padding of a max: the type's least value (float8's finite one: E4M3 has no -inf,
    and a window always holds one element of the input)."""
    if dtype.kind in "iu":
        return np.iinfo(dtype).min
    if dtype.kind == "V":  # (ml_dtypes' float8 types)
        return ml_dtypes.finfo(dtype).min
    return -np.inf


def _tap_index(g: Geometry, tap: Sequence[int], in_sizes: Sequence[int], column_major: bool):
    """Flat spatial index into the unpadded input of every output position for one tap."""
    n = len(tap)
    sizes = list(in_sizes)
    order = range(n) if column_major else reversed(range(n))
    strides, acc = [0] * n, 1
    for d in order:
        strides[d], acc = acc, acc * sizes[d]
    index = np.zeros(g.out, dtype=np.int64)
    for d in range(n):
        pos = np.arange(g.out[d]) * g.strides[d] - g.begin[d] + tap[d] * g.dilations[d]
        index += (pos * strides[d]).reshape((-1,) + (1,) * (n - 1 - d))
    return index


@register("MaxPool", since=1)
def max_pool(
    x: np.ndarray,
    *,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    dilations: Sequence[int] | None = None,
    kernel_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    storage_order: int = 0,
    strides: Sequence[int] | None = None,
    _n_outputs: int = 1,
):
    """Max over each window; with two outputs also the flat int64 index of each maximum."""
    g = pool_geometry(
        x.shape, "MaxPool", kernel_shape, strides, dilations, pads, auto_pad, ceil_mode
    )
    xp = pad(x, g.begin, g.end, _lowest(x.dtype))
    n, c = x.shape[:2]
    if _n_outputs < 2:
        out = None
        for _, view in _taps(xp, g):
            out = view.copy() if out is None else np.maximum(out, view, out=out)
        return out
    best = np.full((n, c, *g.out), _lowest(x.dtype), dtype=x.dtype)
    index = np.zeros(best.shape, dtype=np.int64)
    for tap, view in _taps(xp, g):
        better = view > best
        np.copyto(best, view, where=better)
        np.copyto(index, _tap_index(g, tap, x.shape[2:], bool(storage_order)), where=better)
    size = math.prod(x.shape[2:])
    index += (np.arange(n * c, dtype=np.int64) * size).reshape(n, c, *([1] * len(g.out)))
    return best, index


def _window_sum(xp: np.ndarray, g: Geometry) -> np.ndarray:
    out = None
    for _, view in _taps(xp, g):
        out = view.copy() if out is None else np.add(out, view, out=out)
    return out


def _window_counts(in_sizes, g: Geometry, include_pad: bool, dtype) -> np.ndarray:
    """How many taps of each window fall on the input (and, with ``include_pad``, its pads)."""
    n = len(in_sizes)
    if include_pad:
        ones = np.ones([i + b + e for i, b, e in zip(in_sizes, g.begin, g.explicit_end)], dtype)
        mask = pad(ones, (0,) * n, [e - a for e, a in zip(g.end, g.explicit_end)])
    else:
        mask = pad(np.ones(in_sizes, dtype), g.begin, g.end)
    return _window_sum(mask, g)


@register("AveragePool", since=1)
def average_pool(
    x: np.ndarray,
    *,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    count_include_pad: int = 0,
    dilations: Sequence[int] | None = None,
    kernel_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> np.ndarray:
    """Mean over each window, counting the pads or not (``count_include_pad``)."""
    g = pool_geometry(
        x.shape, "AveragePool", kernel_shape, strides, dilations, pads, auto_pad, ceil_mode
    )
    ct = compute_dtype(x.dtype)
    total = _window_sum(pad(x.astype(ct, copy=False), g.begin, g.end), g)
    counts = _window_counts(x.shape[2:], g, bool(count_include_pad), ct)
    return (total / counts).astype(x.dtype, copy=False)


def _pow_p(x: np.ndarray, p: float) -> np.ndarray:
    return pow_p(np, x, p)


def _root_p(x: np.ndarray, p: float) -> np.ndarray:
    return root_p(np, x, p)


@register("LpPool", since=1)
def lp_pool(
    x: np.ndarray,
    *,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    dilations: Sequence[int] | None = None,
    kernel_shape: Sequence[int] | None = None,
    p: float = 2,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> np.ndarray:
    """(sum over each window of |x|^p)^(1/p); pads count as zeros."""
    g = pool_geometry(
        x.shape, "LpPool", kernel_shape, strides, dilations, pads, auto_pad, ceil_mode
    )
    ct = compute_dtype(x.dtype)
    xp = pad(_pow_p(x.astype(ct, copy=False), p), g.begin, g.end)
    return _root_p(_window_sum(xp, g), p).astype(x.dtype, copy=False)


def _spatial_axes(x: np.ndarray, op: str) -> tuple[int, ...]:
    if x.ndim < 2:
        raise ValueError(f"{op}: input must be (N, C, D1, ...), got shape {x.shape}")
    return tuple(range(2, x.ndim))


@register("GlobalAveragePool", since=1)
def global_average_pool(x: np.ndarray) -> np.ndarray:
    """Mean over all spatial axes, kept as size-1 axes."""
    axes = _spatial_axes(x, "GlobalAveragePool")
    return np.mean(x, axis=axes, keepdims=True, dtype=compute_dtype(x.dtype)).astype(x.dtype)


@register("GlobalMaxPool", since=1)
def global_max_pool(x: np.ndarray) -> np.ndarray:
    """Max over all spatial axes, kept as size-1 axes."""
    return np.max(x, axis=_spatial_axes(x, "GlobalMaxPool"), keepdims=True)


@register("GlobalLpPool", since=1)
def global_lp_pool(x: np.ndarray, *, p: float = 2) -> np.ndarray:
    """(sum over all spatial axes of |x|^p)^(1/p), kept as size-1 axes."""
    axes = _spatial_axes(x, "GlobalLpPool")
    xc = x.astype(compute_dtype(x.dtype), copy=False)
    return _root_p(np.sum(_pow_p(xc, p), axis=axes, keepdims=True), p).astype(x.dtype)


class NumpyUnpoolArrays:
    """:class:`tensorkiln.kernels.common.pool.UnpoolArrays` on numpy arrays."""

    int64 = np.dtype(np.int64)

    def zeros(self, shape: tuple[int, ...], like: np.ndarray) -> np.ndarray:
        return np.zeros(shape, dtype=like.dtype)

    def astype(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return x.astype(dtype, copy=False)

    def host_ints(self, v: np.ndarray) -> list[int]:
        return [int(s) for s in np.asarray(v).reshape(-1)]


register("MaxUnpool", since=9)(MaxUnpool(NumpyUnpoolArrays()).max_unpool)


def _round_half_away(v: float) -> int:
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def _roi_bins(start: int, size: int, pooled: int, limit: int) -> list[tuple[int, int]]:
    """Caffe's [begin, end) of each of ``pooled`` bins over ``size`` cells from ``start``."""
    step = size / pooled
    bins = []
    for i in range(pooled):
        lo = min(max(math.floor(i * step) + start, 0), limit)
        hi = min(max(math.ceil((i + 1) * step) + start, 0), limit)
        bins.append((lo, hi))
    return bins


@register("MaxRoiPool", since=1)
def max_roi_pool(
    x: np.ndarray,
    rois: np.ndarray,
    *,
    pooled_shape: Sequence[int] | None = None,
    spatial_scale: float = 1.0,
) -> np.ndarray:
    """Max over a pooled_shape grid of bins in each region (batch, x1, y1, x2, y2)."""
    if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 5:
        raise ValueError(
            f"MaxRoiPool: X must be (N, C, H, W) and rois (num_rois, 5); got {x.shape}, {rois.shape}"
        )
    if not pooled_shape or len(pooled_shape) != 2:
        raise ValueError("MaxRoiPool: the pooled_shape attribute (2 ints) is required")
    ph, pw = (int(v) for v in pooled_shape)
    height, width = x.shape[2:]
    y = np.zeros((rois.shape[0], x.shape[1], ph, pw), dtype=x.dtype)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        x1, y1, x2, y2 = (_round_half_away(float(v) * spatial_scale) for v in roi[1:])
        hbins = _roi_bins(y1, max(y2 - y1 + 1, 1), ph, height)
        wbins = _roi_bins(x1, max(x2 - x1 + 1, 1), pw, width)
        for i, (h0, h1) in enumerate(hbins):
            for j, (w0, w1) in enumerate(wbins):
                if h1 > h0 and w1 > w0:
                    y[r, :, i, j] = x[b, :, h0:h1, w0:w1].max(axis=(1, 2))
    return y
