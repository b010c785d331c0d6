"""tensorkiln.Attention: softmax(Q K^T * scale + mask) V as one op, made by passes/fuse_attention.

Inputs ``Q, K, V, mask?``. K is *not* pre-transposed. Attributes:

* ``scale`` (float; 0 means 1/sqrt(head size)): multiplies Q K^T.
* ``causal`` (int): key j is hidden from query i when j > i (top-left aligned, as torch's is_causal).
* ``mask_kind``: ``""`` (no mask), ``"additive"`` (added to the scaled scores, broadcast to
  [B, H, Sq, Sk]) or ``"bool"`` (True keeps a key, False hides it).
* ``num_heads`` and ``input_layout``: ``"bhsd"`` takes Q [B, H, Sq, D], K [B, H, Sk, D],
  V [B, H, Sk, Dv]; ``"bsd"`` takes them with the heads packed, [B, S, H*D], split into
  ``num_heads`` heads inside the op.
* ``output_layout``: ``"bhsd"`` gives [B, H, Sq, Dv], ``"bshd"`` [B, Sq, H, Dv] and ``"bsd"``
  [B, Sq, H*Dv] (the heads merged back, ready for the output projection).

Arithmetic runs in float32 (float64 for float64 inputs) with a max-subtracted softmax. A query
row whose keys are all hidden gives zeros, not NaN: that is what the exporters' IsNaN -> Where
guard after the softmax computes, and what fused attention kernels do.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.kernels.common.fused import FusedAttention
from tensorkiln.kernels.reference.quant import quantize_linear
from tensorkiln.kernels.registry import register


def _stable_softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place on ``x``; a row that is all -inf gives zeros."""
    m = np.max(x, axis=-1, keepdims=True)
    m[np.isneginf(m)] = 0
    np.subtract(x, m, out=x)
    np.exp(x, out=x)
    total = np.sum(x, axis=-1, keepdims=True)
    total[total == 0] = 1
    return np.divide(x, total, out=x)


def _attend(q, k, v, mask, scale: float, causal: int, mask_kind: str) -> np.ndarray:
    """softmax(Q K^T * scale + mask) V on [B, H, S, D] arrays, in float32 (float64 for
    float64)."""
    ct = np.float64 if q.dtype == np.float64 else np.float32
    s = np.float64(scale) if scale else 1.0 / np.sqrt(q.shape[-1])
    scores = np.matmul(q.astype(ct), k.astype(ct).swapaxes(-1, -2))
    scores *= ct(s)
    if mask_kind == "additive":
        scores = np.add(scores, mask.astype(ct), dtype=ct)
    elif mask_kind == "bool":
        scores = np.where(mask.astype(bool), scores, ct(-np.inf))
    if causal:
        sq, sk = scores.shape[-2:]
        scores = np.where(np.tri(sq, sk, dtype=bool), scores, ct(-np.inf))
    return np.matmul(_stable_softmax(scores), v.astype(ct)).astype(q.dtype)


class NumpyAttentionArrays:
    """:class:`tensorkiln.kernels.common.fused.AttentionArrays` on numpy arrays."""

    attend = staticmethod(_attend)

    def swap12(self, x: np.ndarray) -> np.ndarray:
        return x.swapaxes(1, 2)

    def quantize(self, y: np.ndarray, scale: np.ndarray, q_dtype: int) -> np.ndarray:
        return quantize_linear(y, np.asarray(scale), output_dtype=q_dtype)

    def attend_quantized(self, *args):
        return None  # (attend, then quantize)


fused_attention = FusedAttention(NumpyAttentionArrays()).fused_attention
register("Attention", domain="tensorkiln", since=1)(fused_attention)
