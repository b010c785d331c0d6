"""tensorkiln as an ``onnx.backend`` (the interface ONNX's backend test suite drives).

import tensorkiln.onnx_backend as backend
rep = backend.prepare(model)          # an onnx.ModelProto
outputs = rep.run([x])                # positional inputs, as ONNX's runner passes them
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from tensorkiln.runtime import Runner


class TensorkilnRep(BackendRep):
    """A prepared model: runs positional inputs and returns outputs in graph order."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def run(self, inputs: Any, **kwargs: Any) -> tuple:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feeds = dict(zip(self.runner.input_names, inputs))
        outputs = self.runner.infer(feeds)
        return tuple(outputs[name] for name in self.runner.output_names)


class TensorkilnBackend(Backend):
    """The reference (numpy) backend; 'CPU' is the only device it runs on."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> TensorkilnRep:
        super().prepare(model, device, **kwargs)
        return TensorkilnRep(Runner(model, backend="reference"))

    @classmethod
    def run_model(
        cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any
    ) -> tuple:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"


prepare = TensorkilnBackend.prepare
run_model = TensorkilnBackend.run_model
run_node = TensorkilnBackend.run_node
supports_device = TensorkilnBackend.supports_device
