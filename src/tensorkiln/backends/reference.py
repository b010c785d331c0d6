"""The reference backend: numpy kernels on the host, the oracle for tests."""

from __future__ import annotations

import platform
from typing import Any

import numpy as np

from tensorkiln.backends.base import Backend


class ReferenceBackend(Backend):
    """numpy arrays on the host; nothing to move, hold or synchronize."""

    name = "reference"

    def to_device(self, value: Any, *, channels_last: bool = False, held: bool = False) -> Any:
        return value

    def to_host(self, value: Any) -> Any:
        return value

    def constant(self, array: np.ndarray, *, conv_weight: bool = False) -> Any:
        return array

    def target(self) -> dict[str, Any]:
        return {"device": "cpu", "machine": platform.machine(), "numpy": np.__version__}
