"""Reference kernels on empty inputs: an empty batch (N=0), no output channels (M=0), an empty
reduction (K=0) and zero rows, where ONNX defines a result (empty, or for K=0 a product of zeros).

The oracle is onnxruntime where it runs the op; the fused tensorkiln ops (ConvAct, GemmAct) are
checked against the cuda backend's torch kernels run on CPU tensors and, for GemmAct with K=0,
against onnxruntime's Gemm followed by the activation in numpy.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from tensorkiln.ops import ACTIVATIONS
from tests.kernels.ort_oracle import check_against_ort, one_node_model, run_kernel, run_ort
from tests.kernels.test_ml import _legacy_attrs, _some_targets, _v5_attrs, check_ml

rng = np.random.default_rng()
F32 = np.float32


def _randn(*shape: int, dtype=F32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _assert_shape(outputs: list, *shapes: tuple) -> None:
    for got, want in zip(outputs, shapes):
        assert np.shape(got) == want, f"shape {np.shape(got)}, expected {want}"


# ------------------------------------------------------------------------------ convolutions

EMPTY_CONV_CASES = [
    # (X shape, W shape, attrs, output shape)
    ((0, 3, 9, 9), (4, 3, 3, 3), {}, (0, 4, 7, 7)),
    ((0, 4, 10, 11), (6, 4, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}, (0, 6, 5, 6)),
    ((0, 6, 8, 8), (9, 2, 3, 3), {"group": 3, "pads": [1, 1, 1, 1]}, (0, 9, 8, 8)),
    ((0, 8, 9, 9), (8, 1, 3, 3), {"group": 8, "strides": [2, 2]}, (0, 8, 4, 4)),  # depthwise
    ((0, 16, 7, 7), (8, 16, 1, 1), {"strides": [2, 2]}, (0, 8, 4, 4)),  # 1x1, no im2col
    ((0, 3, 11, 10), (4, 3, 3, 3), {"auto_pad": "SAME_UPPER"}, (0, 4, 11, 10)),
    ((0, 3, 17), (5, 3, 4), {"pads": [2, 1], "dilations": [2]}, (0, 5, 14)),
    ((0, 2, 5, 6, 7), (4, 2, 3, 3, 3), {}, (0, 4, 3, 4, 5)),
    ((2, 3, 9, 9), (0, 3, 3, 3), {}, (2, 0, 7, 7)),  # no output channels
]


@pytest.mark.parametrize(("xs", "ws", "attrs", "ys"), EMPTY_CONV_CASES)
def test_conv_empty(xs, ws, attrs, ys):
    inputs = {"X": _randn(*xs), "W": _randn(*ws), "B": _randn(ws[0])}
    _assert_shape(check_against_ort("Conv", inputs, attrs), ys)


@pytest.mark.parametrize(
    ("xs", "ws", "attrs", "ys"),
    [
        ((0, 3, 5, 5), (3, 2, 3, 3), {}, (0, 2, 7, 7)),
        ((0, 4, 5, 6), (4, 3, 3, 2), {"group": 2, "strides": [2, 3]}, (0, 6, 11, 17)),
        ((0, 2, 5, 5), (2, 3, 3, 3), {"output_padding": [1, 1], "strides": [2, 2]}, (0, 3, 12, 12)),
    ],
)
def test_conv_transpose_empty_batch(xs, ws, attrs, ys):
    inputs = {"X": _randn(*xs), "W": _randn(*ws), "B": _randn(ws[1] * attrs.get("group", 1))}
    _assert_shape(check_against_ort("ConvTranspose", inputs, attrs), ys)


def test_integer_convs_empty_batch():
    x = rng.integers(0, 255, (0, 3, 8, 8), dtype=np.uint8)
    w = rng.integers(0, 255, (4, 3, 3, 3), dtype=np.uint8)
    zp = np.array(7, np.uint8)
    got = check_against_ort("ConvInteger", {"X": x, "W": w, "x_zp": zp}, {"pads": [1, 1, 1, 1]})
    _assert_shape(got, (0, 4, 8, 8))
    scale = np.array(0.05, F32)
    inputs = {"x": x, "xs": scale, "xz": zp, "w": w, "ws": scale, "wz": zp}
    inputs |= {"ys": np.array(0.5, F32), "yz": np.array(128, np.uint8)}
    _assert_shape(check_against_ort("QLinearConv", inputs, {"strides": [2, 2]}), (0, 4, 3, 3))


def test_deform_conv_empty_batch():
    inputs = {"X": _randn(0, 4, 8, 8), "W": _randn(6, 2, 3, 3), "offset": _randn(0, 36, 6, 6)}
    inputs |= {"B": _randn(6), "mask": _randn(0, 18, 6, 6)}
    attrs = {"group": 2, "offset_group": 2}
    _assert_shape(check_against_ort("DeformConv", inputs, attrs, opset=19), (0, 6, 6, 6))


# ------------------------------------------------------------------------------ pooling


@pytest.mark.parametrize(
    ("op", "attrs", "n_outputs", "ys"),
    [
        (
            "MaxPool",
            {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]},
            1,
            (0, 3, 4, 4),
        ),
        ("MaxPool", {"kernel_shape": [2, 2], "dilations": [2, 2]}, 2, (0, 3, 6, 6)),
        (
            "AveragePool",
            {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "ceil_mode": 1, "strides": [2, 2]},
            1,
            (0, 3, 5, 5),
        ),
        (
            "AveragePool",
            {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
            1,
            (0, 3, 8, 8),
        ),
        ("LpPool", {"kernel_shape": [2, 2], "p": 3}, 1, (0, 3, 7, 7)),
    ],
)
def test_pool_empty_batch(op, attrs, n_outputs, ys):
    got = check_against_ort(op, {"X": _randn(0, 3, 8, 8)}, attrs, n_outputs=n_outputs)
    _assert_shape(got, *[ys] * n_outputs)


# ------------------------------------------------------------------------------ matrix products


@pytest.mark.parametrize(
    ("a", "b", "ys"),
    [
        ((3, 0), (0, 4), (3, 4)),
        ((2, 3, 0), (2, 0, 4), (2, 3, 4)),
        ((0, 3), (3, 4), (0, 4)),
        ((0, 2, 3), (3, 4), (0, 2, 4)),
    ],
)
def test_matmul_empty(a, b, ys):
    _assert_shape(check_against_ort("MatMul", {"A": _randn(*a), "B": _randn(*b)}), ys)


@pytest.mark.parametrize(
    ("a", "b", "c", "attrs", "ys"),
    [
        ((3, 0), (0, 4), (4,), {"alpha": 2.0, "beta": 0.5}, (3, 4)),
        ((0, 3), (4, 0), (3, 4), {"transA": 1, "transB": 1, "beta": -1.5}, (3, 4)),
        ((0, 3), (3, 4), (1, 4), {}, (0, 4)),
    ],
)
def test_gemm_empty(a, b, c, attrs, ys):
    inputs = {"A": _randn(*a), "B": _randn(*b), "C": _randn(*c)}
    _assert_shape(check_against_ort("Gemm", inputs, attrs), ys)


# ------------------------------------------------------------------------------ fused ops


def _cuda_kernel_on_cpu(op: str, inputs: list, attrs: dict) -> np.ndarray:
    """``op`` of the tensorkiln domain run by the cuda backend's torch kernel on CPU tensors."""
    torch = pytest.importorskip("torch")
    from tensorkiln.kernels.registry import invoke, lookup

    args = [None if v is None else torch.from_numpy(np.ascontiguousarray(v)) for v in inputs]
    (y,) = invoke(lookup(op, "tensorkiln", 1, "cuda"), args, attrs, 1)
    return y.numpy()


def _fused(op: str, inputs: list, attrs: dict) -> np.ndarray:
    return run_kernel(op, dict(enumerate(inputs)), attrs, opset=1, domain="tensorkiln")[0]


def _act_attrs(activation: str) -> dict:
    attrs = {"activation": activation}
    if activation == "Clip":
        attrs |= {"activation_min": -0.5, "activation_max": 0.75}
    elif activation == "LeakyRelu":
        attrs["activation_alpha"] = 0.2
    return attrs


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("residual", [None, "add_act", "act_add"])
def test_conv_act_empty_batch(activation, residual):
    x, w, b = _randn(0, 6, 9, 9), _randn(8, 3, 3, 3), _randn(8)
    attrs = {"group": 2, "pads": [1, 0, 1, 0], "strides": [2, 1]} | _act_attrs(activation)
    ys = (0, 8, 5, 7)
    z = None if residual is None else _randn(*ys)
    if residual is not None:
        attrs["residual_order"] = residual
    got = _fused("ConvAct", [x, w, b, z], attrs)
    conv_attrs = {k: attrs[k] for k in ("group", "pads", "strides")}
    conv_inputs = {"X": x, "W": w, "B": b}
    (conv,) = run_ort(one_node_model("Conv", conv_inputs, conv_attrs), conv_inputs)
    assert got.shape == conv.shape == ys and got.dtype == x.dtype
    expected = _cuda_kernel_on_cpu("ConvAct", [x, w, b, z], attrs)
    assert got.shape == expected.shape and got.dtype == expected.dtype


def test_conv_act_empty_batch_keeps_narrow_dtype():
    x, w = _randn(0, 3, 6, 6, dtype=np.float16), _randn(4, 3, 3, 3, dtype=np.float16)
    got = _fused("ConvAct", [x, w], {"activation": "Relu"})
    assert got.shape == (0, 4, 4, 4) and got.dtype == np.float16


def _np_activation(v: np.ndarray, activation: str) -> np.ndarray:
    if activation == "Relu":
        return np.maximum(v, 0)
    if activation == "LeakyRelu":
        return np.where(v < 0, 0.2 * v, v)
    if activation == "Clip":
        return np.clip(v, -0.5, 0.75)
    if activation == "Sigmoid":
        return 1 / (1 + np.exp(-v))
    assert activation == ""
    return v


@pytest.mark.parametrize("activation", ["", "Relu", "LeakyRelu", "Clip", "Sigmoid"])
@pytest.mark.parametrize(
    ("a", "b", "c", "trans"),
    [((3, 0), (0, 4), (4,), {}), ((0, 3), (4, 0), (3, 4), {"transA": 1, "transB": 1})],
)
def test_gemm_act_k0_matches_ort_gemm_then_activation(activation, a, b, c, trans):
    inputs = {"A": _randn(*a), "B": _randn(*b), "C": _randn(*c)}
    attrs = {"alpha": 1.5, "beta": -2.0} | trans
    (gemm,) = run_ort(one_node_model("Gemm", inputs, attrs), inputs)
    got = _fused("GemmAct", list(inputs.values()), attrs | _act_attrs(activation))
    assert got.shape == gemm.shape == (3, 4) and got.dtype == F32
    np.testing.assert_allclose(got, _np_activation(gemm, activation), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(
    ("a", "b", "c", "ys"),
    [
        ((3, 0), (0, 4), (3, 4), (3, 4)),  # K=0: act(beta * C)
        ((2, 3, 0), (0, 4), (4,), (2, 3, 4)),  # MatMul form, K=0
        ((0, 3), (3, 4), (4,), (0, 4)),  # no rows
        ((0, 2, 3), (3, 4), (4,), (0, 2, 4)),
    ],
)
def test_gemm_act_empty_matches_cuda_kernel(activation, a, b, c, ys):
    inputs = [_randn(*a), _randn(*b), _randn(*c)]
    attrs = {"alpha": 0.5, "beta": 1.25} | _act_attrs(activation)
    got = _fused("GemmAct", inputs, attrs)
    expected = _cuda_kernel_on_cpu("GemmAct", inputs, attrs)
    assert got.shape == expected.shape == ys and got.dtype == expected.dtype
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_gemm_act_k0_without_bias_is_zeros():
    got = _fused("GemmAct", [_randn(3, 0), _randn(0, 5)], {"activation": "Sigmoid"})
    np.testing.assert_array_equal(got, np.full((3, 5), 0.5, F32))


# ------------------------------------------------------------------------------ tree ensembles


def test_tree_ensemble_regressor_zero_rows():
    attrs = _legacy_attrs(rng, 4, 4, 3, "target", _some_targets)
    attrs |= {"n_targets": 3, "base_values": list(rng.normal(size=3)), "post_transform": "SOFTMAX"}
    got = check_ml("TreeEnsembleRegressor", {"X": _randn(0, 4)}, attrs)
    _assert_shape(got, (0, 3))


@pytest.mark.parametrize("labels", ["int64s", "strings"])
def test_tree_ensemble_classifier_multiclass_zero_rows(labels):
    attrs = _legacy_attrs(rng, 4, 4, 3, "class", _some_targets)
    attrs[f"classlabels_{labels}"] = [10, 20, 30] if labels == "int64s" else ["a", "b", "c"]
    attrs["post_transform"] = "LOGISTIC"
    got = check_ml("TreeEnsembleClassifier", {"X": _randn(0, 4)}, attrs, n_outputs=2)
    _assert_shape(got, (0,), (0, 3))


@pytest.mark.parametrize("base_values", [None, [0.25, -0.5]])
def test_tree_ensemble_classifier_binary_zero_rows(base_values):
    attrs = _legacy_attrs(rng, 3, 4, 2, "class", lambda r, n: [1])
    attrs |= {"classlabels_int64s": [0, 1], "post_transform": "LOGISTIC"}
    if base_values is not None:
        attrs["base_values"] = base_values
    got = check_ml("TreeEnsembleClassifier", {"X": _randn(0, 4)}, attrs, n_outputs=2)
    _assert_shape(got, (0,), (0, 2))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tree_ensemble_v5_zero_rows(dtype):
    attrs = _v5_attrs(rng, 4, 3, 2)
    for key in ("nodes_splits", "leaf_weights"):  # onnxruntime wants them in X's type
        attrs[key] = numpy_helper.from_array(numpy_helper.to_array(attrs[key]).astype(dtype))
    got = check_ml("TreeEnsemble", {"X": _randn(0, 3, dtype=dtype)}, attrs, ml_opset=5)
    _assert_shape(got, (0, 2))
