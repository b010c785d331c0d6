"""The cuda backend's conv, pool, normalization, loss and random kernels against the numpy
reference, on fresh random inputs (torch CPU tensors here; the same code runs on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
rng = np.random.default_rng()


def _randn(*shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _strided(t):
    """The same values as a non-contiguous tensor (a view into a wider buffer)."""
    if t.ndim == 0 or t.numel() == 0:
        return t
    wide = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    wide[..., ::2] = t
    return wide[..., ::2]


def _compare(op, args, attrs=None, *, opset=22, n_outputs=1, tol=1e-5, strided=False):
    attrs = attrs or {}
    ref = invoke(lookup(op, "", opset, "reference"), args, attrs, n_outputs)
    inputs = [to_torch(a, DEVICE) for a in args]
    if strided:
        inputs = [_strided(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    got = invoke(lookup(op, "", opset, "cuda"), inputs, attrs, n_outputs)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        g = to_numpy(g)
        assert g.dtype == r.dtype and g.shape == r.shape, (g.dtype, r.dtype, g.shape, r.shape)
        if r.dtype.kind in "iub":
            np.testing.assert_array_equal(g, r)
        else:
            np.testing.assert_allclose(g.astype(np.float64), r.astype(np.float64), rtol=tol,
                                       atol=tol)  # fmt: skip
    return got


# ---------------------------------------------------------------------------------- convolutions

CONV_CASES = [
    ((1, 4, 10, 11), (6, 4, 3, 2), {"pads": [0, 2, 1, 0], "strides": [1, 3]}),
    ((1, 4, 12, 12), (5, 4, 3, 3), {"dilations": [2, 3], "pads": [2, 1, 2, 3]}),
    ((2, 6, 8, 8), (9, 2, 3, 3), {"group": 3, "pads": [1, 1, 1, 1]}),
    ((1, 8, 9, 9), (8, 1, 3, 3), {"group": 8, "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((1, 3, 11, 10), (4, 3, 4, 4), {"auto_pad": "SAME_LOWER", "strides": [2, 3]}),
    ((1, 3, 11, 10), (4, 3, 3, 3), {"auto_pad": "VALID", "strides": [2, 2]}),
    ((2, 3, 17), (5, 3, 4), {"pads": [2, 1], "strides": [2], "dilations": [2]}),
    ((1, 4, 6, 7, 8), (4, 2, 3, 3, 2), {"group": 2, "pads": [1, 0, 1, 1, 0, 1]}),
    ((1, 2, 5, 4, 6, 5), (3, 2, 2, 3, 2, 2), {"pads": [1, 0, 1, 0, 0, 1, 1, 1], "strides": [2, 1, 1, 2]}),
]  # fmt: skip


@pytest.mark.parametrize(("xs", "ws", "attrs"), CONV_CASES)
def test_conv(xs, ws, attrs):
    _compare("Conv", [_randn(*xs), _randn(*ws), _randn(ws[0])], attrs, tol=1e-4, strided=True)


def test_conv_float16():
    x, w, b = _randn(1, 3, 9, 9, dtype=np.float16), _randn(4, 3, 3, 3, dtype=np.float16), None
    _compare("Conv", [x, w, b], {"pads": [1, 0, 0, 1]}, tol=2e-2)


TRANSPOSE_CASES = [
    ((1, 2, 3, 4), (2, 3, 3, 3), {"strides": [2, 2], "output_padding": [1, 1]}),
    ((1, 2, 3, 4), (2, 3, 3, 3), {"strides": [3, 2], "output_shape": [10, 9]}),
    ((1, 2, 3, 4), (2, 3, 3, 2), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 3, 4), (2, 3, 3, 2), {"strides": [2, 2], "pads": [1, 0, 0, 2]}),
    ((2, 4, 5), (4, 2, 3), {"group": 2, "dilations": [2], "pads": [3, 3]}),
    ((1, 4, 3, 3, 2), (4, 1, 2, 2, 2), {"group": 4, "strides": [1, 2, 2], "output_padding": [0, 1, 0]}),
    ((1, 2, 3, 2, 2, 3), (2, 3, 2, 2, 1, 2), {"strides": [2, 1, 1, 2], "pads": [1, 0, 0, 0, 0, 0, 0, 1]}),
]  # fmt: skip


@pytest.mark.parametrize(("xs", "ws", "attrs"), TRANSPOSE_CASES)
def test_conv_transpose(xs, ws, attrs):
    cout = ws[1] * attrs.get("group", 1)
    _compare("ConvTranspose", [_randn(*xs), _randn(*ws), _randn(cout)], attrs, tol=1e-4)


def test_conv_integer_is_exact_for_long_sums():
    # 64 channels x 9 taps: sums beyond float32's exact integers
    x = rng.integers(0, 256, (1, 64, 6, 6), dtype=np.uint8)
    w = rng.integers(-128, 128, (5, 64, 3, 3), dtype=np.int8)
    xz, wz = np.array(3, np.uint8), rng.integers(-3, 3, (5,), dtype=np.int8)
    _compare("ConvInteger", [x, w, xz, wz], {"pads": [1, 1, 0, 0]})


def test_qlinear_conv_per_channel():
    x = rng.integers(0, 256, (1, 8, 7, 7), dtype=np.uint8)
    w = rng.integers(-128, 128, (4, 8, 3, 3), dtype=np.int8)
    scales = [np.array(0.02, np.float32), rng.uniform(0.001, 0.01, 4).astype(np.float32)]
    b = rng.integers(-500, 500, (4,), dtype=np.int32)
    args = [x, scales[0], np.array(128, np.uint8), w, scales[1], np.zeros(4, np.int8)]
    args += [np.array(0.05, np.float32), np.array(10, np.uint8), b]
    _compare("QLinearConv", args, {"strides": [2, 2], "auto_pad": "SAME_UPPER"})


@pytest.mark.parametrize("with_mask", [False, True])
def test_deform_conv(with_mask):
    x, w = _randn(2, 4, 6, 7), _randn(6, 2, 3, 3)
    offset = 2 * _randn(2, 2 * 9 * 2, 3, 4)
    mask = rng.random((2, 2 * 9, 3, 4)).astype(np.float32) if with_mask else None
    attrs = {"group": 2, "offset_group": 2, "pads": [1, 1, 1, 1], "strides": [2, 2]}
    _compare("DeformConv", [x, w, offset, _randn(6), mask], attrs, tol=1e-4)


def test_causal_conv_with_state():
    x, w, b, past = _randn(2, 3, 5), _randn(3, 1, 4), _randn(3), _randn(2, 3, 3)
    _compare("CausalConvWithState", [x, w, b, past], {"activation": "silu"}, opset=27,
             n_outputs=2, tol=1e-5)  # fmt: skip
    h = [a.astype(np.float16) for a in (x, w)]
    _compare("CausalConvWithState", h, {}, opset=27, n_outputs=2, tol=2e-3)


# ------------------------------------------------------------------------------------- pooling

POOL_CASES = [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    {"kernel_shape": [3, 2], "pads": [0, 2, 1, 0], "strides": [2, 1]},
    {"kernel_shape": [2, 3], "dilations": [2, 1], "auto_pad": "SAME_LOWER", "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [3, 3], "ceil_mode": 1, "pads": [0, 0, 2, 2]},
]


@pytest.mark.parametrize("attrs", POOL_CASES)
@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_with_indices(attrs, storage_order):
    x = _randn(2, 3, 8, 9)
    _compare("MaxPool", [x], {**attrs, "storage_order": storage_order}, n_outputs=2,
             strided=True)  # fmt: skip


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float16])
def test_max_pool_other_types(dtype):
    x = rng.permutation(2 * 3 * 7 * 8).reshape(2, 3, 7, 8).astype(dtype)  # distinct values
    attrs = {"kernel_shape": [2, 3], "pads": [1, 0, 1, 2], "strides": [2, 2]}
    _compare("MaxPool", [x], attrs, n_outputs=2)


def test_max_pool_4d_spatial_and_1d():
    _compare("MaxPool", [_randn(1, 2, 4, 5, 3, 4)], {"kernel_shape": [2, 2, 1, 2]}, n_outputs=2)
    _compare("MaxPool", [_randn(2, 2, 9)], {"kernel_shape": [3], "pads": [1, 2]}, n_outputs=2)


@pytest.mark.filterwarnings("ignore:invalid value")  # a window wholly in the pads: 0 / 0
@pytest.mark.parametrize("attrs", POOL_CASES)
@pytest.mark.parametrize("include", [0, 1])
def test_average_pool(attrs, include):
    _compare("AveragePool", [_randn(2, 3, 8, 9)], {**attrs, "count_include_pad": include})


def test_average_and_lp_pool_other_shapes():
    x16 = _randn(1, 2, 7, 7, dtype=np.float16)
    _compare("AveragePool", [x16], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, tol=2e-3)
    _compare("AveragePool", [_randn(1, 2, 6, 5, 4)], {"kernel_shape": [2, 2, 2], "ceil_mode": 1,
             "strides": [2, 2, 2], "count_include_pad": 1, "pads": [1, 0, 0, 0, 1, 1]})  # fmt: skip
    _compare("LpPool", [_randn(2, 3, 8, 9)], {**POOL_CASES[1], "p": 3}, tol=1e-4)
    _compare("LpPool", [_randn(2, 3, 8)], {"kernel_shape": [3], "auto_pad": "SAME_UPPER"})


def test_global_pools():
    for x in (_randn(2, 3, 4, 5), _randn(2, 3, 4, 5, dtype=np.float16), _randn(2, 3)):
        tol = 2e-3 if x.dtype == np.float16 else 1e-5
        _compare("GlobalAveragePool", [x], tol=tol)
        _compare("GlobalMaxPool", [x], tol=tol)
        _compare("GlobalLpPool", [x], {"p": 3}, tol=tol)


def test_max_unpool_round_trips_max_pool():
    x = _randn(1, 2, 6, 8)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    y, idx = invoke(lookup("MaxPool", "", 22, "reference"), [x], attrs, 2)
    _compare("MaxUnpool", [y, idx], attrs)
    _compare("MaxUnpool", [y, idx, np.array([1, 2, 7, 9], np.int64)], attrs)


@pytest.mark.parametrize("bad", [-1, 96])  # the output holds 1 * 2 * 6 * 8 = 96 values
def test_max_unpool_rejects_an_index_outside_the_output(bad):
    # the device would write past its buffer: the index is checked first, as on the host
    x = _randn(1, 2, 3, 4)
    idx = rng.integers(0, 96, x.shape).astype(np.int64)
    idx[0, 1, 2, 3] = bad
    args = [to_torch(x, DEVICE), to_torch(idx, DEVICE)]
    with pytest.raises(ValueError, match="outside the output"):
        invoke(
            lookup("MaxUnpool", "", 22, "cuda"),
            args,
            {"kernel_shape": [2, 2], "strides": [2, 2]},
            1,
        )


def test_max_roi_pool():
    x = _randn(2, 3, 10, 12)
    rois = np.array([[0, 1, 1, 8, 6], [1, -2, 3.4, 5.5, 30], [1, 4, 4, 4, 4]], np.float32)
    _compare("MaxRoiPool", [x, rois], {"pooled_shape": [3, 2], "spatial_scale": 0.7})


# ------------------------------------------------------------------------------- normalizations


def test_batch_norm_inference_and_training():
    x = _randn(2, 3, 4, 5)
    params = [_randn(3), _randn(3), _randn(3), rng.uniform(0.5, 2, 3).astype(np.float32)]
    _compare("BatchNormalization", [x, *params], strided=True)
    _compare("BatchNormalization", [x.astype(np.float16), *[p.astype(np.float16) for p in params]],
             tol=3e-3)  # fmt: skip
    _compare("BatchNormalization", [x, *params], {"training_mode": 1, "momentum": 0.8},
             n_outputs=3)  # fmt: skip
    legacy = {"is_test": 0, "spatial": 0, "consumed_inputs": [0, 0, 0, 1, 1]}
    per_elem = [_randn(3, 4, 5) for _ in range(3)] + [rng.uniform(0.5, 2, (3, 4, 5))]
    per_elem = [p.astype(np.float32) for p in per_elem]
    _compare("BatchNormalization", [x, *per_elem], legacy, opset=6, n_outputs=5, tol=1e-4)


def test_layer_norm_paths():
    x = _randn(2, 3, 8)
    _compare("LayerNormalization", [x, _randn(8), _randn(8)], strided=True, tol=1e-4)
    h = [a.astype(np.float16) for a in (x, _randn(3, 8), _randn(3, 8))]
    _compare("LayerNormalization", h, {"axis": -2}, tol=3e-3)
    _compare("LayerNormalization", [x, _randn(1, 8)], {"axis": 1}, n_outputs=3, tol=1e-4)
    _compare("LayerNormalization", [x.astype(np.float64), _randn(8).astype(np.float64)],
             {"stash_type": 11}, n_outputs=3)  # fmt: skip


def test_group_instance_rms_norms():
    x = _randn(2, 6, 3, 4)
    _compare("GroupNormalization", [x, _randn(3), _randn(3)], {"num_groups": 3}, opset=18,
             tol=1e-4)  # fmt: skip
    _compare("GroupNormalization", [x, _randn(6), _randn(6)], {"num_groups": 2}, tol=1e-4)
    _compare("InstanceNormalization", [x.astype(np.float16), _randn(6).astype(np.float16),
             _randn(6).astype(np.float16)], tol=3e-3)  # fmt: skip
    _compare("RMSNormalization", [x, _randn(3, 4)], {"axis": -2}, opset=23, tol=1e-4)
    _compare("RMSNormalization", [x.astype(np.float16), _randn(4).astype(np.float16)], opset=23,
             tol=3e-3)  # fmt: skip


def test_lp_mvn_lrn():
    x = _randn(2, 5, 3, 4)
    x[0, :, 0, 0] = 0  # a zero norm
    _compare("LpNormalization", [x], {"axis": 1, "p": 1})
    _compare("LpNormalization", [x], {"axis": -1, "p": 2})
    _compare("MeanVarianceNormalization", [x], {"axes": [0, -1]}, tol=1e-4)
    _compare("LRN", [x], {"size": 4, "alpha": 0.01, "beta": 0.6, "bias": 2.0})
    _compare("LRN", [x.astype(np.float16)], {"size": 3}, tol=2e-3)


def test_dropout():
    x = _randn(3, 4)
    _compare("Dropout", [x], n_outputs=2)
    _compare("Dropout", [x], {"ratio": 0.3}, opset=10, n_outputs=2)
    _compare("Dropout", [x], opset=7, n_outputs=2)
    seeded = [x, np.array(0.4, np.float32), np.array(True)]
    _compare("Dropout", seeded, {"seed": 5}, n_outputs=2)
    y, mask = invoke(lookup("Dropout", "", 22, "cuda"), [to_torch(a, DEVICE) for a in seeded],
                     {}, 2)  # fmt: skip
    kept = to_numpy(mask)
    np.testing.assert_allclose(to_numpy(y), np.where(kept, x / 0.6, 0), rtol=1e-6)


# -------------------------------------------------------------------------------------- losses


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_losses(reduction):
    scores, labels = _randn(3, 5, 2, 2), rng.integers(0, 5, (3, 2, 2))
    labels[0, 0, 0] = -1
    attrs = {"reduction": reduction, "ignore_index": -1}
    _compare("SoftmaxCrossEntropyLoss", [scores, labels, _randn(5)], attrs, n_outputs=2, tol=1e-5)
    _compare("NegativeLogLikelihoodLoss", [scores, labels, _randn(5)], attrs, tol=1e-5)
    _compare("NegativeLogLikelihoodLoss", [scores.astype(np.float16), np.abs(labels)],
             {"reduction": reduction}, tol=3e-3)  # fmt: skip


# -------------------------------------------------------------------------------------- random


def _run(op, args, attrs):
    return invoke(lookup(op, "", 22, "cuda"), args, attrs, 1)[0]


def test_random_shapes_dtypes_seeds_and_moments():
    attrs = {"shape": [200, 100], "low": -2.0, "high": 3.0, "seed": 7.0}
    u = _run("RandomUniform", [], attrs)
    assert u.shape == (200, 100) and u.dtype == torch.float32
    assert torch.equal(u, _run("RandomUniform", [], attrs))
    assert u.min() >= -2 and u.max() < 3 and abs(u.mean().item() - 0.5) < 0.1
    n = _run("RandomNormal", [], {"shape": [20000], "mean": 1.0, "scale": 2.0, "dtype": 11})
    assert n.dtype == torch.float64 and abs(n.mean().item() - 1) < 0.1
    assert abs(n.std().item() - 2) < 0.1
    like = torch.zeros(3, 4, dtype=torch.float16, device=DEVICE)
    assert _run("RandomNormalLike", [like], {}).dtype == torch.float16
    assert _run("RandomUniformLike", [like], {"dtype": 16}).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="floating-point"):
        _run("RandomNormal", [], {"shape": [2], "dtype": 7})


def test_bernoulli_and_multinomial():
    p = torch.tensor([0.1, 0.5, 0.9], device=DEVICE).repeat(4000, 1)
    b = _run("Bernoulli", [p], {})
    assert b.dtype == torch.float32
    np.testing.assert_allclose(b.mean(0).cpu().numpy(), [0.1, 0.5, 0.9], atol=0.03)
    assert _run("Bernoulli", [p], {"dtype": 9, "seed": 1.0}).dtype == torch.bool
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, -1.0]], device=DEVICE)
    s = _run("Multinomial", [logits], {"sample_size": 20000, "seed": 3.0, "dtype": 7})
    assert s.shape == (2, 20000) and s.dtype == torch.int64
    freq = torch.stack([torch.bincount(r, minlength=3) for r in s]).double() / 20000
    probs = torch.softmax(logits.double(), 1)
    np.testing.assert_allclose(freq.cpu().numpy(), probs.cpu().numpy(), atol=0.02)
