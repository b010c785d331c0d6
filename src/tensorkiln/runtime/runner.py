"""Run an IR graph (or an ONNX model) on a backend, with inputs and outputs by name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorkiln.backends import Backend, get_backend
from tensorkiln.frontends.onnx import import_onnx
from tensorkiln.ir import Graph
from tensorkiln.runtime.executor import Executor
from tensorkiln.runtime.io import bind_inputs
from tensorkiln.runtime.mathmode import math_mode


class Runner:
    """Runs one model; usable as a context manager, like Polygraphy's runners.

    with Runner("model.onnx") as runner:
        outputs = runner.infer({"input": x})
    """

    def __init__(
        self,
        model: Graph | str | os.PathLike | bytes | Any,
        *,
        backend: Backend | str = "reference",
        device: Any = None,
    ) -> None:
        self.backend = get_backend(backend, device)
        if not isinstance(model, Graph):
            model = import_onnx(model, backend=self.backend.name)
        self.graph = model
        self._executor = Executor(model, self.backend)

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.graph.inputs]

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.graph.outputs]

    def infer(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run the model on ``feeds`` (input name -> array); returns output name -> array."""
        bound = bind_inputs(self.graph, feeds)
        backend = self.backend
        if not backend.math_modes:
            results = [backend.to_host(r) for r in self._executor.run(bound)]
        else:
            with math_mode("fp32"):  # TF32 off: cuDNN would use it for float32 convolutions
                results = [backend.to_host(r) for r in self._executor.run(bound)]
        return dict(zip(self.output_names, results))

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def run_onnx(
    model: Graph | str | os.PathLike | bytes | Any,
    feeds: Mapping[str, Any],
    *,
    backend: str = "reference",
) -> dict[str, np.ndarray]:
    """Import ``model`` (a path, bytes, ModelProto or IR graph), run it once on ``feeds``."""
    return Runner(model, backend=backend).infer(feeds)
