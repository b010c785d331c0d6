"""An onnx.backend that runs models on the cuda backend's kernels.

On a machine with CUDA the kernels run on the GPU; without one they run on torch CPU tensors,
which checks the same torch code (the Triton kernels go through Triton's interpreter). A model
with an op the cuda backend has no kernel for is skipped, naming the op; the list of such ops is
kept honest by tests/kernels/cuda/test_coverage.py.
"""

from __future__ import annotations

import unittest
from typing import Any

import numpy as np
import onnx
import torch
from onnx.backend.base import Backend, BackendRep

from tensorkiln.errors import UnsupportedOpError
from tensorkiln.runtime import Runner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class CudaRep(BackendRep):
    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def run(self, inputs: Any, **kwargs: Any) -> tuple:
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        feeds = dict(zip(self.runner.input_names, inputs))
        outputs = self.runner.infer(feeds)
        return tuple(outputs[name] for name in self.runner.output_names)


class CudaBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> CudaRep:
        super().prepare(model, device, **kwargs)
        try:
            return CudaRep(Runner(model, backend="cuda", device=DEVICE))
        except UnsupportedOpError as exc:
            raise unittest.SkipTest(f"no cuda kernel: {exc}") from None

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"


prepare = CudaBackend.prepare
run_node = CudaBackend.run_node
supports_device = CudaBackend.supports_device
