"""The cuda backend's image and detection kernels (Resize, Upsample, GridSample, AffineGrid,
Col2Im, ImageDecoder, RoiAlign, NonMaxSuppression) against the numpy reference, on fresh random
inputs."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.cuda.host import HOST_OPS  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
rng = np.random.default_rng()


def _randn(*shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _compare(op, args, attrs=None, *, opset=22, n_outputs=1, tol=1e-5, atol=None):
    attrs = attrs or {}
    ref = invoke(lookup(op, "", opset, "reference"), args, attrs, n_outputs)
    got = invoke(lookup(op, "", opset, "cuda"), [to_torch(a, DEVICE) for a in args], attrs,
                 n_outputs)  # fmt: skip
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        g = to_numpy(g)
        assert g.dtype == r.dtype and g.shape == r.shape, (g.dtype, r.dtype, g.shape, r.shape)
        if r.dtype.kind in "iub":
            np.testing.assert_array_equal(g, r)
        else:
            np.testing.assert_allclose(g.astype(np.float64), r.astype(np.float64), rtol=tol,
                                       atol=tol if atol is None else atol)  # fmt: skip
    return got


# -------------------------------------------------------------------------------------- Resize

CTMS = ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric"]


@pytest.mark.parametrize("ctm", CTMS)
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_modes_and_coordinates(ctm, mode):
    x = _randn(2, 3, 5, 7)
    scales = np.array([1, 1, 1.7, 0.6], np.float32)
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
    _compare("Resize", [x, None, scales], attrs, opset=19)
    sizes = np.array([4, 11], np.int64)
    _compare("Resize", [x, None, None, sizes], {**attrs, "axes": [-1, 2]}, opset=19)


@pytest.mark.parametrize(
    "nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
)
def test_resize_nearest_modes_on_ties(nearest_mode):
    # scale 0.7 puts source coordinates exactly on .5 ties
    x = rng.integers(0, 100, (1, 2, 10, 10)).astype(np.int32)
    scales = np.array([1, 1, 0.7, 2.5], np.float32)
    _compare("Resize", [x, None, scales], {"nearest_mode": nearest_mode}, opset=13)


@pytest.mark.parametrize("ctm", [*CTMS, "tf_half_pixel_for_nn"])
@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor"])
def test_resize_nearest_whole_factors(ctm, nearest_mode):
    # the repeat path where it applies, the general one elsewhere: both must match
    x = rng.integers(0, 100, (2, 3, 4, 5)).astype(np.int64)
    attrs = {"coordinate_transformation_mode": ctm, "nearest_mode": nearest_mode}
    opset = 11 if ctm == "tf_half_pixel_for_nn" else 19
    _compare("Resize", [x, None, np.array([1, 2, 3, 2], np.float32)], attrs, opset=opset)
    _compare("Resize", [x, None, None, np.array([2, 3, 12, 5], np.int64)], attrs, opset=opset)
    xf = _randn(2, 3, 4, 5)
    _compare("Resize", [xf, None, np.array([1, 1, 2, 4], np.float32)], attrs, opset=opset)


def test_resize_antialias_exclude_outside_and_policies():
    x = _randn(1, 2, 12, 9)
    for mode in ("linear", "cubic"):
        attrs = {"mode": mode, "antialias": 1}
        _compare("Resize", [x, None, np.array([1, 1, 0.4, 0.7], np.float32)], attrs, opset=18)
    attrs = {"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}
    _compare("Resize", [x, None, np.array([1, 1, 1.5, 0.8], np.float32)], attrs, opset=18)
    for policy in ("not_larger", "not_smaller"):
        attrs = {"keep_aspect_ratio_policy": policy, "mode": "linear"}
        _compare("Resize", [x, None, None, np.array([5, 5], np.int64)], {**attrs, "axes": [2, 3]},
                 opset=18)  # fmt: skip


def test_resize_crop_and_resize_and_legacy_modes():
    x = _randn(1, 1, 6, 8)
    roi = np.array([0.1, 0.3, 1.2, 0.9], np.float32)
    attrs = {"coordinate_transformation_mode": "tf_crop_and_resize", "mode": "linear",
             "extrapolation_value": -3.0, "axes": [2, 3]}  # fmt: skip
    _compare("Resize", [x, roi, None, np.array([5, 1], np.int64)], attrs, opset=18)
    _compare("Resize", [x, None, np.array([1, 1, 2, 1.5], np.float32)],
             {"coordinate_transformation_mode": "tf_half_pixel_for_nn"}, opset=11)  # fmt: skip
    _compare("Resize", [x, np.array([1, 1, 0.5, 3], np.float32)], {"mode": "linear"}, opset=10)
    _compare("Upsample", [x], {"scales": [1.0, 1.0, 2.0, 3.0]}, opset=7)
    _compare("Upsample", [x, np.array([1, 1, 1.5, 2], np.float32)], {"mode": "bilinear"},
             opset=9)  # fmt: skip


@pytest.mark.parametrize("dtype", [np.uint8, np.int64, np.float16])
def test_resize_other_types(dtype):
    x = rng.integers(0, 255, (1, 3, 5, 6)).astype(dtype)
    tol = 2e-3 if dtype == np.float16 else 0
    # float16: a few units in the last place of values up to ~300 (cubic overshoots 255), where
    # the order of the taps' sum decides the rounding
    atol = 4 * 0.25 if dtype == np.float16 else 0
    for mode in ("nearest", "linear", "cubic"):
        _compare("Resize", [x, None, np.array([1, 1, 1.6, 0.75], np.float32)], {"mode": mode},
                 opset=19, tol=tol, atol=atol)  # fmt: skip


# ------------------------------------------------------------------------- GridSample, AffineGrid


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_2d(padding, mode, align):
    x, grid = _randn(2, 3, 5, 6), 1.4 * _randn(2, 4, 7, 2)
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    _compare("GridSample", [x, grid], attrs, tol=1e-5)


def test_grid_sample_other_ranks_and_fp16():
    attrs = {"mode": "linear", "padding_mode": "reflection"}
    _compare("GridSample", [_randn(1, 2, 4, 5, 3), 1.3 * _randn(1, 3, 2, 4, 3)], attrs, tol=1e-5)
    _compare("GridSample", [_randn(2, 2, 7), 1.3 * _randn(2, 5, 1)], {"mode": "cubic"}, tol=1e-5)
    x, grid = _randn(1, 3, 6, 6, dtype=np.float16), _randn(1, 4, 4, 2, dtype=np.float16)
    _compare("GridSample", [x, grid], {"mode": "bilinear"}, opset=16, tol=3e-3)


def test_affine_grid():
    for size, align in (([2, 3, 4, 5], 0), ([1, 2, 3, 4, 5], 1), ([2, 1, 1, 3], 0)):
        nd = len(size) - 2
        theta = _randn(size[0], nd, nd + 1)
        _compare("AffineGrid", [theta, np.array(size, np.int64)], {"align_corners": align})


# -------------------------------------------------------------------------------------- Col2Im


@pytest.mark.parametrize(
    ("image", "block", "attrs"),
    [
        ([6, 7], [2, 3], {"strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2]}),
        ([9], [3], {"strides": [2], "pads": [1, 2]}),
        ([4, 5, 3], [2, 2, 2], {"pads": [0, 1, 0, 1, 0, 1]}),
    ],
)
def test_col2im(image, block, attrs):
    nd = len(image)
    pads = attrs.get("pads", [0] * 2 * nd)
    strides, dil = attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd)
    blocks = [
        (image[d] + pads[d] + pads[d + nd] - dil[d] * (block[d] - 1) - 1) // strides[d] + 1
        for d in range(nd)
    ]
    shape = (2, 3 * int(np.prod(block)), int(np.prod(blocks)))
    args = [_randn(*shape), np.array(image, np.int64), np.array(block, np.int64)]
    _compare("Col2Im", args, attrs, tol=1e-5)
    args[0] = rng.integers(-50, 50, shape).astype(np.int32)
    _compare("Col2Im", args, attrs)


def test_image_decoder_runs_on_the_host():
    pil = pytest.importorskip("PIL.Image")
    buf = io.BytesIO()
    pil.fromarray(rng.integers(0, 255, (5, 4, 3), dtype=np.uint8)).save(buf, format="PNG")
    data = np.frombuffer(buf.getvalue(), dtype=np.uint8)
    _compare("ImageDecoder", [data], {"pixel_format": "BGR"}, opset=20)
    assert ("", "ImageDecoder") in HOST_OPS


# ------------------------------------------------------------------------------------ RoiAlign


def _rois(count: int, height: int, width: int) -> np.ndarray:
    x1, y1 = rng.uniform(-2, width, count), rng.uniform(-2, height, count)
    w, h = rng.uniform(0, width, count), rng.uniform(0, height, count)
    return np.stack([x1, y1, x1 + w, y1 + h], axis=1).astype(np.float32)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ratio", [0, 2])
@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
def test_roi_align(mode, ratio, ctm):
    x = _randn(2, 3, 9, 11)
    rois = _rois(6, 18, 22)
    rois[0] = [3, 3, 3, 3]  # a degenerate box
    batch = rng.integers(0, 2, 6).astype(np.int64)
    attrs = {"mode": mode, "sampling_ratio": ratio, "output_height": 3, "output_width": 4,
             "spatial_scale": 0.5, "coordinate_transformation_mode": ctm}  # fmt: skip
    _compare("RoiAlign", [x, rois, batch], attrs, tol=1e-5)
    if ctm == "output_half_pixel":
        attrs.pop("coordinate_transformation_mode")
        _compare("RoiAlign", [x, rois, batch], attrs, opset=10, tol=1e-5)


# ----------------------------------------------------------------------------- NonMaxSuppression


@pytest.mark.parametrize("center", [0, 1])
def test_non_max_suppression(center):
    boxes = rng.uniform(0, 10, (2, 30, 4)).astype(np.float32)
    if center:
        boxes[..., 2:] = np.abs(boxes[..., 2:]) / 2
    scores = rng.random((2, 3, 30)).astype(np.float32)
    scores[0, 1, :5] = scores[0, 1, 5]  # ties keep box order
    limits = [np.array(4, np.int64), np.array(0.3, np.float32)]
    _compare("NonMaxSuppression", [boxes, scores, *limits], {"center_point_box": center})
    _compare("NonMaxSuppression", [boxes, scores, np.array(100, np.int64), limits[1],
             np.array(0.6, np.float32)], {"center_point_box": center})  # fmt: skip
    _compare("NonMaxSuppression", [boxes, scores])  # no limit: nothing selected
