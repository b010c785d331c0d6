"""Pooling on the cuda backend: MaxPool, AveragePool, LpPool, the global pools, MaxUnpool,
MaxRoiPool.

Windows torch's pooling kernels express exactly (floats, 1-3 spatial axes, symmetric pads of at
most half a kernel, and for AveragePool no dilation) run there. Everything else (asymmetric or large
pads, integer inputs, more axes, LpPool) pads once and combines one strided view per kernel tap,
as the reference does. MaxUnpool (kernels/common/pool.py's, shared with the reference) reads its
output_shape input on the host (a shape).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tensorkiln.kernels.common.pool import MaxUnpool, pool_geometry, pow_p, root_p
from tensorkiln.kernels.common.window import Geometry, tap_slices
from tensorkiln.kernels.cpu import native as cpu_native
from tensorkiln.kernels.cuda.convert import host_list
from tensorkiln.kernels.cuda.nn import compute_dtype, torch_pads
from tensorkiln.kernels.registry import register

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _lowest(dtype: torch.dtype) -> float | int:
    if dtype == torch.bool:
        return False
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _pad(x: torch.Tensor, g: Geometry, value: float = 0) -> torch.Tensor:
    if not g.padded:
        return x
    return F.pad(x, torch_pads(g.begin, g.end), value=value)


def _taps(xp: torch.Tensor, g: Geometry) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
    """(tap, strided view of ``xp`` read by that tap for every output position)."""
    for tap in itertools.product(*(range(k) for k in g.kernel)):
        yield tap, xp[(Ellipsis, *tap_slices(g, tap))]


def _torch_padding(x: torch.Tensor, g: Geometry, ceil_mode: int) -> tuple[int, ...] | None:
    """The symmetric padding with which torch's pooling gives exactly ``g``'s windows, if any."""
    if tuple(g.begin) != tuple(g.explicit_end) or x.ndim - 2 > 3:
        return None
    for i, k, s, d, p, o in zip(x.shape[2:], g.kernel, g.strides, g.dilations, g.begin, g.out):
        if 2 * p > k:
            return None
        span = i + 2 * p - (k - 1) * d - 1
        n = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (n - 1) * s >= i + p:
            n -= 1
        if n != o:
            return None
    return tuple(g.begin)


def _flat_index(idx, sizes_from, shift, sizes_to, column_major: bool) -> torch.Tensor:
    """Re-express row-major flat indices over ``sizes_from`` (positions moved by ``shift``) as
    flat indices over ``sizes_to``, row- or column-major. A window that lies wholly in the padding
    takes index 0, as in the reference."""
    coords = []
    for s in reversed(sizes_from):
        coords.append(idx % s)
        idx = idx // s
    coords = [c - d for c, d in zip(reversed(coords), shift)]
    order = range(len(sizes_to)) if column_major else reversed(range(len(sizes_to)))
    out, step = torch.zeros_like(idx), 1
    inside = torch.ones_like(idx, dtype=torch.bool)
    for d in order:
        out = out + coords[d] * step
        step *= sizes_to[d]
        inside &= (coords[d] >= 0) & (coords[d] < sizes_to[d])
    return torch.where(inside, out, 0)


def _plane_offsets(x: torch.Tensor, nsp: int) -> torch.Tensor:
    """(N, C, 1, ...) flat offset of each (n, c) plane of ``x``."""
    size = math.prod(x.shape[2:])
    planes = torch.arange(x.shape[0] * x.shape[1], device=x.device, dtype=torch.int64)
    return (planes * size).reshape(x.shape[0], x.shape[1], *([1] * nsp))


def _max_pool_torch(x, g: Geometry, ceil_mode: int, storage_order: int, with_index: bool):
    nsp = x.ndim - 2
    padding = _torch_padding(x, g, ceil_mode)
    xp, shift = x, (0,) * nsp
    if padding is None:
        xp, padding, ceil_mode, shift = _pad(x, g, -math.inf), 0, 0, g.begin
    args = (g.kernel, g.strides, padding, g.dilations, bool(ceil_mode))
    if not with_index:
        y = _MAX_POOL[nsp](xp, *args)
        return y[(Ellipsis, *(slice(0, o) for o in g.out))]
    y, idx = _MAX_POOL[nsp](xp, *args, return_indices=True)
    crop = (Ellipsis, *(slice(0, o) for o in g.out))
    y, idx = y[crop], idx[crop]
    if xp is not x or storage_order:
        idx = _flat_index(idx, xp.shape[2:], shift, x.shape[2:], bool(storage_order))
    return y, idx + _plane_offsets(x, nsp)


def _tap_index(g: Geometry, tap, in_sizes, column_major: bool, device) -> torch.Tensor:
    """Flat spatial index into the unpadded input of every output position for one tap."""
    n = len(tap)
    order = range(n) if column_major else reversed(range(n))
    strides, acc = [0] * n, 1
    for d in order:
        strides[d], acc = acc, acc * in_sizes[d]
    index = torch.zeros(g.out, dtype=torch.int64, device=device)
    for d in range(n):
        pos = torch.arange(g.out[d], device=device) * g.strides[d]
        pos = pos - g.begin[d] + tap[d] * g.dilations[d]
        index = index + (pos * strides[d]).reshape((-1,) + (1,) * (n - 1 - d))
    return index


def _max_pool_taps(x, g: Geometry, storage_order: int, with_index: bool):
    xp = _pad(x, g, _lowest(x.dtype))
    if not with_index:
        out = None
        for _, view in _taps(xp, g):
            out = view.clone() if out is None else torch.maximum(out, view)
        return out
    best = torch.full((*x.shape[:2], *g.out), _lowest(x.dtype), dtype=x.dtype, device=x.device)
    index = torch.zeros(best.shape, dtype=torch.int64, device=x.device)
    for tap, view in _taps(xp, g):
        better = view > best
        best = torch.where(better, view, best)
        tap_index = _tap_index(g, tap, x.shape[2:], bool(storage_order), x.device)
        index = torch.where(better, tap_index, index)
    return best, index + _plane_offsets(x, x.ndim - 2)


@register("MaxPool", since=1, backend="cuda")
def max_pool(
    x: torch.Tensor,
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
    with_index = _n_outputs > 1
    if x.dtype in _FLOAT8:  # (torch has no float8 pooling: float16 holds every value exactly)
        y = max_pool(
            x.to(torch.float16), auto_pad=auto_pad, ceil_mode=ceil_mode, dilations=dilations,
            kernel_shape=kernel_shape, pads=pads, storage_order=storage_order, strides=strides,
            _n_outputs=_n_outputs,
        )  # fmt: skip
        return (y[0].to(x.dtype), y[1]) if with_index else y.to(x.dtype)
    if x.dtype.is_floating_point and x.ndim - 2 <= 3:
        return _max_pool_torch(x, g, ceil_mode, storage_order, with_index)
    return _max_pool_taps(x, g, storage_order, with_index)


def _window_sum(xp: torch.Tensor, g: Geometry) -> torch.Tensor:
    out = None
    for _, view in _taps(xp, g):
        out = view.clone() if out is None else out + view
    return out


def _window_counts(in_sizes, g: Geometry, include_pad: bool, dtype, device) -> torch.Tensor:
    """How many taps of each window fall on the input (and, with ``include_pad``, its pads)."""
    n = len(in_sizes)
    if include_pad:
        sizes = [i + b + e for i, b, e in zip(in_sizes, g.begin, g.explicit_end)]
        extra = [e - a for e, a in zip(g.end, g.explicit_end)]
        mask = F.pad(torch.ones(sizes, dtype=dtype, device=device), torch_pads([0] * n, extra))
    else:
        mask = F.pad(torch.ones(in_sizes, dtype=dtype, device=device), torch_pads(g.begin, g.end))
    return _window_sum(mask, g)


@register("AveragePool", since=1, backend="cuda")
def average_pool(
    x: torch.Tensor,
    *,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    count_include_pad: int = 0,
    dilations: Sequence[int] | None = None,
    kernel_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> torch.Tensor:
    """Mean over each window, counting the pads or not (``count_include_pad``)."""
    g = pool_geometry(
        x.shape, "AveragePool", kernel_shape, strides, dilations, pads, auto_pad, ceil_mode
    )
    nsp = x.ndim - 2
    padding = _torch_padding(x, g, ceil_mode)
    if padding is not None and x.dtype.is_floating_point and all(d == 1 for d in g.dilations):
        args = (g.kernel, g.strides, padding, bool(ceil_mode), bool(count_include_pad))
        return _AVG_POOL[nsp](x, *args)
    ct = compute_dtype(x.dtype)
    total = _window_sum(_pad(x.to(ct), g), g)
    counts = _window_counts(x.shape[2:], g, bool(count_include_pad), ct, x.device)
    return (total / counts).to(x.dtype)


def _pow_p(x: torch.Tensor, p: float) -> torch.Tensor:
    return pow_p(torch, x, p)


def _root_p(x: torch.Tensor, p: float) -> torch.Tensor:
    return root_p(torch, x, p)


@register("LpPool", since=1, backend="cuda")
def lp_pool(
    x: torch.Tensor,
    *,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    dilations: Sequence[int] | None = None,
    kernel_shape: Sequence[int] | None = None,
    p: float = 2,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> torch.Tensor:
    """(sum over each window of |x|^p)^(1/p); pads count as zeros."""
    g = pool_geometry(
        x.shape, "LpPool", kernel_shape, strides, dilations, pads, auto_pad, ceil_mode
    )
    xp = _pad(_pow_p(x.to(compute_dtype(x.dtype)), p), g)
    return _root_p(_window_sum(xp, g), p).to(x.dtype)


def _spatial_axes(x: torch.Tensor, op: str) -> tuple[int, ...]:
    if x.ndim < 2:
        raise ValueError(f"{op}: input must be (N, C, D1, ...), got shape {tuple(x.shape)}")
    return tuple(range(2, x.ndim))


@register("GlobalAveragePool", since=1, backend="cuda")
def global_average_pool(x: torch.Tensor) -> torch.Tensor:
    """Mean over all spatial axes, kept as size-1 axes."""
    axes = _spatial_axes(x, "GlobalAveragePool")
    if not axes:
        return x
    return x.mean(dim=axes, keepdim=True)  # float32 accumulation for narrow floats


def _specialize_global_average_pool(x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """On the cpu backend, the native pooling for this shape (untimed: in a loop torch's mean
    keeps its threads awake, in a network it wakes them at each call: 14 against 46-160 us on
    (1, 576, 7, 7); the native pooling takes no threads below 1M values)."""
    native = cpu_native.spatial_mean(x) if x.device.type == "cpu" else None
    if native is None:
        return None
    return cpu_native.specialized(native, global_average_pool, (x,), timed=False)


# the executor asks for it on the cpu backend
global_average_pool.specialize = _specialize_global_average_pool  # type: ignore[attr-defined]


@register("GlobalMaxPool", since=1, backend="cuda")
def global_max_pool(x: torch.Tensor) -> torch.Tensor:
    """Max over all spatial axes, kept as size-1 axes."""
    axes = _spatial_axes(x, "GlobalMaxPool")
    return x.amax(dim=axes, keepdim=True) if axes else x


@register("GlobalLpPool", since=1, backend="cuda")
def global_lp_pool(x: torch.Tensor, *, p: float = 2) -> torch.Tensor:
    """(sum over all spatial axes of |x|^p)^(1/p), kept as size-1 axes."""
    axes = _spatial_axes(x, "GlobalLpPool")
    xc = _pow_p(x.to(compute_dtype(x.dtype)), p)
    total = xc.sum(dim=axes, keepdim=True) if axes else xc
    return _root_p(total, p).to(x.dtype)


class TorchUnpoolArrays:
    """:class:`tensorkiln.kernels.common.pool.UnpoolArrays` on torch tensors."""

    int64 = torch.int64

    def zeros(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(shape)

    def astype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    def host_ints(self, v: torch.Tensor) -> list[int]:
        return [int(s) for s in np.ravel(host_list(v))]


register("MaxUnpool", since=9, backend="cuda")(MaxUnpool(TorchUnpoolArrays()).max_unpool)


def _roi_bins(start, size, pooled: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Caffe's [begin, end) of each of ``pooled`` bins over ``size`` cells from ``start``: (R, pooled)."""
    step = (size.to(torch.float64) / pooled)[:, None]
    i = torch.arange(pooled, device=size.device, dtype=torch.float64)
    lo = torch.floor(i * step).to(torch.int64) + start[:, None]
    hi = torch.ceil((i + 1) * step).to(torch.int64) + start[:, None]
    return lo.clamp(0, limit), hi.clamp(0, limit)


@register("MaxRoiPool", since=1, backend="cuda")
def max_roi_pool(
    x: torch.Tensor,
    rois: torch.Tensor,
    *,
    pooled_shape: Sequence[int] | None = None,
    spatial_scale: float = 1.0,
) -> torch.Tensor:
    """Max over a pooled_shape grid of bins in each region (batch, x1, y1, x2, y2)."""
    if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 5:
        raise ValueError(
            "MaxRoiPool: X must be (N, C, H, W) and rois (num_rois, 5); got "
            f"{tuple(x.shape)}, {tuple(rois.shape)}"
        )
    if not pooled_shape or len(pooled_shape) != 2:
        raise ValueError("MaxRoiPool: the pooled_shape attribute (2 ints) is required")
    ph, pw = (int(v) for v in pooled_shape)
    height, width = x.shape[2:]
    coords = rois[:, 1:].to(torch.float64) * spatial_scale
    coords = (torch.sign(coords) * torch.floor(coords.abs() + 0.5)).to(torch.int64)
    x1, y1, x2, y2 = coords.unbind(1)
    h0, h1 = _roi_bins(y1, (y2 - y1 + 1).clamp(min=1), ph, height)
    w0, w1 = _roi_bins(x1, (x2 - x1 + 1).clamp(min=1), pw, width)
    feats = x[rois[:, 0].to(torch.int64)]  # (R, C, H, W)
    rows = torch.arange(height, device=x.device)
    cols = torch.arange(width, device=x.device)
    in_w = (cols >= w0[:, :, None]) & (cols < w1[:, :, None])  # (R, pw, W)
    low = _lowest(x.dtype)
    out = []
    for i in range(ph):  # one row of bins at a time keeps the masked copy at (R, C, H, W)
        in_h = (rows >= h0[:, i, None]) & (rows < h1[:, i, None])  # (R, H)
        row = feats.masked_fill(~in_h[:, None, :, None], low).amax(dim=2)  # (R, C, W)
        cells = row[:, :, None, :].masked_fill(~in_w[:, None], low).amax(dim=-1)  # (R, C, pw)
        empty = (h1[:, i] <= h0[:, i])[:, None, None] | (w1 <= w0)[:, None, :]
        out.append(cells.masked_fill(empty, 0))
    return torch.stack(out, dim=2)
