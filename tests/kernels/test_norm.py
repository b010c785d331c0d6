"""Normalization and Dropout reference kernels against onnxruntime on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

import tensorkiln.kernels.reference.norm  # noqa: F401  (registers the normalization kernels)
from tensorkiln.kernels.registry import invoke, lookup
from tests.kernels.ort_oracle import check_against_ort, run_kernel

rng = np.random.default_rng()


def _randn(*shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _bn_inputs(shape, dtype=np.float32):
    c = shape[1]
    return {
        "X": _randn(*shape, dtype=dtype) * 3 + 1,
        "scale": _randn(c, dtype=dtype),
        "B": _randn(c, dtype=dtype),
        "mean": _randn(c, dtype=dtype),
        "var": rng.uniform(0.5, 2, c).astype(dtype),
    }


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 7), (2, 4, 5, 6), (1, 3, 2, 3, 4)])
@pytest.mark.parametrize("opset", [9, 15])
def test_batch_normalization_inference(shape, opset):
    check_against_ort("BatchNormalization", _bn_inputs(shape), {"epsilon": 1e-3}, opset=opset)


def test_batch_normalization_float16():
    inputs = _bn_inputs((2, 3, 4, 4), np.float16)
    check_against_ort("BatchNormalization", inputs, opset=15, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("shape", [(4, 3), (2, 4, 5, 6)])
def test_batch_normalization_training(shape):
    attrs = {"training_mode": 1, "momentum": 0.8}
    check_against_ort(
        "BatchNormalization", _bn_inputs(shape), attrs, n_outputs=3, opset=15, rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("spatial", [1, 0])
def test_batch_normalization_legacy_training(spatial):
    # opsets < 14 train when a node declares five outputs (onnxruntime no longer runs that form):
    # checked against the formulas written out here in float64
    x = _randn(2, 3, 4, 5) * 3 + 1
    pshape = (3,) if spatial else (3, 4, 5)
    scale, b, mean = _randn(*pshape), _randn(*pshape), _randn(*pshape)
    var = rng.uniform(0.5, 2, pshape).astype(np.float32)
    attrs = {"momentum": 0.8, "epsilon": 1e-3, "spatial": spatial}
    inputs = {"X": x, "scale": scale, "B": b, "mean": mean, "var": var}
    y, run_m, run_v, bm, bv = run_kernel("BatchNormalization", inputs, attrs, n_outputs=5, opset=7)
    axes = (0, 2, 3) if spatial else (0,)
    x64 = x.astype(np.float64)
    want_m, want_v = x64.mean(axis=axes), x64.var(axis=axes)
    per_channel = (lambda v: v.reshape(1, 3, 1, 1)) if spatial else (lambda v: v[None])
    want_y = (x64 - per_channel(want_m)) / np.sqrt(per_channel(want_v) + 1e-3)
    want_y = want_y * per_channel(scale) + per_channel(b)
    np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(bm.reshape(want_m.shape), want_m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bv.reshape(want_v.shape), want_v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        run_m, mean * 0.8 + want_m.reshape(pshape) * 0.2, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        run_v, var * 0.8 + want_v.reshape(pshape) * 0.2, rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("shape", [(2, 3, 7), (2, 4, 5, 6), (1, 3, 2, 3, 4)])
def test_instance_normalization(shape):
    c = shape[1]
    inputs = {"X": _randn(*shape) * 2 + 1, "scale": _randn(c), "B": _randn(c)}
    check_against_ort("InstanceNormalization", inputs, {"epsilon": 1e-4}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("shape", "axis"), [((2, 3, 8), -1), ((2, 3, 4, 5), 1), ((3, 4, 5), 0), ((2, 3, 4, 5), -2)]
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_normalization(shape, axis, with_bias):
    norm = shape[axis:]
    inputs = {
        "X": _randn(*shape) * 2 + 1,
        "scale": _randn(*norm),
        "B": _randn(*norm) if with_bias else None,
    }
    check_against_ort(
        "LayerNormalization",
        inputs,
        {"axis": axis, "epsilon": 1e-3},
        n_outputs=3,
        opset=17,
        rtol=1e-4,
        atol=1e-5,
    )


def test_layer_normalization_float16_stats_are_float32():
    inputs = {"X": _randn(2, 3, 8, dtype=np.float16), "scale": _randn(8, dtype=np.float16)}
    got = check_against_ort(
        "LayerNormalization", inputs, n_outputs=3, opset=17, rtol=2e-3, atol=2e-3
    )
    assert [g.dtype for g in got] == [np.float16, np.float32, np.float32]


@pytest.mark.parametrize(
    ("shape", "groups"), [((2, 6, 5, 4), 3), ((1, 4, 7), 2), ((2, 4, 3, 2, 2), 4), ((2, 6, 3), 1)]
)
@pytest.mark.parametrize("opset", [18, 21])
def test_group_normalization(shape, groups, opset):
    n = groups if opset == 18 else shape[1]
    inputs = {"X": _randn(*shape) * 2 + 1, "scale": _randn(n), "bias": _randn(n)}
    check_against_ort(
        "GroupNormalization",
        inputs,
        {"num_groups": groups, "epsilon": 1e-3},
        opset=opset,
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize(("shape", "axis"), [((2, 3, 8), -1), ((2, 3, 4, 5), 1), ((3, 4), 0)])
def test_rms_normalization(shape, axis):
    inputs = {"X": _randn(*shape), "scale": _randn(*shape[axis:])}
    check_against_ort("RMSNormalization", inputs, {"axis": axis}, opset=23, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("axis", "p"), [(-1, 2), (1, 1), (0, 2)])
def test_lp_normalization(axis, p):
    check_against_ort(
        "LpNormalization", {"X": _randn(3, 4, 5)}, {"axis": axis, "p": p}, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("axes", [None, [1], [0, 2], [2, 3]])
def test_mean_variance_normalization(axes):
    attrs = {} if axes is None else {"axes": axes}
    check_against_ort(
        "MeanVarianceNormalization",
        {"X": _randn(2, 3, 4, 5) * 3 + 2},
        attrs,
        opset=13,
        rtol=1e-4,
        atol=1e-5,
    )


def test_mean_variance_normalization_of_a_narrow_spread():
    """A spread of 0.05 around 2 over three channels: the variance written as E[x^2] - mean^2
    cancels in float32; the kernel must stay within float32 rounding of the float64 answer."""
    x = (2 + 0.05 * _randn(2, 3, 4, 5)).astype(np.float32)
    x64 = x.astype(np.float64)
    centred = x64 - x64.mean(axis=1, keepdims=True)
    std = np.sqrt((centred**2).mean(axis=1, keepdims=True))
    want = centred / (std + 1e-9)
    got = invoke(lookup("MeanVarianceNormalization", "", 13), [x], {"axes": [1]}, 1)[0]
    # float32 rounding of values near 2, relative to each position's own spread (three draws can
    # land close together); the cancelling formula misses by eps * x^2 / std^2 instead
    bound = 16 * np.finfo(np.float32).eps * np.abs(x64).max() / std
    assert np.all(np.abs(got - want) <= bound + 1e-6)


@pytest.mark.parametrize(
    ("size", "shape"), [(3, (2, 6, 4, 4)), (5, (1, 7, 3, 3)), (5, (2, 3, 4, 2)), (1, (1, 4, 2, 2))]
)
def test_lrn(size, shape):
    attrs = {"size": size, "alpha": 0.01, "beta": 0.6, "bias": 1.5}
    check_against_ort("LRN", {"X": _randn(*shape) * 3}, attrs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opset", [7, 10, 13])
def test_dropout_inference_is_identity(opset):
    x = _randn(3, 4, 5)
    inputs = {"X": x} if opset < 12 else {"X": x, "ratio": np.array(0.3, np.float32)}
    check_against_ort("Dropout", inputs, opset=opset)
    # the mask keeps everything (onnxruntime's opset-10 mask is all false, against the spec)
    mask = run_kernel("Dropout", inputs, n_outputs=2, opset=opset)[1]
    assert mask.dtype == (x.dtype if opset < 10 else np.bool_)
    assert mask.shape == x.shape and mask.all()


def test_dropout_training_drops_and_rescales():
    # onnxruntime's random stream differs from numpy's: check the distribution and the scaling
    x = rng.uniform(1, 2, (200, 100)).astype(np.float32)
    inputs = {"X": x, "ratio": np.array(0.25, np.float32), "T": np.array(True)}
    y, mask = run_kernel("Dropout", inputs, n_outputs=2, opset=13)
    assert mask.dtype == np.bool_ and y.dtype == np.float32
    assert abs(1 - mask.mean() - 0.25) < 0.02
    np.testing.assert_allclose(y[mask], x[mask] / 0.75, rtol=1e-6)
    assert not y[~mask].any()
    again = run_kernel("Dropout", inputs, {"seed": 7}, n_outputs=2, opset=13)[1]
    np.testing.assert_array_equal(
        again, run_kernel("Dropout", inputs, {"seed": 7}, n_outputs=2, opset=13)[1]
    )


def test_group_normalization_bad_groups_is_a_value_error():
    inputs = {"X": _randn(1, 6, 2), "scale": _randn(6), "bias": _randn(6)}
    with pytest.raises(ValueError, match="num_groups"):
        run_kernel("GroupNormalization", inputs, {"num_groups": 4})
