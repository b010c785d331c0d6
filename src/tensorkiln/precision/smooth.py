"""SmoothQuant for INT8 GEMMs: move the range of an activation's outlier channels into the weight.

Transformer activations have a few channels (hidden features) far larger than the rest; one
per-tensor INT8 scale then spends its levels on them and rounds the others away. With a factor
``s_j`` per input channel, ``X W = (X / s) (s W)``: the activation is divided by ``s`` before it is
quantized (a Mul that a fused quantize absorbs) and the weight, quantized per output channel
anyway, is multiplied by it. ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (Xiao et al., 2023,
alpha = 0.5 by default) balances the two ranges; the activation's per-tensor range is then
``max_j max|X_j| / s_j``, from the per-channel maxima calibration recorded.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tensorkiln.ir import Node
from tensorkiln.precision.calibrators import fake_quantize

DEFAULT_ALPHA = 0.5
_LIMIT = 1e4  # factors are clamped to [1/_LIMIT, _LIMIT]


def smoothable(node: Node, w: np.ndarray) -> bool:
    """A GEMM whose data input's last axis is the reduced one (no transposed A) and whose
    weight is 2-D."""
    if node.attrs.get("transA", 0) or w.ndim != 2:
        return False
    return (node.domain, node.op) in (("", "Gemm"), ("tensorkiln", "GemmAct"), ("", "MatMul"))


def factors(x_amax: np.ndarray, w: np.ndarray, k_axis: int, alpha: float) -> np.ndarray:
    """``s`` per input channel (float64, shape (K,)); 1 where a channel is all zeros."""
    wmax = np.abs(w.astype(np.float64)).max(axis=1 - k_axis)
    xmax = np.asarray(x_amax, np.float64)
    if xmax.shape != wmax.shape:
        raise ValueError(f"{len(xmax)} activation channels for a weight of {len(wmax)} inputs")
    with np.errstate(divide="ignore", invalid="ignore"):
        s = xmax**alpha / wmax ** (1.0 - alpha)
    s = np.where((xmax > 0) & (wmax > 0) & np.isfinite(s), s, 1.0)
    return np.clip(s, 1.0 / _LIMIT, _LIMIT)


def smoothed_amax(x_amax: np.ndarray, s: np.ndarray) -> float:
    """The per-tensor range of X / s."""
    return float(np.max(np.asarray(x_amax, np.float64) / s, initial=0.0))


ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)  # what ``auto`` tries per GEMM, besides no smoothing
SAMPLE_ROWS = 1024  # rows of the input a GEMM's choice is measured on


def choose_alpha(
    x: np.ndarray,
    w: np.ndarray,
    k_axis: int,
    channel_amax: np.ndarray,
    plain_amax: float,
    qmax: float,
    rounding: str,
) -> float | None:
    """The alpha whose smoothing gives the GEMM output ``x @ w`` closest to float on the sample
    ``x`` (rows, K), or None where plain per-tensor quantization at ``plain_amax`` is closest.
    ``rounding``: 'int8' (round half to even) or 'fp8' (E4M3)."""
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])[:SAMPLE_ROWS]
    wk = np.asarray(w, np.float64)
    wk = wk if k_axis == 0 else wk.T  # (K, N)
    want = x @ wk
    ref = max(float(np.linalg.norm(want)), 1e-30)

    def error(s: np.ndarray | None) -> float:
        if s is None:
            xq, wq = fake_quantize(x, plain_amax, rounding), _columns(wk, qmax, rounding)
        else:
            xq = fake_quantize(x / s, smoothed_amax(channel_amax, s), rounding)
            wq = _columns(wk * s[:, None], qmax, rounding)
        return float(np.linalg.norm(xq @ wq - want)) / ref

    best, best_err = None, error(None) if plain_amax > 0 else np.inf
    for alpha in ALPHAS:
        e = error(factors(channel_amax, w, k_axis, alpha))
        if e < best_err:
            best, best_err = alpha, e
    return best


def _columns(w: np.ndarray, qmax: float, rounding: str) -> np.ndarray:
    """``w`` (K, N) fake-quantized with one scale per column (output channel)."""
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / qmax, 1.0)
    y = np.clip(w / scale, -qmax, qmax)
    if rounding == "int8":
        return np.rint(y) * scale
    return y.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
