"""What the cpu and cuda backends share: torch tensors, uploaded from and copied back to numpy
(kernels/cuda/convert.py), with small shape values mirrored on the host where asked."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from tensorkiln.backends.base import Backend
from tensorkiln.kernels.cuda.convert import (
    HOST_VALUES_LIMIT,
    host_values,
    mark_constant,
    numpy_dtype,
    remember_host_values,
    to_numpy,
    to_torch,
    torch_dtype,
    use_device,
)

__all__ = ["TorchBackend", "to_torch"]


class TorchBackend(Backend):
    """Values are torch tensors on ``device``."""

    on_device = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def to_device(self, value: Any, *, channels_last: bool = False, held: bool = False) -> Any:
        return to_torch(value, self.device)

    def to_host(self, value: Any) -> Any:
        return to_numpy(value)

    def constant(self, array: np.ndarray, *, conv_weight: bool = False) -> Any:
        c = to_torch(array, self.device)
        remember_host_values(c, array)
        return mark_constant(c)

    def device_dtype(self, dtype: Any) -> Any:
        return torch_dtype(dtype)

    def host_dtype(self, dtype: Any) -> np.dtype:
        return numpy_dtype(dtype)

    def mirrorable(self, value: Any) -> bool:
        return (
            hasattr(value, "numel")
            and value.numel() <= HOST_VALUES_LIMIT
            and host_values(value) is None
        )

    def known_on_host(self, value: Any) -> np.ndarray | None:
        return host_values(value)

    def remember_on_host(self, value: Any, array: np.ndarray) -> None:
        remember_host_values(value, array)

    def unchanging(self, value: Any) -> None:
        mark_constant(value)

    def scope(self) -> AbstractContextManager[Any]:
        return use_device(self.device)

    def inference(self) -> AbstractContextManager[Any]:
        return torch.no_grad()
