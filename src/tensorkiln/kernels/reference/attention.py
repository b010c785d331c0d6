"""Attention on numpy arrays: Attention (one kernel for opsets 23-25), RotaryEmbedding,
LinearAttention and FlexAttention, as kernels/common/attention.py writes them once, over the numpy
operations below. Arithmetic runs in float32 (float64 for float64 inputs); float16/bfloat16 inputs
are not rounded at every intermediate step, so the oracle stays accurate for long sequences (the
ONNX reference, running numpy's bfloat16 matmul, accumulates in bfloat16)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from tensorkiln.kernels.common.attention import AttentionOps
from tensorkiln.kernels.registry import register


class NumpyAttentionArrays:
    """:class:`tensorkiln.kernels.common.attention.AttentionArrays` on numpy arrays."""

    m = np

    def compute_dtype(self, x: np.ndarray) -> np.dtype:
        return np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)

    def astype(self, x: Any, dtype: Any) -> np.ndarray:
        return np.asarray(x).astype(dtype)

    def swap(self, x: np.ndarray, a: int, b: int) -> np.ndarray:
        return np.swapaxes(x, a, b)

    def amax(self, x: np.ndarray) -> np.ndarray:
        return np.max(x, axis=-1, keepdims=True)

    def sum(self, x: np.ndarray) -> np.ndarray:
        return np.sum(x, axis=-1, keepdims=True)

    def cat(self, arrays: list[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(arrays, axis=axis)

    def stack(self, arrays: list[np.ndarray], axis: int) -> np.ndarray:
        return np.stack(arrays, axis=axis)

    def broadcast_to(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return np.broadcast_to(x, shape)

    def zeros(self, shape: tuple[int, ...], dtype: Any, like: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    def arange(self, n: int, like: Any) -> np.ndarray:
        return np.arange(n, dtype=np.int64)

    def pad_last(self, x: np.ndarray, count: int, value: float) -> np.ndarray:
        return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, count)], constant_values=value)

    def is_bool(self, x: np.ndarray) -> bool:
        return x.dtype == np.bool_

    def rows(self, table: np.ndarray, index: np.ndarray) -> np.ndarray:
        return table[index]

    def key_lengths(self, nonpad: Any, batch: int, kv_len: int) -> np.ndarray:
        lengths = np.asarray(nonpad).astype(np.int64).reshape(-1)
        if lengths.shape[0] != batch or np.any(lengths < 0) or np.any(lengths > kv_len):
            raise ValueError(
                f"nonpad_kv_seqlen must have {batch} entries in [0, {kv_len}], got {lengths}"
            )
        return lengths

    def fused(self, *args: Any) -> None:
        return None  # the oracle computes every step explicitly


OPS = AttentionOps(NumpyAttentionArrays())
register("Attention", since=23)(OPS.attention)
register("RotaryEmbedding", since=23)(OPS.rotary_embedding)
register("LinearAttention", since=27)(OPS.linear_attention)
register("FlexAttention", domain="ai.onnx.preview", since=1)(OPS.flex_attention)
