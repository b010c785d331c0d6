"""The cuda backend's matrix products, scans, softmax family and arg/top-k selection against the
numpy reference, on fresh random inputs (on the GPU when there is one, else on torch CPU tensors)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402

rng = np.random.default_rng()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(*shape: int, dtype=np.float32, scale: float = 1.0) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        lo = 0 if dtype.kind == "u" else -9
        return rng.integers(lo, 10, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * scale).astype(dtype)


def tt(a):
    if isinstance(a, np.ndarray) and a.ndim == 0:
        return to_torch(a.reshape(1), DEVICE).reshape(())
    return to_torch(a, DEVICE)


def check(op, args, attrs=None, n_outputs=1, opset=24, tol=0.0, torch_args=None):
    """Compare the cuda kernel with the reference: exactly, or within ``tol`` (relative and
    absolute) for floats."""
    attrs = attrs or {}
    ref = invoke(lookup(op, "", opset, "reference"), args, attrs, n_outputs)
    dev_args = torch_args if torch_args is not None else [tt(a) for a in args]
    got = invoke(lookup(op, "", opset, "cuda"), dev_args, attrs, n_outputs)
    for g, r in zip(got, ref):
        assert isinstance(g, torch.Tensor)
        gn = to_numpy(g)
        assert gn.dtype == r.dtype, f"{op}: dtype {gn.dtype} != {r.dtype}"
        assert gn.shape == r.shape, f"{op}: shape {gn.shape} != {r.shape}"
        if tol and r.dtype.kind == "f":
            np.testing.assert_allclose(
                gn.astype(np.float64), r.astype(np.float64), rtol=tol, atol=tol
            )
        else:
            np.testing.assert_array_equal(gn, r)
    return got


# ---------------------------------------------------------------- matrix products


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [((3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)), ((4,), (2, 4, 3)), ((4,), (4,))],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint8])
def test_matmul(a_shape, b_shape, dtype):
    tol = {np.float16: 2e-3, np.float32: 1e-5}.get(dtype, 0.0)
    check("MatMul", [rand(*a_shape, dtype=dtype), rand(*b_shape, dtype=dtype)], tol=tol)


def test_matmul_integer_wraps_like_numpy_and_takes_transposed_views():
    a = rng.integers(-(2**31), 2**31, size=(3, 5)).astype(np.int32)
    b = rng.integers(-(2**31), 2**31, size=(5, 2)).astype(np.int32)
    check("MatMul", [a, b])
    bt = tt(rand(6, 5)).t()  # non-contiguous
    a = rand(3, 5)
    check("MatMul", [a, to_numpy(bt)], tol=1e-5, torch_args=[tt(a), bt])


@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("c_shape", [None, (), (5,), (3, 1), (3, 5)])
def test_gemm(trans_a, trans_b, c_shape):
    a = rand(4, 3) if trans_a else rand(3, 4)
    b = rand(5, 4) if trans_b else rand(4, 5)
    args = [a, b] + ([] if c_shape is None else [rand(*c_shape)])
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": 0.7, "beta": -1.3}
    check("Gemm", args, attrs, tol=1e-5)
    check("Gemm", [x.astype(np.float16) for x in args], attrs, tol=3e-3)


def test_gemm_integers_and_zero_beta():
    a, b, c = rand(3, 4, dtype=np.int32), rand(4, 5, dtype=np.int32), rand(5, dtype=np.int32)
    check("Gemm", [a, b, c])
    check("Gemm", [a, b, c], {"alpha": 2.5, "beta": 0.5})
    c = np.full((3, 5), np.nan, np.float32)
    check("Gemm", [rand(3, 4), rand(4, 5), c], {"beta": 0.0}, tol=1e-5)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_matmul_integer_zero_points(dtype):
    a, b = rand(2, 4, 6, dtype=dtype), rand(6, 3, dtype=dtype)
    check("MatMulInteger", [a, b])
    check("MatMulInteger", [a[0], b, rand(4, dtype=dtype), rand(3, dtype=dtype)])
    check("MatMulInteger", [a, b, np.array(3, dtype=dtype), np.array(1, dtype=dtype)])


@pytest.mark.parametrize(
    "equation, shapes",
    [
        ("ij,jk->ik", [(3, 4), (4, 5)]),
        ("bij, bjk", [(2, 3, 4), (2, 4, 5)]),
        ("...ii->...i", [(2, 3, 3)]),
        ("ij->", [(3, 4)]),
        ("i,i", [(5,), (5,)]),
        ("bHd,bJd->bHJ", [(2, 3, 4), (2, 5, 4)]),
    ],
)
def test_einsum(equation, shapes):
    check("Einsum", [rand(*s) for s in shapes], {"equation": equation}, tol=1e-5)
    check("Einsum", [rand(*s, dtype=np.int64) for s in shapes], {"equation": equation})


def test_det():
    check("Det", [rand(2, 3, 4, 4, dtype=np.float64)], tol=1e-9)
    check("Det", [rand(3, 3, dtype=np.float16)], tol=5e-3)


# ---------------------------------------------------------------- scans


@pytest.mark.parametrize("op", ["CumSum", "CumProd"])
@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint32])
def test_scans(op, exclusive, reverse, dtype):
    x = rand(3, 5, 4, dtype=dtype)
    if dtype == np.float16:
        x = (x * 0.5 + 1.0).astype(dtype) if op == "CumProd" else x
    tol = {np.float16: 2e-3, np.float32: 1e-5}.get(dtype, 0.0)
    attrs = {"exclusive": exclusive, "reverse": reverse}
    check(op, [x, np.array(-2, dtype=np.int32)], attrs, opset=26, tol=tol)
    check(op, [np.zeros((2, 0), dtype=dtype), np.array(1)], attrs, opset=26)


# ---------------------------------------------------------------- softmax family


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the reference's -inf
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_fp16_does_not_overflow(op, axis):
    x = rand(3, 4, 50, dtype=np.float16, scale=4.0)
    x[..., 0] = 60000.0  # exp-sums in float16 would overflow
    x[0, 0, 1] = -60000.0
    check(op, [x], {"axis": axis}, tol=2e-3)
    check(op, [rand(3, 4, 50, dtype=np.float32, scale=5.0)], {"axis": axis}, tol=1e-5)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_softmax_family_coerced_2d_before_opset_13(op):
    x = rand(2, 3, 4, 5, dtype=np.float64)
    for axis in (1, 2, -1):
        check(op, [x], {"axis": axis}, opset=11, tol=1e-9)
    xt = tt(rand(5, 4, 3, 2)).permute(3, 2, 1, 0)  # non-contiguous
    check(op, [to_numpy(xt)], {"axis": -2}, tol=1e-6, torch_args=[xt])


def test_hardmax_ties_pick_the_first():
    x = rng.integers(0, 3, size=(4, 6)).astype(np.float32)
    check("Hardmax", [x], {"axis": -1})
    check("Hardmax", [x], {"axis": 0})
    check("Hardmax", [x.astype(np.float16)], {"axis": 1}, opset=11)


# ---------------------------------------------------------------- selection


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("dtype", [np.float16, np.int8, np.uint64, np.bool_])
def test_arg_reduce_ties_and_select_last_index(op, dtype):
    x = rng.integers(0, 3, size=(3, 5, 4)).astype(dtype)
    if dtype == np.uint64:
        x = x * np.uint64(2**62)  # beyond int64's range
    for axis in (0, -1):
        for keepdims in (0, 1):
            for last in (0, 1):
                attrs = {"axis": axis, "keepdims": keepdims, "select_last_index": last}
                check(op, [x], attrs)


@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint64])
def test_topk_ties_lower_index_first(largest, dtype):
    x = rng.integers(0, 4, size=(3, 9, 2)).astype(dtype)
    if dtype == np.uint64:
        x = x * np.uint64(2**62)
    for k in (0, 3, 9):
        check("TopK", [x, np.array([k])], {"axis": 1, "largest": largest}, n_outputs=2)
    check("TopK", [x], {"axis": -1, "k": 2}, n_outputs=2, opset=1)


def test_topk_with_nans():
    x = rand(4, 7)
    x[0, 2] = x[2, 5] = x[2, 0] = np.nan
    for largest in (0, 1):
        check("TopK", [x, np.array([4])], {"largest": largest}, n_outputs=2)
