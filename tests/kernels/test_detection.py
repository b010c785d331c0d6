"""Detection reference kernels (RoiAlign, NonMaxSuppression) against onnxruntime and torchvision-free
hand checks on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

import tensorkiln.kernels.reference.detection  # noqa: F401  (registers, until listed in __init__)
from tests.kernels.ort_oracle import check_against_ort, run_kernel

rng = np.random.default_rng()


def _rois(n: int, h: int, w: int, scale: float) -> np.ndarray:
    """Random boxes in input-image coordinates, some reaching past the map's edges."""
    x1 = rng.uniform(-2, w / scale, n)
    y1 = rng.uniform(-2, h / scale, n)
    x2 = x1 + rng.uniform(0.5, w / scale, n)
    y2 = y1 + rng.uniform(0.5, h / scale, n)
    return np.stack([x1, y1, x2, y2], axis=1).astype(np.float32)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_roi_align(mode, ctm, sampling_ratio):
    x = rng.standard_normal((2, 3, 10, 12)).astype(np.float32)
    inputs = {
        "X": x,
        "rois": _rois(6, 10, 12, 0.5),
        "batch_indices": rng.integers(0, 2, 6).astype(np.int64),
    }
    attrs = {
        "mode": mode,
        "coordinate_transformation_mode": ctm,
        "output_height": 3,
        "output_width": 4,
        "sampling_ratio": sampling_ratio,
        "spatial_scale": 0.5,
    }
    check_against_ort("RoiAlign", inputs, attrs, opset=16, rtol=1e-4, atol=1e-5)


def test_roi_align_10():
    x = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    inputs = {"X": x, "rois": _rois(5, 8, 8, 1.0), "batch_indices": np.zeros(5, np.int64)}
    attrs = {"output_height": 2, "output_width": 2, "sampling_ratio": 0}
    check_against_ort("RoiAlign", inputs, attrs, opset=10, rtol=1e-4, atol=1e-5)


def test_roi_align_rejects_bad_batch_index():
    x = rng.standard_normal((1, 1, 4, 4)).astype(np.float32)
    inputs = {"X": x, "rois": _rois(1, 4, 4, 1.0), "batch_indices": np.array([3], np.int64)}
    with pytest.raises(ValueError, match="batch_indices"):
        run_kernel("RoiAlign", inputs, {}, opset=16)


def _boxes(n: int, b: int, center: int) -> np.ndarray:
    xy = rng.uniform(0, 10, (n, b, 2))
    wh = rng.uniform(0.5, 4, (n, b, 2))
    if center:
        return np.concatenate([xy, wh], axis=-1).astype(np.float32)
    # corners given in either order, to check normalization of flipped boxes
    flip = rng.random((n, b, 1)) < 0.3
    a, c = xy, xy + wh
    return np.concatenate([np.where(flip, c, a), np.where(flip, a, c)], axis=-1).astype(np.float32)


@pytest.mark.parametrize("center_point_box", [0, 1])
@pytest.mark.parametrize("limit, iou, score", [(3, 0.5, None), (10, 0.3, 0.4), (50, 0.0, 0.2)])
def test_nms(center_point_box, limit, iou, score):
    inputs = {
        "boxes": _boxes(2, 40, center_point_box),
        "scores": rng.random((2, 3, 40)).astype(np.float32),
        "max_output_boxes_per_class": np.array([limit], np.int64),
        "iou_threshold": np.array([iou], np.float32),
        "score_threshold": None if score is None else np.array([score], np.float32),
    }
    if score is None:
        del inputs["score_threshold"]
    got = check_against_ort(
        "NonMaxSuppression", inputs, {"center_point_box": center_point_box}, opset=11
    )
    assert got[0].shape[0] > 0


def test_nms_defaults_select_nothing():
    """max_output_boxes_per_class defaults to 0: nothing is selected."""
    inputs = {"boxes": _boxes(1, 5, 0), "scores": rng.random((1, 1, 5)).astype(np.float32)}
    got = check_against_ort("NonMaxSuppression", inputs, {}, opset=11)
    assert got[0].shape == (0, 3)
