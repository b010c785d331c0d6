"""Image ops: Resize, Upsample, GridSample, AffineGrid, Col2Im, ImageDecoder.

Resize is separable: for each resized axis the source coordinate of every output position is
computed once, turned into tap indices and weights (out_len x taps), and applied as ``taps`` gathers
along that axis plus a weighted sum. Interpolation runs in float64 and is cast back to the input
type (integers rounded half to even and saturated).
"""

from __future__ import annotations

import io
import itertools

import numpy as np

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


def _source_coords(
    ctm: str, n_out: int, n_in: int, scale: float, roi: tuple[float, float]
) -> np.ndarray:
    """The input coordinate of every output position along one axis.

    ``length_resized`` in the spec's formulas is the output length ``n_out``, as in onnxruntime,
    TensorRT and PyTorch (the ONNX reference implementation uses the unrounded ``scale * n_in``,
    which differs when scales are given). Computed in float32 like onnxruntime, so that exact ties
    in nearest rounding (scale 0.7: 3.5 / 0.7 - 0.5 = 4.5) break the same way.
    """
    y = np.arange(n_out, dtype=np.float32)
    scale = np.float32(scale)
    length = np.float32(n_out)
    if ctm == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if ctm == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - length / (scale * np.float32(n_in)))
        return offset + (y + 0.5) / scale - 0.5
    if ctm == "pytorch_half_pixel":
        return (y + 0.5) / scale - 0.5 if length > 1 else np.zeros(n_out, np.float32)
    if ctm == "align_corners":
        return y * (n_in - 1) / (length - 1) if length != 1 else np.zeros(n_out, np.float32)
    if ctm == "asymmetric":
        return y / scale
    if ctm == "tf_half_pixel_for_nn":
        return (y + 0.5) / scale
    if ctm == "tf_crop_and_resize":
        start, end = roi
        if length == 1:
            return np.full(n_out, 0.5 * (start + end) * (n_in - 1), np.float32)
        return start * (n_in - 1) + y * (end - start) * (n_in - 1) / (length - 1)
    raise ValueError(f"Resize: unknown coordinate_transformation_mode '{ctm}'")


def _nearest_index(x: np.ndarray, nearest_mode: str, scale: float) -> np.ndarray:
    if nearest_mode == "round_prefer_floor":
        idx = np.ceil(x - 0.5)
    elif nearest_mode == "round_prefer_ceil":
        idx = np.floor(x + 0.5)
    elif nearest_mode == "floor":
        idx = np.floor(x)
    elif nearest_mode == "ceil":
        idx = np.ceil(x)
    elif nearest_mode == "simple":  # opset < 11 (Resize-10, Upsample), as onnxruntime does it
        idx = np.ceil(x) if scale < 1 else np.floor(x)
    else:
        raise ValueError(f"Resize: unknown nearest_mode '{nearest_mode}'")
    return idx.astype(np.int64)


def _linear_kernel(s: np.ndarray, a: float) -> np.ndarray:
    return np.clip(1 - np.abs(s), 0, None)


def _cubic_kernel(s: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with coefficient ``a``."""
    s = np.abs(s)
    near = ((a + 2) * s - (a + 3)) * s * s + 1
    far = ((a * s - 5 * a) * s + 8 * a) * s - 4 * a
    return np.where(s <= 1, near, np.where(s < 2, far, 0.0))


def _taps(
    x: np.ndarray, mode: str, n_in: int, scale: float, a: float, antialias: bool, exclude: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Tap indices (unclipped) and weights, both (len(x), taps), for linear or cubic."""
    kernel, radius = (_linear_kernel, 1) if mode == "linear" else (_cubic_kernel, 2)
    # Antialiasing stretches the filter by 1/scale when downsampling.
    stretch = min(scale, 1.0) if antialias else 1.0
    start = int(np.floor(-radius / stretch)) + 1
    offsets = np.arange(start, 2 - start)
    base = np.ceil(x) - 1  # the tap left of x; ratio in (0, 1]
    ratio = x - base
    idx = base.astype(np.int64)[:, None] + offsets
    w = kernel((offsets - ratio[:, None]) * stretch, a)
    if antialias:
        w = w / w.sum(axis=1, keepdims=True)
    if exclude:
        w = np.where((idx < 0) | (idx >= n_in), 0.0, w)
        total = w.sum(axis=1, keepdims=True)
        w = w / np.where(total == 0, 1.0, total)
    return idx, w


def _along(v: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """Reshape a 1-D array to broadcast along ``axis`` of an ndim-dimensional array."""
    shape = [1] * ndim
    shape[axis] = v.shape[0]
    return v.reshape(shape)


def _resize_axis(data: np.ndarray, axis: int, n_out: int, scale: float, opts: dict) -> np.ndarray:
    n_in = data.shape[axis]
    ctm = opts["coordinate_transformation_mode"]
    x = _source_coords(ctm, n_out, n_in, scale, opts["roi"][axis]).astype(np.float64)
    if opts["mode"] == "nearest":
        idx = np.clip(_nearest_index(x, opts["nearest_mode"], scale), 0, n_in - 1)
        out = np.take(data, idx, axis=axis)
    else:
        idx, w = _taps(
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
    boxes = [(0.0, 1.0)] * r
    if opts["coordinate_transformation_mode"] == "tf_crop_and_resize":
        if not present(roi) or np.asarray(roi).size != 2 * len(axes):
            raise ValueError(f"Resize: tf_crop_and_resize needs an roi of {2 * len(axes)} values")
        roi = np.asarray(roi, dtype=np.float64).reshape(-1)
        for i, a in enumerate(axes):
            boxes[a] = (np.float32(roi[i]), np.float32(roi[i + len(axes)]))
    opts["roi"] = boxes
    if opts["mode"] not in ("nearest", "linear", "cubic"):
        raise ValueError(f"Resize: unknown mode '{opts['mode']}'")
    y = x if opts["mode"] == "nearest" else x.astype(np.float64)
    shifted = opts["coordinate_transformation_mode"] == "tf_half_pixel_for_nn"
    for a, n, s in zip(axes, out_len, scale):
        if n == x.shape[a] and s == 1.0 and boxes[a] == (0.0, 1.0) and not shifted:
            continue  # the identity along this axis
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


def _reflect(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Reflect ``x`` at the borders lo and hi until it lies between them."""
    span = hi - lo
    if span <= 0:
        return np.full_like(x, lo)
    below = x < lo
    dx = np.where(below, lo - x, x - hi)
    n = np.floor(dx / span)
    r = dx - n * span
    even = n % 2 == 0
    inside_low = np.where(even, lo + r, hi - r)  # reflected off the low border
    inside_high = np.where(even, hi - r, lo + r)
    out = np.where(below, inside_low, inside_high)
    return np.where((x < lo) | (x > hi), out, x)


def _pad_tap(i: np.ndarray, size: int, padding: str, lo: float, hi: float):
    """Index into an axis of ``size`` for tap ``i``, and a 0/1 weight (zeros padding)."""
    if padding == "zeros":
        return np.clip(i, 0, size - 1), ((i >= 0) & (i < size)).astype(np.float64)
    if padding == "reflection":
        i = _reflect(i.astype(np.float64), lo, hi).astype(np.int64)
    return np.clip(i, 0, size - 1), None


def _grid_taps(c: np.ndarray, mode: str, size: int, padding: str, lo: float, hi: float):
    """(index, weight) for each tap of one spatial axis at coordinates ``c``."""
    if mode == "nearest":
        base, weights = c.astype(np.int64), [np.ones_like(c)]
    else:
        base = np.floor(c).astype(np.int64)
        t = c - base
        if mode == "linear":
            weights = [1 - t, t]
        else:
            weights = [_cubic_kernel(t + 1, -0.75), _cubic_kernel(t, -0.75)]
            weights += [_cubic_kernel(1 - t, -0.75), _cubic_kernel(2 - t, -0.75)]
            base = base - 1
    taps = []
    for k, w in enumerate(weights):
        idx, valid = _pad_tap(base + k, size, padding, lo, hi)
        taps.append((idx, w if valid is None else w * valid))
    return taps


def _grid_sample(x: np.ndarray, grid: np.ndarray, mode: str, padding: str, align: bool):
    nd = x.ndim - 2
    if grid.ndim != nd + 2 or grid.shape[-1] != nd or grid.shape[0] != x.shape[0]:
        raise ValueError(
            f"GridSample: grid of shape {grid.shape} does not fit input of shape {x.shape}; "
            f"expected (N={x.shape[0]}, *output_spatial ({nd} dims), {nd})"
        )
    if padding not in ("zeros", "border", "reflection"):
        raise ValueError(f"GridSample: unknown padding_mode '{padding}'")
    taps = []
    for k, size in enumerate(x.shape[2:]):
        g = grid[..., nd - 1 - k].astype(np.float64)  # grid's last entry indexes the first axis
        c = (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        if mode == "nearest":
            c = np.rint(c)
        outside = (c < lo) | (c > hi)
        if padding == "border":
            c = np.where(outside, np.clip(c, 0, size - 1), c)
        elif padding == "reflection":
            c = np.where(outside, _reflect(c, lo, hi), c)
        taps.append(_grid_taps(c, mode, size, padding, lo, hi))
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


def _base_coords(length: int, align: bool) -> np.ndarray:
    """Normalized [-1, 1] coordinates of ``length`` pixels (as torch.nn.functional.affine_grid)."""
    c = np.linspace(-1.0, 1.0, length)
    return c if align or length == 0 else c * (length - 1) / length


@register("AffineGrid", since=20)
def affine_grid(theta: np.ndarray, size: np.ndarray, *, align_corners: int = 0) -> np.ndarray:
    """Sampling grid (N, *spatial, nd) of the affine maps ``theta`` (N, nd, nd + 1)."""
    size = [int(s) for s in np.asarray(size).reshape(-1)]
    spatial = size[2:]
    nd = len(spatial)
    if nd not in (2, 3) or theta.shape != (size[0], nd, nd + 1):
        raise ValueError(
            f"AffineGrid: theta of shape {theta.shape} does not fit size {size}; expected "
            f"size of 4 or 5 values and theta of shape (N, nd, nd + 1)"
        )
    axes = [_base_coords(n, bool(align_corners)) for n in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")  # (D,) H, W
    ones = np.ones(spatial)
    base = np.stack([*mesh[::-1], ones], axis=-1)  # x, y, (z), 1
    out = np.einsum("...k,njk->n...j", base, theta.astype(np.float64))
    return out.astype(theta.dtype)


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
    nd = len(image)
    dil = list(dilations or [1] * nd)
    stride = list(strides or [1] * nd)
    pads = list(pads or [0] * 2 * nd)
    if len(block) != nd or len(dil) != nd or len(stride) != nd or len(pads) != 2 * nd:
        raise ValueError("Col2Im: image_shape, block_shape, dilations, strides, pads disagree")
    padded = [image[d] + pads[d] + pads[d + nd] for d in range(nd)]
    blocks = [(padded[d] - dil[d] * (block[d] - 1) - 1) // stride[d] + 1 for d in range(nd)]
    n, ck, length = x.shape
    kernel = int(np.prod(block))
    if ck % kernel or length != int(np.prod(blocks)) or min(blocks) <= 0:
        raise ValueError(
            f"Col2Im: input of shape {x.shape} does not fit block_shape {block} and "
            f"{blocks} block positions (from image_shape {image})"
        )
    cols = x.reshape(n, ck // kernel, *block, *blocks)
    out = np.zeros((n, ck // kernel, *padded), x.dtype)
    for k in itertools.product(*[range(b) for b in block]):
        where = tuple(
            slice(k[d] * dil[d], k[d] * dil[d] + stride[d] * (blocks[d] - 1) + 1, stride[d])
            for d in range(nd)
        )
        out[(..., *where)] += cols[(slice(None), slice(None), *k)]
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
