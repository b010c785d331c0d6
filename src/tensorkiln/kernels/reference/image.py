"""Image ops: Resize, Upsample, GridSample, AffineGrid, Col2Im, ImageDecoder.

Resize is separable: for each resized axis the source coordinate of every output position is
computed once, turned into tap indices and weights (out_len x taps), and applied as ``taps`` gathers
along that axis plus a weighted sum. Interpolation runs in float64 and is cast back to the input
type (integers rounded half to even and saturated).
"""

from __future__ import annotations

import numpy as np

from tensorkiln.kernels.registry import register

# ---------------------------------------------------------------------------------------------
# Resize: coordinates, taps, one axis at a time
# ---------------------------------------------------------------------------------------------

_COORD_MODES_11 = (
    "half_pixel",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_half_pixel_for_nn",
    "tf_crop_and_resize",
)
_COORD_MODES_13 = tuple(m for m in _COORD_MODES_11 if m != "tf_half_pixel_for_nn")
_COORD_MODES_19 = (*_COORD_MODES_13, "half_pixel_symmetric")
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _source_coords(
    ctm: str, n_out: int, n_in: int, scale: float, roi: tuple[float, float]
) -> np.ndarray:
    """The input coordinate of every output position along one axis.

    ``length_resized`` in the spec's formulas is ``scale * n_in`` (not rounded), as in the ONNX
    test data and onnxruntime; it differs from ``n_out`` when scales are given. Computed in
    float32 like onnxruntime, so that ties in nearest rounding (scale 0.7: 3.5 / 0.7 - 0.5 = 4.5)
    break the same way.
    """
    y = np.arange(n_out, dtype=np.float32)
    scale = np.float32(scale)
    length = scale * np.float32(n_in)
    if ctm == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if ctm == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - n_out / length)
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


def _present(v: np.ndarray | None) -> bool:
    return v is not None and np.asarray(v).size > 0


def _plan(shape: tuple[int, ...], scales, sizes, axes: list[int], policy: str):
    """Output length and scale of every resized axis."""
    in_len = np.array([shape[a] for a in axes], dtype=np.int64)
    if _present(scales) and _present(sizes):
        raise ValueError("Resize: give only one of 'scales' and 'sizes', not both")
    if _present(sizes):
        sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        if sizes.size != len(axes):
            raise ValueError(f"Resize: 'sizes' has {sizes.size} values for {len(axes)} axes")
        ratio = sizes / in_len
        if policy == "stretch":
            return sizes.tolist(), ratio.tolist()
        if policy not in ("not_larger", "not_smaller"):
            raise ValueError(f"Resize: unknown keep_aspect_ratio_policy '{policy}'")
        s = float(ratio.min() if policy == "not_larger" else ratio.max())
        return [int(s * n + 0.5) for n in in_len], [s] * len(axes)
    if not _present(scales):
        raise ValueError("Resize: one of 'scales' and 'sizes' must be given")
    scales = np.asarray(scales).reshape(-1)
    if scales.size != len(axes):
        raise ValueError(f"Resize: 'scales' has {scales.size} values for {len(axes)} axes")
    if (scales <= 0).any():
        raise ValueError(f"Resize: scales must be positive, got {scales.tolist()}")
    # The product is taken in the scales' own precision (float32 in practice), as onnxruntime
    # does, so that e.g. 10 * float32(0.7) gives 7 rather than 6.
    out = np.floor(scales * in_len.astype(scales.dtype)).astype(np.int64)
    return out.tolist(), scales.astype(np.float64).tolist()


def _resize(x: np.ndarray, roi, scales, sizes, axes, policy: str, **opts) -> np.ndarray:
    r = x.ndim
    axes = list(range(r)) if not axes else [int(a) + r if a < 0 else int(a) for a in axes]
    if any(not 0 <= a < r for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"Resize: invalid axes {axes} for a {r}-D input")
    out_len, scale = _plan(x.shape, scales, sizes, axes, policy)
    boxes = [(0.0, 1.0)] * r
    if opts["coordinate_transformation_mode"] == "tf_crop_and_resize":
        if not _present(roi) or np.asarray(roi).size != 2 * len(axes):
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


def _check(value: str, allowed: tuple[str, ...], what: str, opset: int) -> None:
    if value not in allowed:
        raise ValueError(f"Resize-{opset}: {what} '{value}' is not one of {', '.join(allowed)}")


@register("Resize", since=10)
def resize_10(x: np.ndarray, scales: np.ndarray, *, mode: str = "nearest") -> np.ndarray:
    """Resize-10: scales only, asymmetric coordinates (like Upsample)."""
    _check(mode, ("nearest", "linear"), "mode", 10)
    return _resize(x, None, scales, None, None, "stretch", **_legacy_opts(mode))


def _legacy_opts(mode: str) -> dict:
    return dict(
        mode=mode,
        coordinate_transformation_mode="asymmetric",
        nearest_mode="simple",
        cubic_coeff_a=-0.75,
        antialias=False,
        exclude_outside=False,
        extrapolation_value=0.0,
    )


def _resize_11_to_19(opset: int, x, roi, scales, sizes, attrs: dict) -> np.ndarray:
    modes = {11: _COORD_MODES_11, 13: _COORD_MODES_13, 18: _COORD_MODES_13}.get(
        opset, _COORD_MODES_19
    )
    _check(attrs["coordinate_transformation_mode"], modes, "coordinate_transformation_mode", opset)
    _check(attrs["nearest_mode"], _NEAREST_MODES, "nearest_mode", opset)
    axes = attrs.pop("axes", None)
    policy = attrs.pop("keep_aspect_ratio_policy", "stretch")
    attrs["antialias"] = bool(attrs.get("antialias", 0))
    attrs["exclude_outside"] = bool(attrs["exclude_outside"])
    return _resize(x, roi, scales, sizes, axes, policy, **attrs)


@register("Resize", since=11)
def resize_11(
    x: np.ndarray,
    roi: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    sizes: np.ndarray | None = None,
    *,
    coordinate_transformation_mode: str = "half_pixel",
    cubic_coeff_a: float = -0.75,
    exclude_outside: int = 0,
    extrapolation_value: float = 0.0,
    mode: str = "nearest",
    nearest_mode: str = "round_prefer_floor",
) -> np.ndarray:
    """Resize-11: roi/scales/sizes inputs, coordinate modes incl. tf_half_pixel_for_nn."""
    return _resize_11_to_19(11, x, roi, scales, sizes, _attrs(locals()))


@register("Resize", since=13)
def resize_13(
    x: np.ndarray,
    roi: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    sizes: np.ndarray | None = None,
    *,
    coordinate_transformation_mode: str = "half_pixel",
    cubic_coeff_a: float = -0.75,
    exclude_outside: int = 0,
    extrapolation_value: float = 0.0,
    mode: str = "nearest",
    nearest_mode: str = "round_prefer_floor",
) -> np.ndarray:
    """Resize-13: roi and scales optional; tf_half_pixel_for_nn removed."""
    return _resize_11_to_19(13, x, roi, scales, sizes, _attrs(locals()))


@register("Resize", since=18)
def resize_18(
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
) -> np.ndarray:
    """Resize-18: adds antialias, axes and keep_aspect_ratio_policy."""
    return _resize_11_to_19(18, x, roi, scales, sizes, _attrs(locals()))


@register("Resize", since=19)
def resize_19(
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
) -> np.ndarray:
    """Resize-19: adds the half_pixel_symmetric coordinate mode."""
    return _resize_11_to_19(19, x, roi, scales, sizes, _attrs(locals()))


def _attrs(local_vars: dict) -> dict:
    return {k: v for k, v in local_vars.items() if k not in ("x", "roi", "scales", "sizes")}


@register("Upsample", since=7)
def upsample_7(x: np.ndarray, *, mode: str = "nearest", scales: list[float] | None = None):
    """Upsample-7: scales as an attribute."""
    if scales is None:
        raise ValueError("Upsample: the 'scales' attribute is required")
    return upsample_9(x, np.asarray(scales, dtype=np.float32), mode=mode)


@register("Upsample", since=9)
def upsample_9(x: np.ndarray, scales: np.ndarray, *, mode: str = "nearest") -> np.ndarray:
    """Upsample-9/10: scales as an input; behaves as Resize-10."""
    mode = "linear" if mode == "bilinear" else mode
    if mode not in ("nearest", "linear"):
        raise ValueError(f"Upsample: mode '{mode}' is not one of nearest, linear")
    return _resize(x, None, scales, None, None, "stretch", **_legacy_opts(mode))
