"""An onnx.backend that runs the *optimized* engine and checks it against the unoptimized graph.

prepare() builds an engine at optimization level 3 (all passes); run() runs both the engine and
the plain imported graph and asserts they agree within 1e-5 relative before handing the engine's
outputs to ONNX's runner, which compares them with the suite's expected data.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.runtime import Runner

RTOL = 1e-5


class OptimizedRep(BackendRep):
    def __init__(self, model: onnx.ModelProto, backend: str = "reference") -> None:
        self.plain = Runner(model)
        if backend == "reference":
            engine = Builder("reference").build(
                model, BuilderConfig(optimization_level=3), progress=False
            )
        else:  # the cuda backend's default kernels (on the CPU without a GPU), nothing timed
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            config = BuilderConfig(optimization_level=3, tactic_sources=set())
            engine = Builder("cuda", device=device).build(model, config, progress=False)
        self.context = engine.create_execution_context()
        self.names = self.plain.output_names

    def run(self, inputs: Any, **kwargs: Any) -> tuple:
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        feeds = dict(zip(self.plain.input_names, inputs))
        expected = self.plain.infer(feeds)
        got = self.context.infer(feeds)
        for name in self.names:
            _assert_close(name, got[name], expected[name])
        return tuple(got[name] for name in self.names)


def _assert_close(name: str, got: Any, expected: Any) -> None:
    if isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), name
        for g, e in zip(got, expected):
            _assert_close(name, g, e)
        return
    if expected is None or not isinstance(expected, np.ndarray):
        assert got is None if expected is None else True, name
        return
    got = np.asarray(got)
    assert got.shape == expected.shape and got.dtype == expected.dtype, (
        f"{name}: optimized {got.dtype}{list(got.shape)} vs {expected.dtype}{list(expected.shape)}"
    )
    if expected.dtype.kind == "f" and expected.dtype.itemsize >= 4:
        scale = float(np.nanmax(np.abs(expected))) if expected.size else 0.0
        np.testing.assert_allclose(
            got,
            expected,
            rtol=RTOL,
            atol=RTOL * scale,
            equal_nan=True,
            err_msg=f"{name}: the optimized graph differs from the unoptimized one",
        )


class OptimizedBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> OptimizedRep:
        super().prepare(model, device, **kwargs)
        return OptimizedRep(model)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"


prepare = OptimizedBackend.prepare
run_node = OptimizedBackend.run_node
supports_device = OptimizedBackend.supports_device
