"""Recurrent layers on numpy arrays: RNN, GRU, LSTM, as kernels/common/rnn.py writes them once,
over the numpy operations below (arithmetic in float32, float64 for float64 inputs)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorkiln.kernels.common.rnn import Recurrent
from tensorkiln.kernels.registry import register


class NumpyRnnArrays:
    """:class:`tensorkiln.kernels.common.rnn.RnnArrays` on numpy arrays."""

    m = np
    float32 = np.dtype(np.float32)
    clip = staticmethod(np.clip)

    def astype(self, x: np.ndarray, dtype: Any) -> np.ndarray:
        return np.asarray(x).astype(dtype)

    def compute_dtype(self, x: np.ndarray) -> np.dtype:
        return np.dtype(np.float64) if x.dtype == np.float64 else self.float32

    def zeros(self, shape: tuple[int, ...], dtype: Any, like: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    def addmm(self, c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return c + a @ b

    def swap01(self, x: np.ndarray) -> np.ndarray:
        return np.swapaxes(x, 0, 1)

    def stack(self, arrays: list[np.ndarray], axis: int) -> np.ndarray:
        return np.stack(arrays, axis=axis)

    def permute(self, x: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
        return x.transpose(perm)

    def lengths(self, sequence_lens: Any, batch: int, seq_len: int) -> np.ndarray | None:
        lengths = np.asarray(sequence_lens).astype(np.int64).reshape(batch)
        if np.any(lengths < 0) or np.any(lengths > seq_len):
            raise ValueError(f"sequence_lens {lengths.tolist()} out of range [0, {seq_len}]")
        return None if np.all(lengths == seq_len) else lengths

    def dtype_name(self, x: np.ndarray) -> str:
        return np.dtype(x.dtype).name

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-x))

    def logaddexp0(self, x: np.ndarray) -> np.ndarray:
        return np.logaddexp(x, 0)


LAYERS = Recurrent(NumpyRnnArrays())
register("RNN", since=1)(LAYERS.rnn)
register("GRU", since=1)(LAYERS.gru)
register("LSTM", since=1)(LAYERS.lstm)
