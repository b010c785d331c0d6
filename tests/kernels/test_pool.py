"""Pooling reference kernels against onnxruntime on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

import tensorkiln.kernels.reference.pool  # noqa: F401  (registers the pooling kernels)
from tests.kernels.ort_oracle import check_against_ort, run_kernel

rng = np.random.default_rng()


def _randn(*shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


WINDOW_CASES = [
    # (X shape, attrs)
    ((2, 3, 9, 9), {"kernel_shape": [3, 3]}),
    ((1, 3, 10, 11), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 2, 10, 11), {"kernel_shape": [3, 2], "strides": [2, 3], "pads": [0, 1, 1, 0]}),
    ((1, 2, 11, 11), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    (
        (1, 2, 10, 12),
        {"kernel_shape": [3, 3], "strides": [3, 3], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    ),
    ((1, 2, 12, 12), {"kernel_shape": [2, 3], "dilations": [2, 2], "pads": [1, 1, 1, 1]}),
    (
        (1, 2, 12, 13),
        {"kernel_shape": [3, 3], "dilations": [2, 2], "strides": [2, 2], "ceil_mode": 1},
    ),
    ((1, 2, 9, 10), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 9, 10), {"kernel_shape": [4, 4], "strides": [2, 3], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 9, 10), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "VALID"}),
    ((2, 3, 15), {"kernel_shape": [4], "strides": [3], "pads": [1, 2]}),
    (
        (1, 2, 6, 7, 8),
        {"kernel_shape": [2, 3, 2], "strides": [2, 1, 2], "pads": [0, 1, 1, 1, 0, 0]},
    ),
]


@pytest.mark.parametrize(("xs", "attrs"), WINDOW_CASES)
def test_max_pool_with_indices(xs, attrs):
    # unique values so the argmax is unambiguous
    x = rng.permutation(np.prod(xs)).reshape(xs).astype(np.float32) / 7
    check_against_ort("MaxPool", {"X": x}, attrs, n_outputs=2)


@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_storage_order(storage_order):
    x = rng.permutation(2 * 3 * 7 * 6).reshape(2, 3, 7, 6).astype(np.float32)
    attrs = {"kernel_shape": [2, 3], "strides": [2, 2], "storage_order": storage_order}
    check_against_ort("MaxPool", {"X": x}, attrs, n_outputs=2)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.float16])
def test_max_pool_other_dtypes(dtype):
    x = rng.integers(-100, 100, (1, 2, 7, 7)).astype(dtype) if dtype != np.uint8 else None
    if x is None:
        x = rng.integers(0, 256, (1, 2, 7, 7), dtype=np.uint8)
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}
    check_against_ort("MaxPool", {"X": x}, attrs)


@pytest.mark.parametrize(("xs", "attrs"), WINDOW_CASES)
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool(xs, attrs, count_include_pad):
    attrs = {**attrs, "count_include_pad": count_include_pad}
    check_against_ort("AveragePool", {"X": _randn(*xs)}, attrs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("xs", "attrs"), WINDOW_CASES[:8] + WINDOW_CASES[10:])
@pytest.mark.parametrize("p", [1, 3])
def test_lp_pool(xs, attrs, p):
    check_against_ort(
        "LpPool", {"X": _randn(*xs)}, {**attrs, "p": p}, opset=22, rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 5, 6), (1, 2, 3, 4, 5)])
def test_global_pools(shape):
    x = _randn(*shape)
    check_against_ort("GlobalAveragePool", {"X": x}, rtol=1e-5, atol=1e-6)
    check_against_ort("GlobalMaxPool", {"X": x})
    for p in (1, 2, 3):
        check_against_ort("GlobalLpPool", {"X": x}, {"p": p}, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("size", "attrs"),
    [
        (8, {"kernel_shape": [2, 2], "strides": [2, 2]}),
        (7, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ],
)
def test_max_unpool_of_max_pool(size, attrs):
    x = _randn(2, 3, size, size)
    y, index = run_kernel("MaxPool", {"X": x}, attrs, n_outputs=2)
    plain = check_against_ort("MaxUnpool", {"X": y, "I": index}, attrs, opset=22)[0]
    # output_shape: the indices still address the inferred shape, as in the ONNX node test
    # test_maxunpool_export_with_output_shape (onnxruntime reads them in output_shape instead)
    shape = np.array([2, 3, size + 1, size + 2], dtype=np.int64)
    got = run_kernel("MaxUnpool", {"X": y, "I": index, "output_shape": shape}, attrs, opset=22)[0]
    assert got.shape == tuple(shape)
    np.testing.assert_array_equal(got[:, :, :size, :size], plain)
    assert not got[:, :, size:].any() and not got[:, :, :, size:].any()


def test_max_roi_pool():
    x = _randn(2, 3, 12, 10)
    rois = np.array(
        [[0, 1, 1, 6, 8], [1, 0.4, 2.2, 9.3, 11.6], [1, 3, 3, 3, 3], [0, 2, 1, 15, 20]],
        dtype=np.float32,
    )
    for scale in (1.0, 0.5):
        attrs = {"pooled_shape": [3, 2], "spatial_scale": scale}
        check_against_ort("MaxRoiPool", {"X": x, "rois": rois}, attrs)


def test_pool_without_kernel_shape_is_a_value_error():
    with pytest.raises(ValueError, match="kernel_shape"):
        run_kernel("MaxPool", {"X": _randn(1, 1, 4, 4)})
