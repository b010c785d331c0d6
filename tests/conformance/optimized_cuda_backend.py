"""The optimized-engine backend on the cuda backend's default kernels (see optimized_backend)."""

from __future__ import annotations

from typing import Any

import onnx
from onnx.backend.base import Backend

from tests.conformance.optimized_backend import OptimizedRep


class OptimizedCudaBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> OptimizedRep:
        super().prepare(model, device, **kwargs)
        return OptimizedRep(model, backend="cuda")

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"


prepare = OptimizedCudaBackend.prepare
run_node = OptimizedCudaBackend.run_node
supports_device = OptimizedCudaBackend.supports_device
