"""The math reference kernels against onnxruntime on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.ort_oracle import check_against_ort, run_kernel

TOL = {
    np.float16: {"rtol": 2e-3, "atol": 2e-3},
    np.float32: {"rtol": 1e-5, "atol": 1e-5},
    np.float64: {"rtol": 1e-10, "atol": 1e-10},
}


def _rand(shape, dtype=np.float32, low=-3, high=3):
    rng = np.random.default_rng()
    if np.dtype(dtype).kind in "iu":
        return rng.integers(low, high, size=shape).astype(dtype)
    return rng.uniform(low, high, size=shape).astype(dtype)


@pytest.mark.parametrize(
    "sa,sb",
    [
        ((3, 4), (4, 5)),
        ((2, 3, 4), (4, 5)),
        ((1, 3, 4), (2, 4, 5)),
        ((4,), (2, 4, 5)),
        ((2, 3, 4), (4,)),
        ((6,), (6,)),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32])
def test_matmul(sa, sb, dtype):
    inputs = {"A": _rand(sa, dtype), "B": _rand(sb, dtype)}
    check_against_ort("MatMul", inputs, opset=13, **TOL.get(dtype, {}))


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (), (1,), (5,), (3, 5), (3, 1)])
def test_gemm_shapes(trans_a, trans_b, c_shape):
    a = _rand((4, 3) if trans_a else (3, 4))
    b = _rand((5, 4) if trans_b else (4, 5))
    c = None if c_shape is None else _rand(c_shape)
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": 0.7, "beta": -1.3}
    check_against_ort("Gemm", {"A": a, "B": b, "C": c}, attrs, opset=13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (2.5, 0.0), (1.0, 0.5)])
def test_gemm_alpha_beta(dtype, alpha, beta):
    inputs = {"A": _rand((6, 7), dtype), "B": _rand((7, 8), dtype), "C": _rand((8,), dtype)}
    check_against_ort("Gemm", inputs, {"alpha": alpha, "beta": beta}, opset=13, **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (2.5, 0.5), (1.0, 0.0)])
def test_gemm_integers(dtype, alpha, beta):
    """Integer Gemm (onnxruntime has none): exact where alpha and beta are 1, else scaled in
    float64 and cast back, as the ONNX reference implementation computes it."""
    a, b, c = _rand((3, 4), dtype, -50, 50), _rand((5, 4), dtype, -50, 50), _rand((5,), dtype)
    (got,) = run_kernel(
        "Gemm", {"A": a, "B": b, "C": c}, {"alpha": alpha, "beta": beta, "transB": 1}
    )
    wide = alpha * (a.astype(np.float64) @ b.T.astype(np.float64)) + beta * c.astype(np.float64)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, wide.astype(dtype))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("zp", ["none", "scalar", "vector"])
def test_matmul_integer(dtype, zp):
    low, high = (0, 256) if dtype == np.uint8 else (-128, 128)
    a, b = _rand((2, 5, 7), dtype, low, high), _rand((7, 3), dtype, low, high)
    inputs = {"A": a, "B": b}
    if zp == "scalar":
        inputs["a_zero_point"] = _rand((), dtype, low, high)
        inputs["b_zero_point"] = _rand((), dtype, low, high)
    elif zp == "vector":  # B per column; onnxruntime wants A's per-tensor with it
        inputs["a_zero_point"] = _rand((), dtype, low, high)
        inputs["b_zero_point"] = _rand((3,), dtype, low, high)
    check_against_ort("MatMulInteger", inputs, opset=13)


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("ij,jk->ik", [(3, 4), (4, 5)]),
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("ij->ji", [(3, 4)]),
        ("ii->i", [(4, 4)]),
        ("ij->", [(3, 4)]),
        ("i,i", [(5,), (5,)]),
        ("...ij,...jk", [(2, 3, 4), (2, 4, 2)]),
        ("bhqd,bhkd->bhqk", [(2, 3, 4, 8), (2, 3, 5, 8)]),
        ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ],
)
def test_einsum(equation, shapes):
    inputs = {f"x{i}": _rand(s) for i, s in enumerate(shapes)}
    check_against_ort("Einsum", inputs, {"equation": equation}, opset=13, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (2, 1, 2, 2)])
def test_det(shape):
    check_against_ort("Det", {"X": _rand(shape)}, opset=13, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumsum(dtype, axis, exclusive, reverse):
    inputs = {"x": _rand((3, 4, 5), dtype, -9, 9), "axis": np.array(axis, dtype=np.int64)}
    attrs = {"exclusive": exclusive, "reverse": reverse}
    check_against_ort("CumSum", inputs, attrs, opset=14, **TOL.get(dtype, {}))


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumprod_against_numpy(exclusive, reverse):
    # onnxruntime has no CumProd yet: compare with numpy's cumprod on a padded, flipped copy.
    x = _rand((3, 5), np.float64, 0.5, 1.5)
    got = run_kernel(
        "CumProd",
        {"x": x, "axis": np.array(1)},
        {"exclusive": exclusive, "reverse": reverse},
        opset=26,
    )[0]
    src = x[:, ::-1] if reverse else x
    if exclusive:
        src = np.concatenate([np.ones((3, 1)), src[:, :-1]], axis=1)
    want = np.cumprod(src, axis=1)
    np.testing.assert_allclose(got, want[:, ::-1] if reverse else want, rtol=1e-12, atol=1e-12)


SOFTMAX_OPS = ["Softmax", "LogSoftmax", "Hardmax"]


@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1])
@pytest.mark.parametrize("opset", [11, 13])
def test_softmax_family(op, axis, opset):
    attrs = {} if axis is None else {"axis": axis}
    check_against_ort(op, {"x": _rand((2, 3, 4), low=-20, high=20)}, attrs, opset=opset)


@pytest.mark.parametrize(
    "op,dtype",
    [(op, np.float16) for op in SOFTMAX_OPS]
    + [("Softmax", np.float64), ("LogSoftmax", np.float64)],
)  # onnxruntime has no float64 Hardmax
def test_softmax_family_dtypes(op, dtype):
    check_against_ort(op, {"x": _rand((4, 33), dtype, -8, 8)}, opset=13, **TOL[dtype])


def test_softmax_large_values_are_stable():
    x = _rand((3, 7), low=-1, high=1) + np.float32(1e4)
    check_against_ort("Softmax", {"x": x}, opset=13)


@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32])
def test_topk(largest, axis, dtype):
    # Small integer ranges give ties, whose order (lower index first) is part of the contract.
    x = _rand((6, 7), dtype, -3, 3) if dtype in (np.int64, np.int32) else _rand((6, 7), dtype)
    inputs = {"X": x, "K": np.array([4], dtype=np.int64)}
    check_against_ort("TopK", inputs, {"axis": axis, "largest": largest}, n_outputs=2, opset=11)


def test_topk_opset1_attribute_k():
    check_against_ort("TopK", {"X": _rand((3, 9))}, {"k": 3}, n_outputs=2, opset=1)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("select_last_index", [0, 1])
def test_arg_reductions(op, axis, keepdims, select_last_index):
    x = _rand((3, 4, 5), np.float32, -2, 2).round()  # rounding makes ties
    attrs = {"axis": axis, "keepdims": keepdims, "select_last_index": select_last_index}
    check_against_ort(op, {"data": x}, attrs, opset=13)
