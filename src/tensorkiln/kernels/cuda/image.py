"""Image ops on the cuda backend: Resize, Upsample, GridSample, AffineGrid, Col2Im; ImageDecoder
runs on the host.

Resize is separable, as in the reference: for each resized axis the source coordinate of every
output position is computed on the device (in float32, so ties in nearest rounding break as the
reference's do), turned into tap indices and float64 weights (out_len x taps), and applied as one
gather along that axis and a weighted sum over the taps. Integer inputs interpolate in float64 and
round half to even. Resize's roi/scales/sizes, AffineGrid's size and Col2Im's shapes are read on
the host (they decide output shapes). The coordinates, taps and checks are kernels/common/
sampling.py's, shared with the reference; torch's native paths (whole-factor repeats,
F.interpolate, F.grid_sample, F.fold) are tried first where they compute the same.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F

from tensorkiln.kernels.common import sampling
from tensorkiln.kernels.common.image import GRID_SAMPLE_ND, grid_sample_mode
from tensorkiln.kernels.common.resize import (
    UPSAMPLE_SCALES_INPUT,
    legacy_options,
    plan,
    resize_arguments,
    resolve_axes,
    upsample_mode,
)
from tensorkiln.kernels.cuda.convert import host_list, numpy_dtype
from tensorkiln.kernels.cuda.host import register_host
from tensorkiln.kernels.cuda.nn import torch_pads
from tensorkiln.kernels.registry import register

f32, f64 = torch.float32, torch.float64

# ---------------------------------------------------------------------------------------------
# Resize: coordinates, taps, one axis at a time
# ---------------------------------------------------------------------------------------------


class TorchSamplingArrays:
    """:class:`tensorkiln.kernels.common.sampling.SamplingArrays` on torch tensors."""

    m = torch
    float32, float64, int64 = f32, f64, torch.int64

    def astype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    def arange(self, start: int, stop: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(start, stop, dtype=dtype, device=like.device)

    def linspace(self, lo: float, hi: float, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.linspace(lo, hi, n, dtype=f64, device=like.device)


XP = TorchSamplingArrays()


def _along(v: torch.Tensor, axis: int, ndim: int) -> torch.Tensor:
    """A tensor of leading shape (n,) or (n, taps) shaped to broadcast from ``axis`` on."""
    shape = [1] * ndim
    shape[axis : axis + v.ndim] = v.shape
    return v.reshape(shape)


def _resize_axis(data: torch.Tensor, axis: int, n_out: int, scale: float, opts: dict):
    n_in = data.shape[axis]
    ctm = opts["coordinate_transformation_mode"]
    coords = sampling.source_coords(XP, ctm, n_out, n_in, scale, opts["roi"][axis], data)
    x = coords.to(f64)
    if opts["mode"] == "nearest":
        idx = sampling.nearest_index(XP, x, opts["nearest_mode"], scale).clamp(0, n_in - 1)
        out = data.index_select(axis, idx)
    else:
        args = (opts["cubic_coeff_a"], opts["antialias"], opts["exclude_outside"])
        idx, w = sampling.resize_taps(XP, x, opts["mode"], n_in, scale, *args)
        picked = data.index_select(axis, idx.clamp(0, n_in - 1).reshape(-1))
        picked = picked.unflatten(axis, tuple(idx.shape))
        w = w.to(data.dtype)
        out = None
        for t in range(
            idx.shape[1]
        ):  # tap by tap, in the reference's order (exact ties round alike)
            part = picked.select(axis + 1, t) * _along(w[:, t], axis, data.ndim)
            out = part if out is None else out + part
    if ctm == "tf_crop_and_resize":
        outside = _along((x < 0) | (x > n_in - 1), axis, data.ndim)
        fill = torch.tensor(opts["extrapolation_value"], dtype=f64, device=data.device)
        out = torch.where(outside, fill.to(out.dtype), out)
    return out


def _cast_back(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if y.dtype == dtype:
        return y
    if not dtype.is_floating_point and dtype != torch.bool:
        info = torch.iinfo(dtype)
        return torch.round(y).clamp(info.min, info.max).to(dtype)
    return y.to(dtype)


def _host(v: torch.Tensor | np.ndarray | None) -> np.ndarray | None:
    """A small shape-like input (roi, scales, sizes) as a host array of its own dtype."""
    if v is None or isinstance(v, np.ndarray):
        return v
    return np.asarray(host_list(v), dtype=numpy_dtype(v.dtype)).reshape(-1)


def _interp_dtype(dtype: torch.dtype) -> torch.dtype:
    return f32 if dtype in (torch.float16, torch.bfloat16, f32) else f64


# (coordinate mode, nearest mode) pairs that pick source floor(y / f) when upsampling by a whole
# factor f: the fractional part of the source coordinate stays clear of the rounding boundary
_REPEATS = {
    ("asymmetric", "floor"), ("asymmetric", "simple"), ("tf_half_pixel_for_nn", "floor"),
    *((m, r) for m in ("half_pixel", "pytorch_half_pixel", "half_pixel_symmetric")
      for r in ("round_prefer_floor", "round_prefer_ceil")),
}  # fmt: skip


def _whole_factors(shape, axes, out_len, scale, opts) -> dict[int, int] | None:
    """{axis: f} when nearest Resize only repeats every element f times along each axis."""
    if opts["mode"] != "nearest":
        return None
    if (opts["coordinate_transformation_mode"], opts["nearest_mode"]) not in _REPEATS:
        return None
    factors = {}
    for a, n, s in zip(axes, out_len, scale):
        f = n // shape[a] if shape[a] else 0
        if f < 1 or n != f * shape[a] or s != f:
            return None
        factors[a] = f
    return factors


_NEAREST = {
    3: torch.ops.aten.upsample_nearest1d.default,
    4: torch.ops.aten.upsample_nearest2d.default,
    5: torch.ops.aten.upsample_nearest3d.default,
}


def _repeat(x: torch.Tensor, factors: dict[int, int]) -> torch.Tensor:
    """Each element of ``x`` repeated ``factors[axis]`` times along its axes, in one copy."""
    op = _NEAREST.get(x.ndim)
    spatial = all(a >= 2 or f == 1 for a, f in factors.items())
    if op is not None and spatial and x.dtype.is_floating_point:
        fs = [factors.get(a, 1) for a in range(2, x.ndim)]
        if all(f & (f - 1) == 0 for f in fs):
            # torch's kernel takes floor(y * (1 / f)), exact when 1 / f is a power of two
            return op(x, [s * f for s, f in zip(x.shape[2:], fs)], *map(float, fs))
    view, grown, out = [], [], []
    for d, size in enumerate(x.shape):
        f = factors.get(d, 1)
        view += [size, 1]
        grown += [size, f]
        out.append(size * f)
    return x.reshape(view).expand(grown).reshape(out)


_UPSAMPLE = {
    ("linear", 3): torch.ops.aten.upsample_linear1d.default,
    ("linear", 4): torch.ops.aten.upsample_bilinear2d.default,
    ("linear", 5): torch.ops.aten.upsample_trilinear3d.default,
    ("cubic", 4): torch.ops.aten.upsample_bicubic2d.default,
}


def _torch_upsample(x: torch.Tensor, axes, out_len, scale, opts) -> torch.Tensor | None:
    """Linear or cubic Resize through torch's one-pass kernels, where they compute the same
    thing: spatial axes only, float data, no antialias, the half-pixel or align-corners mapping
    (torch clamps taps at the border as the reference's clipped indices do), Keys' a = -0.75."""
    op = _UPSAMPLE.get((opts["mode"], x.ndim))
    ctm = opts["coordinate_transformation_mode"]
    if op is None or not x.dtype.is_floating_point or opts["antialias"]:
        return None
    if opts["mode"] == "cubic" and (opts["cubic_coeff_a"] != -0.75 or opts["exclude_outside"]):
        return None
    size, scales = list(x.shape[2:]), [1.0] * (x.ndim - 2)
    for a, n, s in zip(axes, out_len, scale):
        if a < 2:
            if n != x.shape[a] or s != 1.0:
                return None
            continue
        size[a - 2], scales[a - 2] = n, s
    if ctm == "pytorch_half_pixel" and min(size) > 1:
        ctm = "half_pixel"  # the same mapping unless an axis shrinks to one element
    if ctm not in ("half_pixel", "align_corners"):
        return None
    return op(x, size, ctm == "align_corners", *scales)


def _resize(x: torch.Tensor, roi, scales, sizes, axes, policy: str, **opts) -> torch.Tensor:
    r = x.ndim
    axes = resolve_axes(axes, r)
    out_len, scale = plan(tuple(x.shape), _host(scales), _host(sizes), axes, policy)
    boxes = sampling.resize_boxes(_host(roi), axes, r, opts)
    opts["roi"] = boxes
    factors = _whole_factors(x.shape, axes, out_len, scale, opts)
    if factors is not None:
        return _repeat(x, factors)
    fused = _torch_upsample(x, axes, out_len, scale, opts)
    if fused is not None:
        return fused
    y = x if opts["mode"] == "nearest" else x.to(_interp_dtype(x.dtype))
    for a, n, s in sampling.resampled_axes(x.shape, axes, out_len, scale, boxes, opts):
        y = _resize_axis(y, a, n, s, opts)
    return _cast_back(y, x.dtype)


@register("Resize", backend="cuda")
def resize(
    x: torch.Tensor,
    roi: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    sizes: torch.Tensor | None = None,
    *,
    antialias: int = 0,
    axes: list[int] | None = None,
    coordinate_transformation_mode: str = "half_pixel",
    cubic_coeff_a: float = -0.75,
    exclude_outside: int = 0,
    extrapolation_value: float = 0.0,
    keep_aspect_ratio_policy: str = "stretch",
    mode: str = "nearest",
    nearest_mode: str = "round_prefer_floor",
    _opset: int = 19,
) -> torch.Tensor:
    """Resize ``x`` along ``axes`` (all by default) by ``scales`` or to ``sizes``, with the
    options of the model's opset (:func:`tensorkiln.kernels.common.resize.resize_arguments`;
    Resize-10 takes (X, scales), so its scales arrive as ``roi``)."""
    resolved = resize_arguments(_opset, roi, scales, sizes, locals())
    roi, scales, sizes, axes, policy, opts = resolved
    return _resize(x, roi, scales, sizes, axes, policy, **opts)


@register("Upsample", backend="cuda")
def upsample(
    x: torch.Tensor,
    scales: torch.Tensor | list[float] | None = None,
    *,
    mode: str = "nearest",
    _opset: int = UPSAMPLE_SCALES_INPUT,
) -> torch.Tensor:
    """Upsample ``x`` by ``scales`` (an input from opset 9, a float-list attribute before), as
    Resize-10 does."""
    if scales is None:
        raise ValueError("Upsample: the 'scales' attribute is required")
    if _opset < UPSAMPLE_SCALES_INPUT:
        scales = np.asarray(scales, dtype=np.float32)
    return _resize(x, None, scales, None, None, "stretch", **legacy_options(upsample_mode(mode)))


# ---------------------------------------------------------------------------------------------
# GridSample, AffineGrid
# ---------------------------------------------------------------------------------------------


_TORCH_GRID_MODES = {"linear": "bilinear", "nearest": "nearest", "cubic": "bicubic"}


def _grid_sample(x: torch.Tensor, grid: torch.Tensor, mode: str, padding: str, align: bool):
    nd = x.ndim - 2
    sampling.check_grid(x.shape, grid.shape, padding)
    if nd in (2, 3) and x.dtype.is_floating_point and (mode, padding) != ("cubic", "border"):
        # torch's kernel samples as the reference does, except bicubic at a clamped border;
        # narrow floats are widened so that the coordinates keep float32 precision
        ct = torch.promote_types(torch.promote_types(x.dtype, grid.dtype), f32)
        y = F.grid_sample(x.to(ct), grid.to(ct), _TORCH_GRID_MODES[mode], padding, align)
        return y.to(x.dtype)
    taps = sampling.grid_taps(XP, x.shape[2:], grid, mode, padding, align)
    ct = _interp_dtype(x.dtype)
    n_, ch = x.shape[0], x.shape[1]
    flat_x = x.movedim(1, -1).reshape(-1, ch).to(ct)  # (N * prod(spatial), C)
    batch = torch.arange(n_, device=x.device).reshape((-1,) + (1,) * (grid.ndim - 2))
    out = None
    for combo in itertools.product(*taps):
        flat, w = batch, None
        for (ti, tw), size in zip(combo, x.shape[2:]):
            flat = flat * size + ti
            w = tw if w is None else w * tw
        part = flat_x[flat] * w.to(ct)[..., None]  # (N, *out, C)
        out = part if out is None else out + part
    return out.movedim(-1, 1).to(x.dtype)


@register("GridSample", backend="cuda")
def grid_sample(
    x: torch.Tensor,
    grid: torch.Tensor,
    *,
    align_corners: int = 0,
    mode: str = "linear",
    padding_mode: str = "zeros",
    _opset: int = GRID_SAMPLE_ND,
) -> torch.Tensor:
    """Sample ``x`` at ``grid``'s normalized coordinates: N-d with modes linear / nearest /
    cubic, or before opset 20 4-D with modes bilinear / nearest / bicubic."""
    canonical = grid_sample_mode(mode, x.shape, _opset)
    return _grid_sample(x, grid, canonical, padding_mode, bool(align_corners))


@register("AffineGrid", since=20, backend="cuda")
def affine_grid(theta: torch.Tensor, size: torch.Tensor, *, align_corners: int = 0) -> torch.Tensor:
    """Sampling grid (N, *spatial, nd) of the affine maps ``theta`` (N, nd, nd + 1)."""
    size = [int(s) for s in np.ravel(host_list(size))]
    return sampling.affine_grid(XP, theta, size, bool(align_corners))


# ---------------------------------------------------------------------------------------------
# Col2Im
# ---------------------------------------------------------------------------------------------


@register("Col2Im", since=18, backend="cuda")
def col2im(
    x: torch.Tensor,
    image_shape: torch.Tensor,
    block_shape: torch.Tensor,
    *,
    dilations: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> torch.Tensor:
    """Sum the columns (N, C * prod(block), L) back into images (N, C, *image_shape)."""
    image = [int(v) for v in np.ravel(host_list(image_shape))]
    block = [int(v) for v in np.ravel(host_list(block_shape))]
    padded, blocks, dil, pads, stride = sampling.col2im_geometry(
        x.shape, image, block, dilations, pads, strides
    )
    nd = len(image)
    n, ck = x.shape[:2]
    if nd == 2 and x.dtype.is_floating_point:
        out = F.fold(x, padded, block, dilation=dil, padding=0, stride=stride)
    else:
        kernel = math.prod(block)
        cols = x.reshape(n, ck // kernel, *block, *blocks)
        out = sampling.col2im_taps(
            cols.new_zeros(n, ck // kernel, *padded), cols, block, blocks, dil, stride
        )
    return F.pad(out, torch_pads([-p for p in pads[:nd]], [-p for p in pads[nd:]]))


# ---------------------------------------------------------------------------------------------
# ImageDecoder
# ---------------------------------------------------------------------------------------------

register_host(
    "ImageDecoder",
    "decodes a compressed image (JPEG, PNG, ...) with Pillow, a host library",
)
