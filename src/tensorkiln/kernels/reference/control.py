"""Control flow on numpy arrays: If, Loop, Scan and SequenceMap, as kernels/common/control.py
writes them once, over the numpy operations below."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorkiln.kernels.common.control import ControlFlow
from tensorkiln.kernels.registry import register


class NumpyArrays:
    """:class:`tensorkiln.kernels.common.control.Arrays` on numpy arrays."""

    def items(self, x: Any) -> list:
        return np.asarray(x).reshape(-1).tolist()

    def index(self, value: int | bool, like: tuple) -> np.ndarray:
        return np.asarray(value) if isinstance(value, bool) else np.asarray(value, dtype=np.int64)

    def stack(self, frames: list[np.ndarray]) -> np.ndarray:
        return np.stack(frames)

    def moveaxis(self, x: np.ndarray, source: int, destination: int) -> np.ndarray:
        return np.moveaxis(x, source, destination)

    def flip0(self, x: np.ndarray) -> np.ndarray:
        return x[::-1]

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: tuple) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape: tuple[int, ...], like: np.ndarray) -> np.ndarray:
        return np.zeros(shape, dtype=np.asarray(like).dtype)


_FLOW = ControlFlow(NumpyArrays())
register("If", since=1)(_FLOW.if_)
register("Loop", since=1)(_FLOW.loop)
register("Scan", since=1)(_FLOW.scan)
register("SequenceMap", since=1)(_FLOW.sequence_map)
