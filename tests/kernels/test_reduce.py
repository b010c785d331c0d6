"""The Reduce* reference kernels against onnxruntime on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.ort_oracle import check_against_ort, run_kernel

REDUCE_OPS = [
    "ReduceSum",
    "ReduceSumSquare",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMin",
    "ReduceMean",
    "ReduceProd",
]
# From these opsets ``axes`` is an input; before, an attribute.
AXES_INPUT_SINCE = {op: 18 for op in REDUCE_OPS} | {"ReduceSum": 13}


def _data(op, shape, dtype=np.float32):
    rng = np.random.default_rng()
    if np.dtype(dtype).kind in "iu":
        return rng.integers(1, 4, size=shape).astype(dtype)
    # Positive for the logs; near 1 so products of many elements stay in range.
    low = 0.5 if op in ("ReduceLogSum", "ReduceProd") else -2.0
    return rng.uniform(low, 1.5, size=shape).astype(dtype)


def _check(op, x, axes, keepdims, opset, **extra):
    inputs = {"data": x}
    attrs = {"keepdims": keepdims, **extra}
    if axes is not None:
        if opset >= AXES_INPUT_SINCE[op]:
            inputs["axes"] = np.array(axes, dtype=np.int64)
        else:
            attrs["axes"] = list(axes)
    tol = {"rtol": 2e-3, "atol": 2e-3} if x.dtype == np.float16 else {"rtol": 1e-5, "atol": 1e-5}
    check_against_ort(op, inputs, attrs, opset=opset, **tol)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("axes", [None, (0,), (1, 2), (-1,), (0, -1)])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_axes_as_input(op, axes, keepdims):
    _check(op, _data(op, (3, 4, 5)), axes, keepdims, opset=18)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("axes", [None, (1,), (0, 2)])
def test_reduce_axes_as_attribute(op, axes):
    opset = 11 if op == "ReduceSum" else 13
    _check(op, _data(op, (3, 4, 5)), axes, 1, opset=opset)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32, np.int64])
def test_reduce_dtypes(op, dtype):
    if op in ("ReduceLogSum", "ReduceLogSumExp", "ReduceL2") and dtype in (np.int32, np.int64):
        pytest.skip("onnxruntime has no integer kernel for this op")
    if op in ("ReduceLogSum", "ReduceLogSumExp") and dtype == np.float16:
        pytest.skip("onnxruntime has no float16 kernel for this op")
    _check(op, _data(op, (4, 6), dtype), (1,), 0, opset=18)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_noop_with_empty_axes_returns_input(op):
    x = _data(op, (2, 3))
    _check(op, x, None, 1, opset=18, noop_with_empty_axes=1)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_reduce_max_min_bool(op):
    x = np.random.default_rng().integers(0, 2, size=(4, 5)).astype(bool)
    _check(op, x, (1,), 1, opset=20)


@pytest.mark.parametrize(
    "op,identity",
    [
        ("ReduceSum", 0.0),
        ("ReduceSumSquare", 0.0),
        ("ReduceL1", 0.0),
        ("ReduceL2", 0.0),
        ("ReduceProd", 1.0),
        ("ReduceLogSum", -np.inf),
        ("ReduceLogSumExp", -np.inf),
        ("ReduceMax", -np.inf),
        ("ReduceMin", np.inf),
    ],
)
def test_empty_set_gives_identity(op, identity):
    x = np.zeros((2, 0, 4), dtype=np.float32)
    (y,) = run_kernel(op, {"data": x, "axes": np.array([1])}, {"keepdims": 1}, opset=18)
    assert y.shape == (2, 1, 4) and y.dtype == np.float32
    np.testing.assert_array_equal(y, np.full((2, 1, 4), identity, dtype=np.float32))
