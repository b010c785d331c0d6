"""Control flow on the device: If, Loop, Scan and SequenceMap, as kernels/common/control.py
writes them once, over the torch operations below.

The subgraphs run through the executor on the same backend, so their values stay torch tensors on
the device and scan outputs are stacked there. Deciding which branch to take or whether to run
another iteration needs If's condition, Loop's trip count and condition and Scan-8's sequence
lengths on the host: single scalars (or one int per batch entry), read through their host copy
when the executor knows one (no device sync for a small constant).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tensorkiln.kernels.common.control import ControlFlow
from tensorkiln.kernels.cuda.convert import current_device, host_list, torch_dtype
from tensorkiln.kernels.registry import register


def _flat(v: object) -> list:
    if not isinstance(v, list):
        return [v]
    return [x for item in v for x in _flat(item)]


def _device_of(values: tuple) -> torch.device:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return current_device()


class TorchArrays:
    """:class:`tensorkiln.kernels.common.control.Arrays` on torch tensors."""

    def items(self, x: Any) -> list:
        return _flat(host_list(x))  # a host read: the control decision is made there

    def index(self, value: int | bool, like: tuple) -> torch.Tensor:
        dtype = torch.bool if isinstance(value, bool) else torch.int64
        return torch.tensor(value, dtype=dtype, device=_device_of(like))

    def stack(self, frames: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(frames)

    def moveaxis(self, x: torch.Tensor, source: int, destination: int) -> torch.Tensor:
        return torch.movedim(x, source, destination)

    def flip0(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(0)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: tuple) -> torch.Tensor:
        return torch.empty(shape, dtype=torch_dtype(dtype), device=_device_of(like))

    def zeros(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(shape)


_FLOW = ControlFlow(TorchArrays())
register("If", since=1, backend="cuda")(_FLOW.if_)
register("Loop", since=1, backend="cuda")(_FLOW.loop)
register("Scan", since=1, backend="cuda")(_FLOW.scan)
register("SequenceMap", since=1, backend="cuda")(_FLOW.sequence_map)
