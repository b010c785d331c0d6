"""Padding removal's ops in numpy (kernels/common/packing.py defines them): the oracle."""

from __future__ import annotations

import numpy as np

from tensorkiln.kernels.common import bind
from tensorkiln.kernels.common import packing as common
from tensorkiln.kernels.reference.fused_attention import _attend
from tensorkiln.kernels.registry import register

DOMAIN = "tensorkiln"


@register("PackIndex", domain=DOMAIN, since=1)
def pack_index(m: np.ndarray, *, padding: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The kept tokens' flat indices (int64 [T]) and each sequence's end row (int32 [B])."""
    common.check_mask(m)
    keep = (np.asarray(m) != 0) != bool(padding)
    index = np.flatnonzero(keep).astype(np.int64)
    ends = np.cumsum(keep.sum(axis=1)).astype(np.int32)
    return index, ends


@register("PackTokens", domain=DOMAIN, since=1)
def pack_tokens(x: np.ndarray, index: np.ndarray) -> np.ndarray:
    """X [B, S, ...]'s rows at the flat token indices, [T, ...]."""
    return x.reshape(common.token_rows(x), *x.shape[2:])[index]


@register("UnpackTokens", domain=DOMAIN, since=1)
def unpack_tokens(y: np.ndarray, index: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Y [T, ...] back at its tokens of [B, S, ...], zeros at the dropped ones."""
    b, s = common.check_mask(m)
    common.check_packed(y, index, "UnpackTokens")
    out = np.zeros((b * s, *y.shape[1:]), dtype=y.dtype)
    out[index] = y
    return out.reshape(b, s, *y.shape[1:])


class NumpyPacked:
    """The packed attention's math on numpy arrays: each sequence's rows attended alone."""

    @staticmethod
    def attend_packed(q, k, v, ends, b, s, scale, heads, widths, causal=0) -> np.ndarray:
        d, dv = widths
        out = np.zeros((q.shape[0], heads * dv), dtype=q.dtype)
        start = 0
        for end in np.asarray(ends, dtype=np.int64).tolist():
            if end > start:
                qs, ks, vs = (
                    x[start:end].reshape(end - start, heads, w).swapaxes(0, 1)[None]
                    for x, w in ((q, d), (k, d), (v, dv))
                )
                o = _attend(qs, ks, vs, None, scale, causal, "")
                out[start:end] = o[0].swapaxes(0, 1).reshape(end - start, heads * dv)
            start = end
        return out


packed_attention = bind(common.packed_attention, NumpyPacked(), __name__)
register("PackedAttention", domain=DOMAIN, since=1)(packed_attention)
