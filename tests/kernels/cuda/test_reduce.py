"""The cuda backend's Reduce* kernels against the numpy reference, on fresh random inputs: axes as
attribute and as input, negative and empty axes, keepdims, empty sets, integer and float16 data."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's log(0), empty means

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = ["ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
       "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare"]  # fmt: skip
TOL = {np.dtype(np.float16): 2e-3, np.dtype(np.float64): 1e-12}


def _dev(a: np.ndarray):
    return to_torch(a, DEVICE).reshape(a.shape)  # (keeps 0-d arrays 0-d)


def _compare(op, x, axes, attrs, *, as_input, transpose=False):
    """Run ``op`` on both backends (axes as attribute at opset 13, as input at 18) and compare."""
    if as_input:
        opset = 18
        args = [x, None if axes is None else np.array(axes, dtype=np.int64)]
        kw = dict(attrs)
    else:
        opset = 11 if op == "ReduceSum" else 13
        args = [x]
        kw = dict(attrs) if axes is None else {**attrs, "axes": list(axes)}
    ref = invoke(lookup(op, "", opset, "reference"), args, kw, 1)[0]
    dev = [None if a is None else _dev(a) for a in args]
    if transpose:  # the same values through a non-contiguous tensor
        dev[0] = _dev(np.ascontiguousarray(x.transpose())).permute(*reversed(range(x.ndim)))
    got = to_numpy(invoke(lookup(op, "", opset, "cuda"), dev, kw, 1)[0])
    assert got.dtype == ref.dtype and got.shape == ref.shape, (op, got.shape, ref.shape)
    if ref.dtype.kind in "iub":
        np.testing.assert_array_equal(got, ref, err_msg=op)
    else:
        tol = TOL.get(ref.dtype, 1e-5)
        np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=tol,
                                   atol=tol, err_msg=op)  # fmt: skip


_AXES = [None, [1], [-1, 0], [0, 2], [2, 1, 0]]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("op", OPS)
def test_reduce_floats(op, dtype):
    rng = np.random.default_rng()
    x = rng.uniform(0.5, 1.5, size=(3, 4, 5)).astype(dtype)  # positive: ReduceLogSum's domain
    for axes in _AXES:
        for keepdims in (0, 1):
            _compare(op, x, axes, {"keepdims": keepdims}, as_input=False)
            _compare(op, x, axes, {"keepdims": keepdims}, as_input=True, transpose=True)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.uint32, np.uint64])
@pytest.mark.parametrize("op", OPS)
def test_reduce_integers(op, dtype):
    rng = np.random.default_rng()
    lo = 0 if np.dtype(dtype).kind == "u" else -9
    x = rng.integers(lo, 10, size=(3, 4, 5)).astype(dtype)
    if op in ("ReduceLogSum", "ReduceLogSumExp"):
        x = np.abs(x) + 1
    for axes in _AXES[:3]:
        _compare(op, x, axes, {"keepdims": 1}, as_input=True)


@pytest.mark.parametrize("op", OPS)
def test_reduce_noop_and_empty_axes(op):
    """Empty axes reduce everything, or nothing with noop_with_empty_axes (element-wise steps still
    apply: log, square...)."""
    rng = np.random.default_rng()
    x = rng.uniform(0.5, 2, size=(2, 3)).astype(np.float32)
    for noop in (0, 1):
        _compare(op, x, [], {"noop_with_empty_axes": noop}, as_input=True)
        _compare(op, x, None, {"noop_with_empty_axes": noop, "keepdims": 0}, as_input=True)
    scalar = np.array(1.5, dtype=np.float32)
    if op != "ReduceLogSumExp":
        _compare(op, scalar, None, {"keepdims": 0}, as_input=True)
    else:  # (the reference's ReduceLogSumExp fails on a 0-d input: numpy gives a scalar max)
        y = invoke(lookup(op, "", 18, "cuda"), [_dev(scalar)], {}, 1)[0]
        assert y.shape == () and y.dtype == torch.float32 and float(y) == pytest.approx(1.5)


@pytest.mark.parametrize("op", OPS)
def test_reduce_empty_set(op):
    """Reducing a zero-length axis gives the op's identity (inf for max/min, 0, 1, -inf...)."""
    x = np.zeros((2, 0, 3), dtype=np.float32)
    for axes in ([1], [0, 1], None):
        for keepdims in (0, 1):
            _compare(op, x, axes, {"keepdims": keepdims}, as_input=True)
    _compare(op, x, [2], {"keepdims": 1}, as_input=True)  # a non-empty axis of an empty tensor
    if op in ("ReduceMax", "ReduceMin", "ReduceSum", "ReduceProd"):
        for dtype in (np.int32, np.uint8, np.uint64, np.bool_):
            if dtype == np.bool_ and op not in ("ReduceMax", "ReduceMin"):
                continue
            _compare(op, x.astype(dtype), [1], {"keepdims": 0}, as_input=True)


def test_reduce_float16_accumulates_in_float32():
    """Long float16 sums: each partial sum rounded to float16 would drift far from the result."""
    rng = np.random.default_rng()
    x = rng.uniform(0, 1, size=(4, 4096)).astype(np.float16)
    for op in ("ReduceSum", "ReduceMean", "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare"):
        _compare(op, x, [1], {}, as_input=True)
    y = to_numpy(invoke(lookup("ReduceSum", "", 18, "cuda"), [_dev(x)], {}, 1)[0])
    exact = x.astype(np.float64).sum(keepdims=True)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float64), exact, rtol=1e-3)


def test_reduce_max_min_special_values():
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 6)).astype(np.float32)
    x[0, 2], x[1, 1] = np.nan, -np.inf
    for op in ("ReduceMax", "ReduceMin", "ReduceLogSumExp"):
        _compare(op, x, [1], {"keepdims": 0}, as_input=True)
    b = rng.random((3, 6)) > 0.5
    for op in ("ReduceMax", "ReduceMin"):
        _compare(op, b, [1], {"keepdims": 0}, as_input=True)
    big = np.array([[2**63 + 7, 5, 2**64 - 1], [1, 2**63, 0]], dtype=np.uint64)
    for op in ("ReduceMax", "ReduceMin", "ReduceSum"):
        _compare(op, big, [1], {"keepdims": 0}, as_input=True)
    neg = np.full((2, 3), -np.inf, dtype=np.float32)
    _compare("ReduceLogSumExp", neg, [1], {}, as_input=True)
