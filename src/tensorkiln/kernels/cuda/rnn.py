"""Recurrent layers on the device: RNN, GRU, LSTM, as kernels/common/rnn.py writes them once,
over the torch operations below: a step's recurrence GEMM and bias add are one ``addmm``, and
``sequence_lens`` stays on the device as a mask (no value is read back to the host)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tensorkiln.kernels.common.rnn import Recurrent
from tensorkiln.kernels.cuda.convert import numpy_dtype
from tensorkiln.kernels.registry import register


class TorchRnnArrays:
    """:class:`tensorkiln.kernels.common.rnn.RnnArrays` on torch tensors."""

    m = torch
    float32 = torch.float32
    addmm = staticmethod(torch.addmm)
    sigmoid = staticmethod(torch.sigmoid)

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def astype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, like: Any) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=like.device)

    def swap01(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)

    def stack(self, arrays: list[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.stack(arrays, dim=axis)

    def permute(self, x: torch.Tensor, perm: tuple[int, ...]) -> torch.Tensor:
        return x.permute(*perm)

    def clip(self, x: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor:
        return torch.clamp(x, lo, hi)

    def lengths(self, sequence_lens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
        return sequence_lens.reshape(batch).to(torch.int64)

    def dtype_name(self, x: torch.Tensor) -> str:
        try:
            return np.dtype(numpy_dtype(x.dtype)).name
        except KeyError:
            return str(x.dtype)

    def logaddexp0(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logaddexp(x, torch.zeros_like(x))


LAYERS = Recurrent(TorchRnnArrays())
register("RNN", since=1, backend="cuda")(LAYERS.rnn)
register("GRU", since=1, backend="cuda")(LAYERS.gru)
register("LSTM", since=1, backend="cuda")(LAYERS.lstm)
