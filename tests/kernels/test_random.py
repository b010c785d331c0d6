"""Random generators: shapes, dtypes, seed determinism and distribution moments."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.kernels.ort_oracle import run_kernel

N = 200_000


def test_uniform_moments_and_seed():
    rng = np.random.default_rng()
    # (float32 bounds, as an ONNX model's float attributes are: a float32 output cannot
    # hold a float64 bound exactly, and may round to just below it)
    low, high = sorted(rng.uniform(-3, 3, size=2).astype(np.float32))
    attrs = {"shape": [N // 100, 100], "low": float(low), "high": float(high)}
    x = run_kernel("RandomUniform", {}, attrs)[0]
    assert x.shape == (N // 100, 100) and x.dtype == np.float32
    assert x.min() >= low and x.max() <= high
    np.testing.assert_allclose(x.mean(), (low + high) / 2, atol=0.02 * (high - low))
    np.testing.assert_allclose(x.var(), (high - low) ** 2 / 12, rtol=0.03)
    seeded = {**attrs, "seed": float(rng.integers(1000))}
    a, b = run_kernel("RandomUniform", {}, seeded)[0], run_kernel("RandomUniform", {}, seeded)[0]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, run_kernel("RandomUniform", {}, attrs)[0])


def test_normal_moments_and_dtypes():
    rng = np.random.default_rng()
    mean, scale = float(rng.uniform(-2, 2)), float(rng.uniform(0.5, 2))
    x = run_kernel("RandomNormal", {}, {"shape": [N], "mean": mean, "scale": scale, "dtype": 11})[0]
    assert x.dtype == np.float64
    np.testing.assert_allclose(x.mean(), mean, atol=0.02 * scale)
    np.testing.assert_allclose(x.std(), scale, rtol=0.02)
    like = rng.standard_normal((3, 4)).astype(np.float16)
    y = run_kernel("RandomNormalLike", {"input": like}, {})[0]
    assert y.shape == (3, 4) and y.dtype == np.float16
    z = run_kernel("RandomUniformLike", {"input": like}, {"dtype": 16})[0]
    assert z.dtype == ml_dtypes.bfloat16 and z.shape == (3, 4)
    with pytest.raises(ValueError, match="floating-point"):
        run_kernel("RandomNormal", {}, {"shape": [2], "dtype": 7})


def test_bernoulli_rate():
    rng = np.random.default_rng()
    p = rng.uniform(0.05, 0.95, size=(4,))
    probs = np.broadcast_to(p, (N // 4, 4)).astype(np.float32)
    x = run_kernel("Bernoulli", {"input": probs}, {})[0]
    assert x.dtype == np.float32 and set(np.unique(x)) <= {0.0, 1.0}
    np.testing.assert_allclose(x.mean(axis=0), p, atol=0.01)
    b = run_kernel("Bernoulli", {"input": probs[:5]}, {"dtype": 9, "seed": 3.0})[0]
    assert b.dtype == np.bool_
    np.testing.assert_array_equal(
        b, run_kernel("Bernoulli", {"input": probs[:5]}, {"dtype": 9, "seed": 3.0})[0]
    )


def test_multinomial_frequencies():
    rng = np.random.default_rng()
    logits = rng.standard_normal((2, 5)).astype(np.float32)
    s = run_kernel("Multinomial", {"input": logits}, {"sample_size": N // 2})[0]
    assert s.shape == (2, N // 2) and s.dtype == np.int32
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    for row in range(2):
        freq = np.bincount(s[row], minlength=5) / s.shape[1]
        np.testing.assert_allclose(freq, probs[row], atol=0.01)
    seeded = {"sample_size": 7, "seed": 1.5, "dtype": 7}
    a = run_kernel("Multinomial", {"input": logits}, seeded)[0]
    assert a.dtype == np.int64
    np.testing.assert_array_equal(a, run_kernel("Multinomial", {"input": logits}, seeded)[0])
