"""Resampling math written once for both kernel trees: Resize's source coordinates and taps,
GridSample's coordinates, padding and taps, AffineGrid's grid, Col2Im's geometry and tap sums.

What stays in each tree is the part the hardware changes: the gathers and weighted sums over the
input (``np.take`` and fancy indexing; ``index_select`` and torch's fused paths such as
F.interpolate, F.grid_sample and F.fold, which the cuda kernels try first). The coordinates and
weights are computed here on the arrays of the input's backend (on the device for cuda, so
nothing is read back), through a :class:`SamplingArrays` adapter for the few operations numpy and
torch spell differently; the rest is spelled alike by both modules (floor, ceil, where, clip,
round, remainder, full_like, meshgrid, stack, einsum, ``sum(axis=, keepdims=)``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class SamplingArrays(Protocol):
    """The array operations the resampling math needs, on one backend's arrays."""

    m: Any  # the array module (numpy or torch)
    float32: Any
    float64: Any
    int64: Any

    def astype(self, x: Any, dtype: Any) -> Any: ...

    def arange(self, start: int, stop: int, dtype: Any, like: Any) -> Any:
        """``[start, stop)`` of ``dtype``, beside ``like`` (its device)."""

    def linspace(self, lo: float, hi: float, n: int, like: Any) -> Any:
        """``n`` float64 values from ``lo`` to ``hi``, beside ``like``."""


# ---------------------------------------------------------------------------------------------
# Resize
# ---------------------------------------------------------------------------------------------


def source_coords(
    xp: SamplingArrays, ctm: str, n_out: int, n_in: int, scale: float, roi, like: Any
) -> Any:
    """The input coordinate (float32) of every output position along one axis.

    ``length_resized`` in the spec's formulas is the output length ``n_out``, as in onnxruntime,
    TensorRT and PyTorch (the ONNX reference implementation uses the unrounded ``scale * n_in``,
    which differs when scales are given). Computed in float32 like onnxruntime, so that exact ties
    in nearest rounding (scale 0.7: 3.5 / 0.7 - 0.5 = 4.5) break the same way; the scalar parts
    are numpy float32 scalars, passed to the array arithmetic as Python floats (exact).
    """
    y = xp.arange(0, n_out, xp.float32, like)
    s = np.float32(scale)
    length = np.float32(n_out)
    if ctm == "half_pixel":
        return (y + 0.5) / float(s) - 0.5
    if ctm == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - length / (s * np.float32(n_in)))
        return float(np.float32(offset)) + (y + 0.5) / float(s) - 0.5
    if ctm == "pytorch_half_pixel":
        return (y + 0.5) / float(s) - 0.5 if length > 1 else xp.m.zeros_like(y)
    if ctm == "align_corners":
        return y * (n_in - 1) / float(length - 1) if length != 1 else xp.m.zeros_like(y)
    if ctm == "asymmetric":
        return y / float(s)
    if ctm == "tf_half_pixel_for_nn":
        return (y + 0.5) / float(s)
    if ctm == "tf_crop_and_resize":
        start, end = roi
        if length == 1:
            return xp.m.full_like(y, float(np.float32(0.5 * (start + end) * (n_in - 1))))
        a, b = np.float32(start * (n_in - 1)), np.float32(end - start)
        return float(a) + y * float(b) * (n_in - 1) / float(length - 1)
    raise ValueError(f"Resize: unknown coordinate_transformation_mode '{ctm}'")


def nearest_index(xp: SamplingArrays, x: Any, nearest_mode: str, scale: float) -> Any:
    """The int64 source index of every coordinate in ``x`` under ``nearest_mode``."""
    m = xp.m
    if nearest_mode == "round_prefer_floor":
        idx = m.ceil(x - 0.5)
    elif nearest_mode == "round_prefer_ceil":
        idx = m.floor(x + 0.5)
    elif nearest_mode == "floor":
        idx = m.floor(x)
    elif nearest_mode == "ceil":
        idx = m.ceil(x)
    elif nearest_mode == "simple":  # opset < 11 (Resize-10, Upsample), as onnxruntime does it
        idx = m.ceil(x) if scale < 1 else m.floor(x)
    else:
        raise ValueError(f"Resize: unknown nearest_mode '{nearest_mode}'")
    return xp.astype(idx, xp.int64)


def linear_kernel(m: Any, s: Any, a: float) -> Any:
    """The triangle (linear interpolation) kernel; ``a`` is unused."""
    return m.clip(1 - m.abs(s), 0, None)


def cubic_kernel(m: Any, s: Any, a: float) -> Any:
    """Keys' cubic convolution kernel with coefficient ``a``."""
    s = m.abs(s)
    near = ((a + 2) * s - (a + 3)) * s * s + 1
    far = ((a * s - 5 * a) * s + 8 * a) * s - 4 * a
    return m.where(s <= 1, near, m.where(s < 2, far, 0.0))


def resize_taps(
    xp: SamplingArrays,
    x: Any,
    mode: str,
    n_in: int,
    scale: float,
    a: float,
    antialias: bool,
    exclude: bool,
) -> tuple[Any, Any]:
    """Tap indices (unclipped) and float64 weights, both (len(x), taps), for linear or cubic."""
    m = xp.m
    kernel, radius = (linear_kernel, 1) if mode == "linear" else (cubic_kernel, 2)
    # Antialiasing stretches the filter by 1/scale when downsampling.
    stretch = min(scale, 1.0) if antialias else 1.0
    start = int(np.floor(-radius / stretch)) + 1
    offsets = xp.arange(start, 2 - start, xp.float64, x)
    base = m.ceil(x) - 1  # the tap left of x; ratio in (0, 1]
    ratio = x - base
    idx = xp.astype(base, xp.int64)[:, None] + xp.astype(offsets, xp.int64)
    w = kernel(m, (offsets - ratio[:, None]) * stretch, a)
    if antialias:
        w = w / w.sum(axis=1, keepdims=True)
    if exclude:
        w = m.where((idx < 0) | (idx >= n_in), 0.0, w)
        total = w.sum(axis=1, keepdims=True)
        w = w / m.where(total == 0, 1.0, total)
    return idx, w


def resize_boxes(roi: Any, axes: Sequence[int], rank: int, opts: dict) -> list[tuple]:
    """Every axis's (start, end) crop box (float32) from the host ``roi``, (0, 1) where it is not
    cropped; ValueError for an unknown mode or a missing or mis-sized roi."""
    boxes: list[tuple] = [(0.0, 1.0)] * rank
    if opts["coordinate_transformation_mode"] == "tf_crop_and_resize":
        box = None if roi is None else np.asarray(roi, dtype=np.float64).reshape(-1)
        if box is None or box.size != 2 * len(axes):
            raise ValueError(f"Resize: tf_crop_and_resize needs an roi of {2 * len(axes)} values")
        for i, a in enumerate(axes):
            boxes[a] = (np.float32(box[i]), np.float32(box[i + len(axes)]))
    if opts["mode"] not in ("nearest", "linear", "cubic"):
        raise ValueError(f"Resize: unknown mode '{opts['mode']}'")
    return boxes


def resampled_axes(shape, axes, out_len, scale, boxes, opts: dict) -> list[tuple[int, int, float]]:
    """The (axis, output length, scale) of every resized axis that is not the identity."""
    shifted = opts["coordinate_transformation_mode"] == "tf_half_pixel_for_nn"
    return [
        (a, n, s)
        for a, n, s in zip(axes, out_len, scale)
        if not (n == shape[a] and s == 1.0 and boxes[a] == (0.0, 1.0) and not shifted)
    ]


# ---------------------------------------------------------------------------------------------
# GridSample
# ---------------------------------------------------------------------------------------------


def check_grid(x_shape: Sequence[int], grid_shape: Sequence[int], padding: str) -> None:
    """Raise ValueError unless ``grid`` is (N, *output_spatial, nd) for X (N, C, *spatial) and the
    padding mode is known."""
    x, grid = tuple(x_shape), tuple(grid_shape)
    nd = len(x) - 2
    if len(grid) != nd + 2 or grid[-1] != nd or grid[0] != x[0]:
        raise ValueError(
            f"GridSample: grid of shape {grid} does not fit input of shape {x}; "
            f"expected (N={x[0]}, *output_spatial ({nd} dims), {nd})"
        )
    if padding not in ("zeros", "border", "reflection"):
        raise ValueError(f"GridSample: unknown padding_mode '{padding}'")


def reflect(m: Any, x: Any, lo: float, hi: float) -> Any:
    """Reflect ``x`` at the borders lo and hi until it lies between them."""
    span = hi - lo
    if span <= 0:
        return m.full_like(x, lo)
    below = x < lo
    dx = m.where(below, lo - x, x - hi)
    n = m.floor(dx / span)
    r = dx - n * span
    even = m.remainder(n, 2) == 0
    inside_low = m.where(even, lo + r, hi - r)  # reflected off the low border
    inside_high = m.where(even, hi - r, lo + r)
    out = m.where(below, inside_low, inside_high)
    return m.where((x < lo) | (x > hi), out, x)


def _pad_tap(xp: SamplingArrays, i: Any, size: int, padding: str, lo: float, hi: float):
    """Index into an axis of ``size`` for tap ``i``, and a 0/1 weight (zeros padding)."""
    if padding == "zeros":
        return xp.m.clip(i, 0, size - 1), xp.astype((i >= 0) & (i < size), xp.float64)
    if padding == "reflection":
        i = xp.astype(reflect(xp.m, xp.astype(i, xp.float64), lo, hi), xp.int64)
    return xp.m.clip(i, 0, size - 1), None


def _axis_taps(xp: SamplingArrays, c: Any, mode: str, size: int, padding: str, lo, hi) -> list:
    """(index, weight) for each tap of one spatial axis at coordinates ``c``."""
    m = xp.m
    if mode == "nearest":
        base, weights = xp.astype(c, xp.int64), [m.ones_like(c)]
    else:
        base = xp.astype(m.floor(c), xp.int64)
        t = c - base
        if mode == "linear":
            weights = [1 - t, t]
        else:
            weights = [cubic_kernel(m, t + 1, -0.75), cubic_kernel(m, t, -0.75)]
            weights += [cubic_kernel(m, 1 - t, -0.75), cubic_kernel(m, 2 - t, -0.75)]
            base = base - 1
    taps = []
    for k, w in enumerate(weights):
        idx, valid = _pad_tap(xp, base + k, size, padding, lo, hi)
        taps.append((idx, w if valid is None else w * valid))
    return taps


def grid_taps(
    xp: SamplingArrays, spatial: Sequence[int], grid: Any, mode: str, padding: str, align: bool
) -> list[list]:
    """Per spatial axis of X, the (index, float64 weight) pairs of its taps at ``grid``'s
    normalized coordinates, each (N, *output_spatial)."""
    m, nd = xp.m, len(spatial)
    taps = []
    for k, size in enumerate(spatial):
        g = xp.astype(grid[..., nd - 1 - k], xp.float64)  # grid's last entry indexes axis 0
        c = (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        if mode == "nearest":
            c = m.round(c)  # half to even in both modules
        outside = (c < lo) | (c > hi)
        if padding == "border":
            c = m.where(outside, m.clip(c, 0, size - 1), c)
        elif padding == "reflection":
            c = m.where(outside, reflect(m, c, lo, hi), c)
        taps.append(_axis_taps(xp, c, mode, size, padding, lo, hi))
    return taps


# ---------------------------------------------------------------------------------------------
# AffineGrid
# ---------------------------------------------------------------------------------------------


def _base_coords(xp: SamplingArrays, length: int, align: bool, like: Any) -> Any:
    """Normalized [-1, 1] coordinates of ``length`` pixels (as torch.nn.functional.affine_grid)."""
    c = xp.linspace(-1.0, 1.0, length, like)
    return c if align or length == 0 else c * (length - 1) / length


def affine_grid(xp: SamplingArrays, theta: Any, size: Sequence[int], align: bool) -> Any:
    """Sampling grid (N, *spatial, nd) of the affine maps ``theta`` (N, nd, nd + 1) for the host
    ``size`` (N, C, *spatial)."""
    spatial = list(size[2:])
    nd = len(spatial)
    if nd not in (2, 3) or tuple(theta.shape) != (size[0], nd, nd + 1):
        raise ValueError(
            f"AffineGrid: theta of shape {tuple(theta.shape)} does not fit size {list(size)}; "
            "expected size of 4 or 5 values and theta of shape (N, nd, nd + 1)"
        )
    m = xp.m
    axes = [_base_coords(xp, n, align, theta) for n in spatial]
    mesh = m.meshgrid(*axes, indexing="ij")  # (D,) H, W
    base = m.stack([*mesh[::-1], m.ones_like(mesh[0])], axis=-1)  # x, y, (z), 1
    out = m.einsum("...k,njk->n...j", base, xp.astype(theta, xp.float64))
    return xp.astype(out, theta.dtype)


# ---------------------------------------------------------------------------------------------
# Col2Im
# ---------------------------------------------------------------------------------------------


def col2im_geometry(
    x_shape: Sequence[int],
    image: list[int],
    block: list[int],
    dilations: Sequence[int] | None,
    pads: Sequence[int] | None,
    strides: Sequence[int] | None,
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Col2Im's (padded image, block positions, dilations, pads, strides) for columns of
    ``x_shape`` (N, C * prod(block), L) and the host ``image`` and ``block`` shapes."""
    nd = len(image)
    dil = list(dilations or [1] * nd)
    stride = list(strides or [1] * nd)
    pads = list(pads or [0] * 2 * nd)
    if len(block) != nd or len(dil) != nd or len(stride) != nd or len(pads) != 2 * nd:
        raise ValueError("Col2Im: image_shape, block_shape, dilations, strides, pads disagree")
    padded = [image[d] + pads[d] + pads[d + nd] for d in range(nd)]
    blocks = [(padded[d] - dil[d] * (block[d] - 1) - 1) // stride[d] + 1 for d in range(nd)]
    _, ck, length = tuple(x_shape)
    if ck % math.prod(block) or length != math.prod(blocks) or min(blocks) <= 0:
        raise ValueError(
            f"Col2Im: input of shape {tuple(x_shape)} does not fit block_shape {block} and "
            f"{blocks} block positions (from image_shape {image})"
        )
    return padded, blocks, dil, pads, stride


def col2im_taps(out: Any, cols: Any, block, blocks, dil, stride) -> Any:
    """Sum (N, C, *block, *blocks) columns into ``out`` (N, C, *padded), one kernel tap at a
    time, in place."""
    nd = len(block)
    for k in itertools.product(*[range(b) for b in block]):
        where = tuple(
            slice(k[d] * dil[d], k[d] * dil[d] + stride[d] * (blocks[d] - 1) + 1, stride[d])
            for d in range(nd)
        )
        out[(..., *where)] += cols[(slice(None), slice(None), *k)]
    return out
