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

import numpy as np

from tensorkiln.ir import Node

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
