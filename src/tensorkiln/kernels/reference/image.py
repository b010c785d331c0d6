"""Image ops: Resize, Upsample, GridSample, AffineGrid, Col2Im, ImageDecoder.

Resize is separable: for each resized axis the source coordinate of every output position is
computed once, turned into tap indices and weights (out_len x taps), and applied as ``taps`` gathers
along that axis plus a weighted sum. Interpolation runs in float64 and is cast back to the input
type (integers rounded half to even and saturated). The coordinates, taps and checks are
kernels/common/sampling.py's, shared with the cuda tree.
"""

from __future__ import annotations

import io
import itertools
import math

import numpy as np

from tensorkiln.kernels.common import sampling
from tensorkiln.kernels.common.image import GRID_SAMPLE_ND, grid_sample_mode
from tensorkiln.kernels.common.resize import (
    UPSAMPLE_SCALES_INPUT,
    legacy_options,
    plan,
    present,
    resize_arguments,
    resolve_axes,
    upsample_mode,
)
from tensorkiln.kernels.registry import register

# ---------------------------------------------------------------------------------------------
# Resize: coordinates, taps, one axis at a time
# ---------------------------------------------------------------------------------------------


class NumpySamplingArrays:
    """:class:`tensorkiln.kernels.common.sampling.SamplingArrays` on numpy arrays."""

    m = np
    float32, float64, int64 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64)

    def astype(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return np.asarray(x).astype(dtype, copy=False)

    def arange(self, start: int, stop: int, dtype: np.dtype, like: np.ndarray) -> np.ndarray:
        return np.arange(start, stop, dtype=dtype)

    def linspace(self, lo: float, hi: float, n: int, like: np.ndarray) -> np.ndarray:
        return np.linspace(lo, hi, n)


XP = NumpySamplingArrays()


def _along(v: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """Reshape a 1-D array to broadcast along ``axis`` of an ndim-dimensional array."""
    shape = [1] * ndim
    shape[axis] = v.shape[0]
    return v.reshape(shape)


def _resize_axis(data: np.ndarray, axis: int, n_out: int, scale: float, opts: dict) -> np.ndarray:
    n_in = data.shape[axis]
    ctm = opts["coordinate_transformation_mode"]
    coords = sampling.source_coords(XP, ctm, n_out, n_in, scale, opts["roi"][axis], data)
    x = coords.astype(np.float64)
    if opts["mode"] == "nearest":
        idx = np.clip(sampling.nearest_index(XP, x, opts["nearest_mode"], scale), 0, n_in - 1)
        out = np.take(data, idx, axis=axis)
    else:
        idx, w = sampling.resize_taps(
            XP,
            x,
            opts["mode"],
            n_in,
            scale,
            opts["cubic_coeff_a"],
            opts["antialias"],
            opts["exclude_outside"],
        )
        idx = np.clip(idx, 0, n_in - 1)
        out = np.zeros((*data.shape[:axis], n_out, *data.shape[axis + 1 :]), np.float64)
        for t in range(idx.shape[1]):
            out += np.take(data, idx[:, t], axis=axis) * _along(w[:, t], axis, data.ndim)
    if ctm == "tf_crop_and_resize":
        outside = _along((x < 0) | (x > n_in - 1), axis, data.ndim)
        out = np.where(outside, np.asarray(opts["extrapolation_value"]).astype(out.dtype), out)
    return out


def _cast_back(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if y.dtype == dtype:
        return y
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.rint(y), info.min, info.max).astype(dtype)
    return y.astype(dtype)


def _resize(x: np.ndarray, roi, scales, sizes, axes, policy: str, **opts) -> np.ndarray:
    r = x.ndim
    axes = resolve_axes(axes, r)
    out_len, scale = plan(x.shape, scales, sizes, axes, policy)
    boxes = sampling.resize_boxes(roi if present(roi) else None, axes, r, opts)
    opts["roi"] = boxes
    y = x if opts["mode"] == "nearest" else x.astype(np.float64)
    for a, n, s in sampling.resampled_axes(x.shape, axes, out_len, scale, boxes, opts):
        y = _resize_axis(y, a, n, s, opts)
    return _cast_back(y, x.dtype)


@register("Resize")
def resize(
    x: np.ndarray,
    roi: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    sizes: np.ndarray | None = None,
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
) -> np.ndarray:
    """Resize ``x`` along ``axes`` (all by default) by ``scales`` or to ``sizes``, with the
    options of the model's opset (:func:`tensorkiln.kernels.common.resize.resize_arguments`;
    Resize-10 takes (X, scales), so its scales arrive as ``roi``)."""
    resolved = resize_arguments(_opset, roi, scales, sizes, locals())
    roi, scales, sizes, axes, policy, opts = resolved
    return _resize(x, roi, scales, sizes, axes, policy, **opts)


@register("Upsample")
def upsample(
    x: np.ndarray,
    scales: np.ndarray | list[float] | None = None,
    *,
    mode: str = "nearest",
    _opset: int = UPSAMPLE_SCALES_INPUT,
) -> np.ndarray:
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


def _grid_sample(x: np.ndarray, grid: np.ndarray, mode: str, padding: str, align: bool):
    sampling.check_grid(x.shape, grid.shape, padding)
    taps = sampling.grid_taps(XP, x.shape[2:], grid, mode, padding, align)
    xt = np.moveaxis(x, 1, -1)  # (N, *spatial, C): gathers then give (N, *out, C)
    n = np.arange(x.shape[0]).reshape((-1,) + (1,) * (grid.ndim - 2))
    out = np.zeros((*grid.shape[:-1], x.shape[1]), np.float64)
    for combo in itertools.product(*taps):
        w = np.prod([tw for _, tw in combo], axis=0)
        out += xt[(n, *[ti for ti, _ in combo])] * w[..., None]
    return np.moveaxis(out, -1, 1).astype(x.dtype)


@register("GridSample")
def grid_sample(
    x: np.ndarray,
    grid: np.ndarray,
    *,
    align_corners: int = 0,
    mode: str = "linear",
    padding_mode: str = "zeros",
    _opset: int = GRID_SAMPLE_ND,
) -> np.ndarray:
    """Sample ``x`` at ``grid``'s normalized coordinates: N-d with modes linear / nearest /
    cubic, or before opset 20 4-D with modes bilinear / nearest / bicubic."""
    canonical = grid_sample_mode(mode, x.shape, _opset)
    return _grid_sample(x, grid, canonical, padding_mode, bool(align_corners))


@register("AffineGrid", since=20)
def affine_grid(theta: np.ndarray, size: np.ndarray, *, align_corners: int = 0) -> np.ndarray:
    """Sampling grid (N, *spatial, nd) of the affine maps ``theta`` (N, nd, nd + 1)."""
    size = [int(s) for s in np.asarray(size).reshape(-1)]
    return sampling.affine_grid(XP, theta, size, bool(align_corners))


# ---------------------------------------------------------------------------------------------
# Col2Im
# ---------------------------------------------------------------------------------------------


@register("Col2Im", since=18)
def col2im(
    x: np.ndarray,
    image_shape: np.ndarray,
    block_shape: np.ndarray,
    *,
    dilations: list[int] | None = None,
    pads: list[int] | None = None,
    strides: list[int] | None = None,
) -> np.ndarray:
    """Sum the columns (N, C * prod(block), L) back into images (N, C, *image_shape)."""
    image = [int(v) for v in np.asarray(image_shape).reshape(-1)]
    block = [int(v) for v in np.asarray(block_shape).reshape(-1)]
    padded, blocks, dil, pads, stride = sampling.col2im_geometry(
        x.shape, image, block, dilations, pads, strides
    )
    nd = len(image)
    n, ck = x.shape[:2]
    kernel = math.prod(block)
    cols = x.reshape(n, ck // kernel, *block, *blocks)
    out = np.zeros((n, ck // kernel, *padded), x.dtype)
    sampling.col2im_taps(out, cols, block, blocks, dil, stride)
    crop = tuple(slice(pads[d], pads[d] + image[d]) for d in range(nd))
    return out[(..., *crop)]


# ---------------------------------------------------------------------------------------------
# ImageDecoder
# ---------------------------------------------------------------------------------------------


@register("ImageDecoder", since=20)
def image_decoder(encoded_stream: np.ndarray, *, pixel_format: str = "RGB") -> np.ndarray:
    """Decode an encoded image (uint8 bytes) to uint8 (H, W, 3) RGB/BGR or (H, W, 1) grayscale."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(
            "ImageDecoder needs Pillow to decode images; install it with `pip install pillow`"
        ) from exc
    if pixel_format not in ("RGB", "BGR", "Grayscale"):
        raise ValueError(
            f"ImageDecoder: pixel_format '{pixel_format}' is not RGB, BGR or Grayscale"
        )
    try:
        img = Image.open(io.BytesIO(np.asarray(encoded_stream, np.uint8).tobytes()))
        img.load()
    except Exception as exc:  # Pillow raises several types for bad data
        raise ValueError(f"ImageDecoder: could not decode the image: {exc}") from exc
    if pixel_format == "Grayscale":
        return np.asarray(img.convert("L"), np.uint8)[:, :, None]
    rgb = np.asarray(img.convert("RGB"), np.uint8)
    return np.ascontiguousarray(rgb[:, :, ::-1]) if pixel_format == "BGR" else rgb
