"""DeformConv written once for both kernel trees: X sampled multi-linearly at the kernel taps
shifted by ``offset`` (zero outside X), scaled by ``mask``, then one GEMM per group.

The sampling is the whole op; no library has it (torchvision's deform_conv2d is 2-D only and not a
dependency), so the device runs the same gathers as the host. The few array operations numpy and
torch spell differently go through a :class:`DeformArrays` adapter (numpy in
kernels/reference/nn.py, torch in kernels/cuda/nn.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Protocol

from tensorkiln.kernels.common.conv import check_conv_shapes, conv_geometry
from tensorkiln.kernels.common.window import Geometry


class DeformArrays(Protocol):
    """The array operations DeformConv needs, on one backend's arrays."""

    m: Any  # the array module (numpy or torch): floor, clip, ones_like, zeros_like, matmul
    int64: Any  # the backend's int64 dtype

    def compute_dtype(self, dtype: Any) -> Any:
        """float32 for narrow floats and bytes, else ``dtype``."""

    def astype(self, x: Any, dtype: Any) -> Any: ...

    def zeros(self, shape: tuple[int, ...], like: Any) -> Any:
        """Zeros of ``shape`` with ``like``'s dtype and device."""

    def grid(self, sizes: Sequence[int], like: Any) -> Any:
        """(len(sizes), prod(sizes)) int64 coordinates of every position of a grid, row-major."""

    def take_last(self, x: Any, index: Any) -> Any:
        """``x`` gathered along its last axis at ``index`` (broadcast over the other axes)."""


def _check_offset_mask(x, offset, mask, g: Geometry, offset_group: int) -> None:
    nsp, taps = len(x.shape) - 2, math.prod(g.kernel)
    want = (x.shape[0], offset_group * taps * nsp, *g.out)
    if offset_group < 1 or x.shape[1] % offset_group or tuple(offset.shape) != want:
        raise ValueError(
            f"DeformConv: offset has shape {tuple(offset.shape)}, expected {want} for X "
            f"{tuple(x.shape)}, kernel {g.kernel} and offset_group={offset_group} (which must "
            "divide C)"
        )
    if mask is not None and math.prod(mask.shape) != x.shape[0] * offset_group * taps * math.prod(
        g.out
    ):
        raise ValueError(
            f"DeformConv: mask of shape {tuple(mask.shape)} does not match offset {want}"
        )


def _positions(xp: DeformArrays, x, offset, g: Geometry, offset_group: int) -> list:
    """Per spatial axis, the (N, offset_group, taps, P) sampling coordinates (fractional)."""
    n, nsp = x.shape[0], len(x.shape) - 2
    taps, p = math.prod(g.kernel), math.prod(g.out)
    off = xp.astype(offset, x.dtype).reshape(n, offset_group, taps, nsp, p)
    out_at = xp.grid(g.out, x).reshape(nsp, 1, p)
    tap_at = xp.grid(g.kernel, x).reshape(nsp, taps, 1)
    return [
        out_at[d] * g.strides[d] - g.begin[d] + tap_at[d] * g.dilations[d] + off[:, :, :, d]
        for d in range(nsp)
    ]


def _columns(xp: DeformArrays, x, offset, mask, g: Geometry, offset_group: int):
    """The (N, C*prod(kernel), P) columns of ``x`` sampled multi-linearly at the shifted taps."""
    n, c = x.shape[:2]
    in_sizes = tuple(x.shape[2:])
    nsp, taps, p = len(in_sizes), math.prod(g.kernel), math.prod(g.out)
    pos = _positions(xp, x, offset, g, offset_group)
    low = [xp.m.floor(q) for q in pos]
    frac = [q - lo for q, lo in zip(pos, low)]
    low = [xp.astype(lo, xp.int64) for lo in low]
    cg = c // offset_group
    xs = x.reshape(n, offset_group, cg, math.prod(in_sizes))
    cols = xp.zeros((n, offset_group, cg, taps * p), x)
    flat_stride = [math.prod(in_sizes[d + 1 :]) for d in range(nsp)]
    shape = (n, offset_group, 1, taps * p)
    for corner in itertools.product((0, 1), repeat=nsp):
        weight = xp.m.ones_like(frac[0])
        flat = xp.m.zeros_like(low[0])
        for d, bit in enumerate(corner):
            idx = low[d] + bit
            inside = (idx >= 0) & (idx < in_sizes[d])
            weight = weight * (frac[d] if bit else 1 - frac[d]) * inside
            flat = flat + xp.m.clip(idx, 0, in_sizes[d] - 1) * flat_stride[d]
        if mask is not None:
            weight = weight * mask.reshape(weight.shape)
        cols = cols + xp.take_last(xs, flat.reshape(shape)) * weight.reshape(shape)
    return cols.reshape(n, c * taps, p)


def _bias(xp: DeformArrays, b, m: int, dtype: Any):
    if b is None:
        return None
    if math.prod(b.shape) != m:
        raise ValueError(
            f"DeformConv: bias B has {math.prod(b.shape)} values but there are {m} output channels"
        )
    return xp.astype(b.reshape(m), dtype)


class DeformConv:
    """The DeformConv kernel over one backend's :class:`DeformArrays`."""

    def __init__(self, xp: DeformArrays) -> None:
        self.xp = xp

    def deform_conv(
        self,
        x: Any,
        w: Any,
        offset: Any,
        b: Any = None,
        mask: Any = None,
        *,
        dilations: Sequence[int] | None = None,
        group: int = 1,
        kernel_shape: Sequence[int] | None = None,
        offset_group: int = 1,
        pads: Sequence[int] | None = None,
        strides: Sequence[int] | None = None,
    ) -> Any:
        """Deformable convolution: sample X at offset taps (zero outside), scale by mask, GEMM."""
        xp = self.xp
        check_conv_shapes(x.shape, w.shape, group, "DeformConv")
        g = conv_geometry(x.shape, w.shape, "NOTSET", dilations, kernel_shape, pads, strides)
        _check_offset_mask(x, offset, mask, g, offset_group)
        ct = xp.compute_dtype(x.dtype)
        mc = None if mask is None else xp.astype(mask, ct)
        cols = _columns(xp, xp.astype(x, ct), offset, mc, g, offset_group)
        n, ck, p = cols.shape
        m = w.shape[0]
        # explicit sizes, never -1: a reshape cannot infer one when another axis is 0 (N=0, M=0)
        wg = xp.astype(w, ct).reshape(group, m // group, ck // group)
        y = xp.m.matmul(wg, cols.reshape(n, group, ck // group, p)).reshape(n, m, *g.out)
        bias = _bias(xp, b, m, ct)
        if bias is not None:
            y = y + bias.reshape(m, *([1] * len(g.out)))
        return xp.astype(y, x.dtype)
