"""Conv-family reference kernels against onnxruntime on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

from tensorkiln.ops.window import geometry
from tests.kernels.ort_oracle import check_against_ort, one_node_model, run_kernel, run_ort

rng = np.random.default_rng()


def _randn(*shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _scalar(value, dtype) -> np.ndarray:
    return np.array(value, dtype=dtype)


CONV_CASES = [
    # (X shape, W shape, attrs)
    ((2, 3, 9, 9), (4, 3, 3, 3), {}),
    ((1, 4, 10, 11), (6, 4, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((1, 4, 10, 11), (6, 4, 3, 2), {"pads": [0, 2, 1, 0], "strides": [1, 3]}),
    ((1, 4, 12, 12), (5, 4, 3, 3), {"dilations": [2, 3], "pads": [2, 1, 2, 3]}),
    ((2, 6, 8, 8), (9, 2, 3, 3), {"group": 3, "pads": [1, 1, 1, 1]}),
    ((1, 8, 9, 9), (8, 1, 3, 3), {"group": 8, "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((2, 4, 7, 7), (8, 1, 3, 3), {"group": 4, "dilations": [2, 2]}),
    ((1, 16, 7, 7), (8, 16, 1, 1), {}),
    ((1, 16, 7, 7), (8, 16, 1, 1), {"strides": [2, 2]}),
    ((1, 3, 11, 10), (4, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 3, 11, 10), (4, 3, 4, 4), {"auto_pad": "SAME_LOWER", "strides": [2, 3]}),
    ((1, 3, 11, 10), (4, 3, 3, 3), {"auto_pad": "VALID", "strides": [2, 2]}),
    ((2, 3, 17), (5, 3, 4), {"pads": [2, 1], "strides": [2], "dilations": [2]}),
    ((1, 4, 6, 7, 8), (4, 2, 3, 3, 2), {"group": 2, "pads": [1, 0, 1, 1, 0, 1]}),
    ((1, 2, 7, 6, 5), (3, 2, 2, 2, 2), {"strides": [2, 1, 2], "auto_pad": "SAME_UPPER"}),
]


@pytest.mark.parametrize(("xs", "ws", "attrs"), CONV_CASES)
def test_conv(xs, ws, attrs):
    inputs = {"X": _randn(*xs), "W": _randn(*ws), "B": _randn(ws[0])}
    check_against_ort("Conv", inputs, attrs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("dtype", "tol"), [(np.float16, 2e-2), (np.float64, 1e-4)])
def test_conv_other_float_types_match_float32_conv(dtype, tol):
    # onnxruntime's CPU provider has Conv for float32 only: compare with it on the same values
    x, w = _randn(1, 3, 6, 6, dtype=dtype), _randn(4, 3, 3, 3, dtype=dtype)
    got = run_kernel("Conv", {"X": x, "W": w}, {"pads": [1, 1, 1, 1]})[0]
    inputs32 = {"X": x.astype(np.float32), "W": w.astype(np.float32)}
    ref = check_against_ort("Conv", inputs32, {"pads": [1, 1, 1, 1]}, rtol=1e-4, atol=1e-4)[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float32), ref, rtol=tol, atol=tol)


def test_conv_channel_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match="channels"):
        run_kernel("Conv", {"X": _randn(1, 3, 5, 5), "W": _randn(4, 2, 3, 3)})


CONV_T_CASES = [
    ((1, 3, 4, 5), (3, 2, 3, 3), {}),
    ((2, 4, 5, 5), (4, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    (
        (1, 4, 5, 4),
        (4, 3, 3, 2),
        {"strides": [3, 2], "output_padding": [1, 1], "pads": [0, 1, 1, 0]},
    ),
    ((1, 4, 5, 5), (4, 2, 3, 3), {"group": 2, "strides": [2, 2], "dilations": [2, 1]}),
    ((1, 3, 5, 5), (3, 2, 3, 3), {"strides": [2, 2], "output_shape": [10, 11]}),
    ((1, 3, 5, 5), (3, 2, 4, 4), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 3, 5, 5), (3, 2, 3, 3), {"strides": [2, 2], "auto_pad": "VALID"}),
    ((2, 3, 7), (3, 4, 3), {"strides": [2], "pads": [1, 2]}),
    ((1, 2, 3, 4, 3), (2, 3, 2, 3, 2), {"strides": [2, 1, 2], "pads": [0, 1, 0, 1, 0, 0]}),
]


@pytest.mark.parametrize(("xs", "ws", "attrs"), CONV_T_CASES)
def test_conv_transpose(xs, ws, attrs):
    group = attrs.get("group", 1)
    inputs = {"X": _randn(*xs), "W": _randn(*ws), "B": _randn(ws[1] * group)}
    check_against_ort("ConvTranspose", inputs, attrs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "attrs", [{}, {"pads": [1, 1, 1, 1], "strides": [2, 2]}, {"group": 2, "dilations": [2, 2]}]
)
def test_conv_integer(attrs):
    group = attrs.get("group", 1)
    x = rng.integers(0, 256, (1, 4, 8, 8), dtype=np.uint8)
    w = rng.integers(0, 256, (6, 4 // group, 3, 3), dtype=np.uint8)
    inputs = {"x": x, "w": w, "x_zero_point": _scalar(rng.integers(0, 256), np.uint8)}
    inputs["w_zero_point"] = _scalar(rng.integers(0, 256), np.uint8)
    check_against_ort("ConvInteger", inputs, attrs, opset=10)


@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_conv(per_channel):
    m = 6
    w_scale = rng.uniform(0.01, 0.05, m if per_channel else 1).astype(np.float32)
    inputs = {
        "x": rng.integers(0, 256, (1, 4, 8, 8), dtype=np.uint8),
        "x_scale": _scalar(rng.uniform(0.01, 0.1), np.float32),
        "x_zero_point": _scalar(rng.integers(100, 150), np.uint8),
        # 7-bit weights: onnxruntime's uint8 x int8 convolution on AVX2 (no VNNI) saturates
        # pairs of products at int16 for larger ones (vpmaddubsw), and is then the one that is off
        "w": rng.integers(-64, 64, (m, 4, 3, 3), dtype=np.int8),
        "w_scale": w_scale if per_channel else w_scale.reshape(()),
        "w_zero_point": np.zeros(m if per_channel else (), np.int8),
        "y_scale": _scalar(rng.uniform(1, 3), np.float32),
        "y_zero_point": _scalar(rng.integers(100, 150), np.uint8),
        "B": rng.integers(-1000, 1000, m, dtype=np.int32),
    }
    got = run_kernel("QLinearConv", inputs, {"pads": [1, 1, 1, 1]}, opset=10)[0]
    model = one_node_model("QLinearConv", inputs, {"pads": [1, 1, 1, 1]}, opset=10)
    expected = run_ort(model, inputs)[0]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # a requantization tie may round differently: allow one step
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1


@pytest.mark.parametrize(
    ("xs", "ws", "attrs", "og"),
    [
        ((1, 4, 7, 7), (6, 4, 3, 3), {"pads": [1, 1, 1, 1]}, 1),
        ((2, 4, 8, 7), (4, 2, 3, 2), {"strides": [2, 1], "group": 2, "dilations": [1, 2]}, 2),
    ],
)
def test_deform_conv(xs, ws, attrs, og):
    g = geometry(xs[2:], ws[2:], attrs.get("strides"), attrs.get("dilations"), attrs.get("pads"))
    offset = _randn(xs[0], og * ws[2] * ws[3] * 2, *g.out) * 2
    mask = rng.uniform(0, 1, (xs[0], og * ws[2] * ws[3], *g.out)).astype(np.float32)
    inputs = {
        "X": _randn(*xs),
        "W": _randn(*ws),
        "offset": offset,
        "B": _randn(ws[0]),
        "mask": mask,
    }
    check_against_ort(
        "DeformConv", inputs, {**attrs, "offset_group": og}, opset=22, rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize(
    ("k", "with_state", "activation"), [(4, True, "silu"), (3, False, "none"), (1, False, "swish")]
)
def test_causal_conv_with_state_equals_depthwise_conv(k, with_state, activation):
    b, c, length = 2, 5, 6
    x, w, bias = _randn(b, c, length), _randn(c, 1, k), _randn(c)
    past = _randn(b, c, k - 1) if with_state else np.zeros((b, c, k - 1), np.float32)
    inputs = {"input": x, "weight": w, "bias": bias, "past_state": past if with_state else None}
    y, state = run_kernel(
        "CausalConvWithState", inputs, {"activation": activation}, n_outputs=2, opset=28
    )
    # the oracle: onnxruntime's depthwise Conv over [past_state, x]
    full = np.concatenate([past, x], axis=2)
    ref = check_against_ort("Conv", {"X": full, "W": w, "B": bias}, {"group": c})[0]
    if activation != "none":
        ref = ref / (1 + np.exp(-ref))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(state, full[:, :, length:])
