"""Calibrators: the range (amax) an INT8 or FP8 tensor is quantized over, from the histogram of
the tensor's magnitudes on calibration data.

Quantization is symmetric: a tensor of range ``amax`` gets the scale ``amax / QMAX[precision]``
(127 for INT8, 448 for FP8 E4M3), values beyond ``amax`` saturate. The calibrators, as TensorRT
and NVIDIA's quantization toolkits name them:

* ``minmax``: the largest magnitude seen; nothing saturates, small values lose resolution;
* ``percentile``: the magnitude below which ``percentile`` % of the values lie (99.99 by default);
* ``entropy``: TensorRT's default for INT8: the range whose 128 quantization levels keep the
  distribution closest to the original, by Kullback-Leibler divergence (Migacz, "8-bit Inference
  with TensorRT", GTC 2017);
* ``mse``: the range that minimizes the mean squared quantization error of the values seen
  (INT8 rounding, or FP8 E4M3 rounding for FP8).

Every calibrator reads a :class:`Histogram`, so one pass over the data serves all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from tensorkiln.errors import InputError

QMAX = {"int8": 127.0, "fp8": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)}
CALIBRATORS = ("entropy", "minmax", "percentile", "mse")
# TensorRT's default calibrator for INT8; for FP8 its uneven levels make the range (max) the rule
DEFAULT_CALIBRATOR = {"int8": "entropy", "fp8": "minmax"}
DEFAULT_PERCENTILE = 99.99
NUM_BINS = 2048  # histogram resolution: at least this many bins up to the largest magnitude
_MAX_BINS = 2 * NUM_BINS  # a histogram that grows past this merges neighbouring bins
_QUANT_BINS = 128  # INT8's positive levels, for the entropy calibrator
# the entropy calibrator's least mean count per bin: a sparser histogram is coarsened first
_ENTROPY_MIN_MEAN_COUNT = 16.0
_MSE_CANDIDATES = 512  # ranges the mse calibrator tries, evenly spaced up to the largest magnitude


@dataclass
class Histogram:
    """Counts of ``|x|`` in bins of equal ``width`` from 0; ``amax`` is the largest magnitude.

    It grows as data arrives (:meth:`add_counts`): bins are added at the top while they number
    under ``_MAX_BINS``, after that neighbours merge (the width doubles), so the resolution is
    never coarser than ``amax / NUM_BINS``.
    """

    counts: np.ndarray  # float64
    width: float
    amax: float = 0.0
    # the largest magnitude per index of the last axis (a GEMM input's channels), when asked
    channels: np.ndarray | None = None

    @classmethod
    def empty(cls) -> Histogram:
        return cls(np.zeros(0), 0.0)

    def add_channels(self, amax: np.ndarray) -> None:
        amax = np.asarray(amax, np.float64)
        if self.channels is None or self.channels.shape != amax.shape:
            if self.channels is not None:
                raise ValueError(
                    f"a tensor's last axis changed between batches ({len(self.channels)} -> "
                    f"{len(amax)}); its channels cannot be calibrated"
                )
            self.channels = amax.copy()
        else:
            np.maximum(self.channels, amax, out=self.channels)

    def bins_for(self, amax: float) -> int:
        """Make room for magnitudes up to ``amax`` and return the bin count to histogram into
        (over ``[0, bins * width]``)."""
        amax = float(amax)
        if not math.isfinite(amax):
            raise ValueError(f"a tensor holds {amax}: its range cannot be calibrated")
        if amax > self.amax:
            self.amax = amax
        if self.amax == 0.0:
            return 1  # (all zeros so far: everything goes in one bin)
        if self.width == 0.0:  # the first non-zero data: zeros so far stay in bin 0
            self.width = self.amax / NUM_BINS
            self.counts = np.concatenate([self.counts[:1], np.zeros(NUM_BINS)])[:NUM_BINS]
        need = max(1, math.ceil(self.amax / self.width))
        while need > _MAX_BINS:
            self._merge_pairs()
            need = max(1, math.ceil(self.amax / self.width))
        if need > len(self.counts):
            self.counts = np.concatenate([self.counts, np.zeros(need - len(self.counts))])
        return len(self.counts)

    def add_counts(self, counts: np.ndarray) -> None:
        """Add counts made with ``bins_for``'s bin count (or a single bin of zeros)."""
        counts = np.asarray(counts, np.float64)
        if len(self.counts) == 0:
            self.counts = np.zeros(len(counts))
        self.counts[: len(counts)] += counts

    def _merge_pairs(self) -> None:
        c = self.counts
        if len(c) % 2:
            c = np.append(c, 0.0)
        self.counts = c.reshape(-1, 2).sum(axis=1)
        self.width *= 2

    @property
    def total(self) -> float:
        return float(self.counts.sum())


def add_numpy(hist: Histogram, x: np.ndarray) -> None:
    """Count the magnitudes of numpy array ``x`` into ``hist``."""
    a = np.abs(np.asarray(x, np.float32).reshape(-1))
    if a.size == 0:
        return
    bins = hist.bins_for(float(a.max()))
    if hist.width == 0.0:
        hist.add_counts(np.array([a.size], np.float64))
        return
    idx = np.minimum((a / np.float32(hist.width)).astype(np.int64), bins - 1)
    hist.add_counts(np.bincount(idx, minlength=bins))


def choose_amax(
    hist: Histogram, method: str, precision: str, percentile: float = DEFAULT_PERCENTILE
) -> float:
    """The range ``method`` picks for a tensor of histogram ``hist`` quantized to ``precision``;
    0.0 for a tensor that was always zero."""
    check_method(method, precision, percentile)
    if hist.amax == 0.0 or hist.width == 0.0:
        return 0.0
    if method == "minmax":
        return hist.amax
    if method == "percentile":
        return amax_percentile(hist, percentile)
    if method == "entropy":
        return amax_entropy(hist)
    return amax_mse(hist, precision)


def check_method(method: str, precision: str, percentile: float = DEFAULT_PERCENTILE) -> None:
    """A clear error for a calibrator, precision or percentile that cannot be used."""
    if precision not in QMAX:
        raise InputError(f"calibration is for int8 or fp8, not '{precision}'")
    if method not in CALIBRATORS:
        raise InputError(f"unknown calibrator '{method}'; choose from {', '.join(CALIBRATORS)}")
    if method == "entropy" and precision != "int8":
        raise InputError(
            "the entropy calibrator measures the divergence over INT8's 128 evenly spaced "
            f"levels, which {precision} does not have; calibrate {precision} with minmax, "
            "percentile or mse"
        )
    if not (isinstance(percentile, int | float) and 50.0 <= percentile <= 100.0):
        raise InputError(f"the calibration percentile must be in [50, 100], got {percentile!r}")


def amax_percentile(hist: Histogram, percentile: float) -> float:
    """The upper edge of the bin where the cumulative count reaches ``percentile`` %."""
    cdf = np.cumsum(hist.counts) / hist.total
    k = int(np.searchsorted(cdf, percentile / 100.0 - 1e-12))
    return min(hist.amax, (min(k, len(cdf) - 1) + 1) * hist.width)


def amax_entropy(hist: Histogram, stride: int = 1) -> float:
    """TensorRT's entropy calibration: for each candidate range of ``i`` bins (128 up to all),
    the reference distribution P is the first ``i`` bins with everything above added to the last;
    Q merges those bins into 128 levels and spreads each level's count evenly over its non-empty
    bins; the range with the least KL(P || Q) wins (ties: the widest).

    A histogram with fewer than ``_ENTROPY_MIN_MEAN_COUNT`` values a bin on average (a pooled
    tensor: a few thousand values over 2,048 bins) has neighbours merged first. Sparse, most
    candidates end on an empty bin, where Q is zero and P holds the clipped tail, so their
    divergence is infinite and the one finite candidate left wins however much it clips: a
    global-average-pooled ResNet-style tensor lost 99.9% of its values to a range of 7% of its
    largest magnitude that way (relative error 0.84 at the network's output, 0.008 with the
    largest magnitude as the range)."""
    coarse = Histogram(hist.counts.copy(), hist.width, hist.amax)  # (bins[0] is written below)
    least = _ENTROPY_MIN_MEAN_COUNT  # (merging keeps the total)
    while len(coarse.counts) > _QUANT_BINS and hist.total < least * len(coarse.counts):
        coarse._merge_pairs()
    bins, width = coarse.counts, coarse.width
    n = len(bins)
    if n <= _QUANT_BINS:
        return hist.amax
    # a spike of exact zeros (ReLU outputs) says nothing about the range (as NVIDIA's toolkit)
    bins[0] = bins[1]
    above = np.concatenate([np.cumsum(bins[::-1])[::-1][1:], [0.0]])  # count beyond bin k
    best_i, best_kl = n, math.inf
    for i in range(_QUANT_BINS, n + 1, stride):
        p = bins[:i].copy()
        p[-1] += above[i - 1]
        level = (np.arange(i) * _QUANT_BINS) // i  # which of the 128 levels each bin merges into
        nonzero = bins[:i] != 0
        sums = np.bincount(level, weights=bins[:i], minlength=_QUANT_BINS)
        filled = np.bincount(level, weights=nonzero, minlength=_QUANT_BINS)
        q = np.where(nonzero, sums[level] / np.maximum(filled[level], 1), 0.0)
        kl = _kl(p, q)
        if kl <= best_kl:
            best_i, best_kl = i, kl
    return min(hist.amax, (best_i + 0.5) * width)


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    ps, qs = p.sum(), q.sum()
    if ps <= 0 or qs <= 0:
        return math.inf
    p, q = p / ps, q / qs
    on = p > 0
    if np.any(q[on] == 0):
        return math.inf
    return float(np.sum(p[on] * np.log(p[on] / q[on])))


def amax_mse(hist: Histogram, precision: str) -> float:
    """The candidate range with the least mean squared error of quantizing the bin centres,
    weighted by their counts."""
    centres = (np.arange(len(hist.counts)) + 0.5) * hist.width
    used = hist.counts > 0
    centres, counts = centres[used], hist.counts[used]
    candidates = np.linspace(hist.amax / _MSE_CANDIDATES, hist.amax, _MSE_CANDIDATES)
    errors = np.array([_mse(centres, counts, a, precision) for a in candidates])
    return float(candidates[int(np.argmin(errors))])


def _mse(x: np.ndarray, counts: np.ndarray, amax: float, precision: str) -> float:
    q = fake_quantize(x, amax, precision)
    return float(np.sum(counts * (x - q) ** 2))


def fake_quantize(x: np.ndarray, amax: float, precision: str) -> np.ndarray:
    """``x`` quantized symmetrically over ``[-amax, amax]`` and back (round half to even for INT8,
    E4M3 rounding for FP8), saturating."""
    scale = amax / QMAX[precision]
    y = np.clip(np.asarray(x, np.float64) / scale, -QMAX[precision], QMAX[precision])
    if precision == "int8":
        return np.rint(y) * scale
    return y.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
