"""Calibrators against independent oracles: numpy's own max and percentile of the raw data, a
literal transcription of TensorRT's entropy procedure, and the quantization error measured on
the raw data itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensorkiln.errors import InputError
from tensorkiln.precision import calibrators
from tensorkiln.precision.calibration import _add
from tensorkiln.precision.calibrators import (
    NUM_BINS,
    QMAX,
    Histogram,
    add_numpy,
    amax_entropy,
    check_method,
    choose_amax,
    fake_quantize,
)


def _hist(*arrays: np.ndarray) -> Histogram:
    h = Histogram.empty()
    for a in arrays:
        add_numpy(h, a)
    return h


def _activations(rng: np.random.Generator, n: int = 200_000) -> np.ndarray:
    """ReLU-like data: zeros, a bulk and a thin tail of outliers."""
    x = np.maximum(rng.standard_normal(n), 0) * rng.uniform(0.5, 2.0)
    # (set, not scaled: a scaled point may be one of the zeros, or near the bulk's edge, and a
    # draw whose outliers were all such had no tail to clip, once in about 300)
    x[rng.choice(n, 20, replace=False)] = x.max() * rng.uniform(2, 6, 20)
    return x.astype(np.float32)


def test_minmax_is_the_largest_magnitude() -> None:
    rng = np.random.default_rng()
    parts = [(rng.standard_normal(1000) * s).astype(np.float32) for s in rng.uniform(0.1, 9, 5)]
    h = _hist(*parts)
    assert choose_amax(h, "minmax", "int8") == np.abs(np.concatenate(parts)).max()
    assert h.total == 5000


@pytest.mark.parametrize("p", [99.0, 99.9, 99.99])
def test_percentile_is_numpys_within_one_bin(p: float) -> None:
    rng = np.random.default_rng()
    x = rng.laplace(size=300_000).astype(np.float32)
    h = _hist(x[:1000], x[1000:])  # (the range grows after the first batch)
    want = np.percentile(np.abs(x), p)
    assert abs(choose_amax(h, "percentile", "int8", p) - want) <= h.width * 1.01


def test_streamed_histogram_counts_as_one_pass() -> None:
    """Batches whose range grows (bins added, then merged) give the counts of one histogram of
    everything at the final bin width."""
    rng = np.random.default_rng()
    batches = [rng.standard_normal(5000).astype(np.float32) * s for s in (0.01, 1, 3, 40, 7)]
    h = _hist(*batches)
    a = np.abs(np.concatenate(batches)).astype(np.float64)
    assert NUM_BINS <= len(h.counts) <= 2 * NUM_BINS
    want = np.bincount(np.minimum((a / h.width).astype(int), len(h.counts) - 1))
    want = np.pad(want, (0, len(h.counts) - len(want)))
    # a value on a bin edge may land on either side after merging: compare cumulative counts
    assert np.max(np.abs(np.cumsum(h.counts) - np.cumsum(want))) <= 2
    assert h.total == a.size


def test_torch_tensors_histogram_as_numpy_arrays() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    x = (rng.standard_normal((4, 8, 16, 16)) * 3).astype(np.float32)
    a, b = Histogram.empty(), Histogram.empty()
    _add(a, torch.from_numpy(x))
    _add(b, x)
    assert a.amax == b.amax and a.width == b.width
    assert np.max(np.abs(np.cumsum(a.counts) - np.cumsum(b.counts))) <= 2


def _entropy_oracle(bins: np.ndarray, width: float) -> float:
    """TensorRT's entropy calibration as NVIDIA's toolkits write it (np.digitize of the bins onto
    129 evenly spaced edges), with loops: the candidate of least KL divergence, widest on ties."""
    bins = bins.copy()
    bins[0] = bins[1]
    best, best_i = math.inf, None
    for i in range(128, len(bins) + 1):
        ref = [float(c) for c in bins[:i]]
        ref[-1] += float(bins[i:].sum())
        level = np.digitize(np.arange(i), np.linspace(0, i, 129)) - 1
        sums, filled = [0.0] * 128, [0] * 128
        for k in range(i):
            sums[level[k]] += bins[k]
            filled[level[k]] += bins[k] != 0
        q = [sums[level[k]] / filled[level[k]] if bins[k] != 0 else 0.0 for k in range(i)]
        ps, qs = sum(ref), sum(q)
        kl = 0.0
        for pk, qk in zip(ref, q):
            if pk > 0:
                if qk == 0:
                    kl = math.inf
                    break
                kl += pk / ps * math.log((pk / ps) / (qk / qs))
        if kl <= best:
            best, best_i = kl, i
    return (best_i + 0.5) * width


def test_entropy_matches_the_procedure_written_out() -> None:
    rng = np.random.default_rng()
    for _ in range(3):
        counts = np.round(np.exp(-np.linspace(0, rng.uniform(3, 12), 300)) * 1e5)
        counts[rng.choice(300, 40, replace=False)] = 0  # empty bins
        h = Histogram(counts.astype(np.float64), 0.01, amax=3.0)
        want = min(_entropy_oracle(counts, 0.01), h.amax)  # (no range above the largest value)
        assert amax_entropy(h) == pytest.approx(want, rel=1e-12)


def test_entropy_clips_outliers_and_keeps_uniform_data() -> None:
    rng = np.random.default_rng()
    x = _activations(rng)
    h = _hist(x)
    amax = choose_amax(h, "entropy", "int8")
    assert amax < 0.8 * np.abs(x).max()  # the tail is clipped...
    assert amax > np.percentile(x, 99)  # ...the bulk is not
    u = _hist(rng.uniform(-5, 5, 100_000).astype(np.float32))
    assert choose_amax(u, "entropy", "int8") > 0.95 * u.amax


def test_entropy_on_few_values_does_not_clip_the_bulk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pooled tensor after a ReLU: 64 channels whose means lie away from zero, 4,096 values
    for a 2,048-bin histogram. Most candidate ranges then end on an empty bin (infinite
    divergence); the range must still cover the channels, not be a stray finite candidate near
    the smallest range (which the procedure run on the sparse histogram as it is picks)."""
    rng = np.random.default_rng()
    x = np.abs(rng.uniform(0.3, 0.94, 64) + rng.normal(0.0, 0.047, (64, 64))).astype(np.float32)
    x[0, :2] = [0.075, 0.0755]  # (two low samples: the candidate ranges that end on them)
    h = _hist(x[:32], x[32:])
    amax = choose_amax(h, "entropy", "int8")
    assert np.mean(np.abs(x) > amax) < 0.01, (amax, h.amax)
    monkeypatch.setattr(calibrators, "_ENTROPY_MIN_MEAN_COUNT", 0.0)
    assert np.mean(np.abs(x) > choose_amax(h, "entropy", "int8")) > 0.5  # (as it was)
    # a dense histogram is not coarsened: the same range either way
    dense = _hist(np.repeat(x, 64))
    assert dense.total >= 16 * len(dense.counts)
    raw = choose_amax(dense, "entropy", "int8")
    monkeypatch.undo()
    assert choose_amax(dense, "entropy", "int8") == raw


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_mse_range_is_near_the_best_on_the_raw_data(precision: str) -> None:
    rng = np.random.default_rng()
    x = _activations(rng, 50_000).astype(np.float64)
    got = choose_amax(_hist(x.astype(np.float32)), "mse", precision)
    grid = np.linspace(x.max() / 400, x.max(), 400)
    errors = np.array([np.mean((x - fake_quantize(x, a, precision)) ** 2) for a in grid])
    mine = np.mean((x - fake_quantize(x, got, precision)) ** 2)
    assert mine <= errors.min() * 1.05
    if precision == "int8":  # (FP8's levels are dense near zero: its best range may be the max)
        assert got < x.max()  # the outliers are not worth the resolution they would cost


def test_fake_quantize_rounds_to_the_grid() -> None:
    x = np.array([0.0, 0.49, 0.51, 1.5, 2.5, 200.0, -200.0])
    np.testing.assert_array_equal(fake_quantize(x, 127.0, "int8"), [0, 0, 1, 2, 2, 127, -127])
    y = fake_quantize(np.array([1.0, 17.0, 500.0]), QMAX["fp8"], "fp8")
    np.testing.assert_array_equal(y, [1.0, 16.0, 448.0])  # E4M3: 17 rounds to 16


def test_always_zero_tensor_has_range_zero() -> None:
    h = _hist(np.zeros(100, np.float32), np.zeros(5, np.float32))
    assert h.total == 105
    for method in ("minmax", "entropy", "percentile", "mse"):
        assert choose_amax(h, method, "int8") == 0.0
    add_numpy(h, np.array([0.0, 2.0], np.float32))  # data after the zeros: they stay in bin 0
    assert h.amax == 2.0 and h.counts[0] >= 106 and h.total == 107


@pytest.mark.parametrize(
    ("method", "precision", "percentile", "words"),
    [
        ("entropy", "fp8", 99.9, ["entropy", "fp8", "minmax"]),
        ("kl", "int8", 99.9, ["unknown calibrator 'kl'", "entropy, minmax"]),
        ("percentile", "int8", 101.0, ["percentile", "[50, 100]"]),
        ("minmax", "int4", 99.9, ["int8 or fp8", "int4"]),
    ],
)
def test_unusable_methods_are_named(method, precision, percentile, words) -> None:
    with pytest.raises(InputError) as exc:
        check_method(method, precision, percentile)
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_non_finite_data_is_an_error() -> None:
    with pytest.raises(ValueError, match="inf"):
        _hist(np.array([1.0, np.inf], np.float32))
