"""Image reference kernels (Resize, Upsample, GridSample, AffineGrid, Col2Im, ImageDecoder) against
onnxruntime, torch.nn.functional and Pillow on fresh random inputs."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.ort_oracle import check_against_ort, run_kernel

rng = np.random.default_rng()


def _x(*shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _f32(*v: float) -> np.ndarray:
    return np.array(v, np.float32)


# --- Resize ------------------------------------------------------------------------------------

TOL = {"opset": 19, "rtol": 1e-4, "atol": 1e-5}  # onnxruntime interpolates in float32
CTMS = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric"]


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("ctm", CTMS)
# scales chosen so that no output pixel maps exactly half way between two input pixels, where
# nearest rounding would depend on float32 rounding order
@pytest.mark.parametrize("scales", [(1.0, 1.0, 2.0, 3.0), (1.0, 1.0, 0.55, 0.45), (1, 1, 1.7, 0.8)])
def test_resize_scales(mode, ctm, scales):
    inputs = {"X": _x(2, 3, 7, 9), "roi": None, "scales": _f32(*scales)}
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
    check_against_ort("Resize", inputs, attrs, opset=19, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("ctm", ["half_pixel", "pytorch_half_pixel", "align_corners"])
@pytest.mark.parametrize("sizes", [(2, 3, 11, 4), (2, 3, 1, 13), (2, 3, 5, 1)])
def test_resize_sizes(mode, ctm, sizes):
    inputs = {"X": _x(2, 3, 7, 9), "roi": None, "scales": None}
    inputs["sizes"] = np.array(sizes, np.int64)
    check_against_ort(
        "Resize", inputs, {"mode": mode, "coordinate_transformation_mode": ctm}, **TOL
    )


@pytest.mark.parametrize(
    "nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
)
@pytest.mark.parametrize("ctm", ["half_pixel", "asymmetric", "align_corners"])
def test_resize_nearest_modes(nearest_mode, ctm):
    inputs = {"X": _x(1, 2, 6, 5), "roi": None, "scales": _f32(1, 1, 2.5, 0.6)}
    attrs = {"mode": "nearest", "nearest_mode": nearest_mode, "coordinate_transformation_mode": ctm}
    check_against_ort("Resize", inputs, attrs, opset=19)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("scales", [(1, 1, 0.6, 0.35), (1, 1, 1.5, 0.5)])
@pytest.mark.parametrize("exclude_outside", [0, 1])
def test_resize_antialias(mode, scales, exclude_outside):
    inputs = {"X": _x(2, 2, 12, 10), "roi": None, "scales": _f32(*scales)}
    attrs = {"mode": mode, "antialias": 1, "exclude_outside": exclude_outside}
    check_against_ort("Resize", inputs, attrs, opset=18, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("a", [-0.5, -0.75])
def test_resize_cubic_coeff_and_exclude_outside(a):
    inputs = {"X": _x(1, 3, 8, 8), "roi": None, "scales": _f32(1, 1, 1.6, 0.7)}
    attrs = {"mode": "cubic", "cubic_coeff_a": a, "exclude_outside": 1}
    check_against_ort("Resize", inputs, attrs, opset=13, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_tf_crop_and_resize_scales(mode):
    roi = _f32(0, 0, 0.1, 0.3, 1, 1, 0.95, 1.2)
    inputs = {"X": _x(2, 3, 7, 9), "roi": roi, "scales": _f32(1, 1, 1.3, 0.7)}
    attrs = {"mode": mode, "coordinate_transformation_mode": "tf_crop_and_resize"}
    check_against_ort("Resize", inputs, attrs | {"extrapolation_value": -1.5}, **TOL)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_tf_crop_and_resize(mode):
    roi = _f32(0.1, -0.2, 0.9, 1.3)  # partly outside the image: extrapolation_value shows up
    inputs = {"X": _x(2, 3, 7, 9), "roi": roi, "scales": None, "sizes": np.array([5, 6], np.int64)}
    attrs = {
        "mode": mode,
        "coordinate_transformation_mode": "tf_crop_and_resize",
        "extrapolation_value": 2.5,
        "axes": [2, 3],
    }
    check_against_ort("Resize", inputs, attrs, opset=18, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", ["stretch", "not_larger", "not_smaller"])
@pytest.mark.parametrize("axes", [[2, 3], [3, 2], [3]])
def test_resize_axes_and_aspect_policy(policy, axes):
    sizes = np.array([9, 4][: len(axes)], np.int64)
    inputs = {"X": _x(1, 2, 6, 7), "roi": None, "scales": None, "sizes": sizes}
    attrs = {"mode": "linear", "axes": axes, "keep_aspect_ratio_policy": policy}
    check_against_ort("Resize", inputs, attrs, opset=18, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("opset", [10, 11])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", [(1, 1, 2, 3), (1, 1, 0.6, 0.5)])
def test_resize_old_opsets(opset, mode, scales):
    inputs = {"X": _x(1, 2, 5, 6)}
    if opset == 11:
        inputs |= {"roi": _f32(), "scales": _f32(*scales)}
    else:
        inputs["scales"] = _f32(*scales)
    check_against_ort("Resize", inputs, {"mode": mode}, opset=opset, rtol=1e-4, atol=1e-5)


def test_resize_integer_nearest():
    x = rng.integers(0, 255, (1, 3, 5, 4)).astype(np.uint8)
    inputs = {"X": x, "roi": None, "scales": _f32(1, 1, 1.8, 2.2)}
    check_against_ort("Resize", inputs, {"mode": "nearest"}, opset=19)


def test_resize_matches_torch_bilinear_antialias():
    x = _x(2, 3, 20, 17)
    got = run_kernel(
        "Resize",
        {"X": x, "roi": None, "scales": None, "sizes": np.array([2, 3, 7, 5], np.int64)},
        {"mode": "linear", "antialias": 1, "exclude_outside": 1},  # torch drops outside taps
        opset=19,
    )[0]
    ref = F.interpolate(torch.from_numpy(x), size=(7, 5), mode="bilinear", antialias=True)
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-5)


def test_resize_rejects_scales_and_sizes():
    inputs = {"X": _x(1, 1, 4, 4), "roi": None, "scales": _f32(1, 1, 2, 2)}
    inputs["sizes"] = np.array([1, 1, 8, 8], np.int64)
    with pytest.raises(ValueError, match="only one"):
        run_kernel("Resize", inputs, {}, opset=19)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample(mode):
    inputs = {"X": _x(2, 3, 4, 5), "scales": _f32(1, 1, 2, 3.5)}
    check_against_ort("Upsample", inputs, {"mode": mode}, opset=9)


# --- GridSample, AffineGrid ----------------------------------------------------------------------


def _grid(n: int, *out: int, reach: float = 1.3) -> np.ndarray:
    return rng.uniform(-reach, reach, (n, *out, len(out))).astype(np.float32)


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample_2d(mode, padding_mode, align_corners):
    # Out-of-range points under cubic + border are clamped per axis here (as the ONNX reference
    # does), jointly in onnxruntime and not at all in torch; keep those inside for the comparison.
    reach = 1.0 if (mode, padding_mode) == ("cubic", "border") else 1.3
    inputs = {"X": _x(2, 3, 6, 7), "grid": _grid(2, 5, 4, reach=reach)}
    attrs = {"mode": mode, "padding_mode": padding_mode, "align_corners": align_corners}
    check_against_ort("GridSample", inputs, attrs, opset=20, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_16(mode):
    inputs = {"X": _x(1, 2, 5, 5), "grid": _grid(1, 3, 6)}
    attrs = {"mode": mode, "padding_mode": "reflection"}
    check_against_ort("GridSample", inputs, attrs, opset=16, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample_3d_vs_torch(mode, padding_mode, align_corners):
    x, grid = _x(2, 3, 4, 5, 6), _grid(2, 3, 4, 2)
    attrs = {"mode": mode, "padding_mode": padding_mode, "align_corners": align_corners}
    got = run_kernel("GridSample", {"X": x, "grid": grid}, attrs, opset=20)[0]
    ref = F.grid_sample(
        torch.from_numpy(x),
        torch.from_numpy(grid),
        mode="bilinear" if mode == "linear" else mode,
        padding_mode=padding_mode,
        align_corners=bool(align_corners),
    )
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size", [(2, 3, 5, 7), (2, 1, 3, 4, 5)])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_affine_grid(size, align_corners):
    nd = len(size) - 2
    theta = _x(size[0], nd, nd + 1)
    inputs = {"theta": theta, "size": np.array(size, np.int64)}
    check_against_ort("AffineGrid", inputs, {"align_corners": align_corners}, opset=20)
    ref = F.affine_grid(torch.from_numpy(theta), list(size), align_corners=bool(align_corners))
    got = run_kernel("AffineGrid", inputs, {"align_corners": align_corners}, opset=20)[0]
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-5)


# --- Col2Im --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attrs",
    [
        {},
        {"strides": [2, 1]},
        {"pads": [1, 0, 2, 1]},
        {"dilations": [2, 2], "strides": [1, 2]},
        {"dilations": [1, 2], "strides": [3, 2], "pads": [1, 2, 1, 0]},
    ],
)
def test_col2im_vs_torch_fold(attrs):
    image, block = (9, 8), (3, 2)
    s, d, p = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1]), attrs.get("pads")
    p = p or [0, 0, 0, 0]
    blocks = [(image[i] + p[i] + p[i + 2] - d[i] * (block[i] - 1) - 1) // s[i] + 1 for i in (0, 1)]
    x = _x(2, 3 * 6, blocks[0] * blocks[1])
    inputs = {"input": x, "image_shape": np.array(image), "block_shape": np.array(block)}
    got = run_kernel("Col2Im", inputs, attrs, opset=18)[0]
    if p[0] == p[2] and p[1] == p[3]:  # torch's fold pads symmetrically only
        ref = F.fold(torch.from_numpy(x), image, block, dilation=d, padding=p[:2], stride=s)
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-5)
    check_against_ort("Col2Im", inputs, attrs, opset=18, rtol=1e-5, atol=1e-5)


def test_col2im_3d():
    x = _x(1, 2 * 8, 3 * 2 * 4)
    inputs = {"input": x, "image_shape": np.array([4, 3, 5]), "block_shape": np.array([2, 2, 2])}
    check_against_ort("Col2Im", inputs, {}, opset=18, rtol=1e-5, atol=1e-5)


# --- ImageDecoder --------------------------------------------------------------------------------


def _encoded(pixels: np.ndarray, fmt: str) -> np.ndarray:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return np.frombuffer(buf.getvalue(), np.uint8)


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF"])  # lossless, so the pixels come back
def test_image_decoder_rgb_bgr(fmt):
    pixels = rng.integers(0, 256, (13, 17, 3)).astype(np.uint8)
    data = _encoded(pixels, fmt)
    rgb = run_kernel("ImageDecoder", {"encoded_stream": data}, {"pixel_format": "RGB"}, opset=20)
    bgr = run_kernel("ImageDecoder", {"encoded_stream": data}, {"pixel_format": "BGR"}, opset=20)
    np.testing.assert_array_equal(rgb[0], pixels)
    np.testing.assert_array_equal(bgr[0], pixels[:, :, ::-1])


def test_image_decoder_grayscale():
    pixels = rng.integers(0, 256, (9, 11, 3)).astype(np.uint8)
    got = run_kernel(
        "ImageDecoder", {"encoded_stream": _encoded(pixels, "PNG")}, {"pixel_format": "Grayscale"}
    )[0]
    luma = pixels.astype(np.float64) @ np.array([0.299, 0.587, 0.114])  # ITU-R 601-2
    assert got.shape == (9, 11, 1) and got.dtype == np.uint8
    np.testing.assert_allclose(got[:, :, 0], luma, atol=1.0)


def test_image_decoder_bad_bytes():
    with pytest.raises(ValueError, match="could not decode"):
        run_kernel("ImageDecoder", {"encoded_stream": rng.integers(0, 256, 64).astype(np.uint8)})
