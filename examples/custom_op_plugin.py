"""A custom op in Python: register it, build a model that uses it, save and load its engine.

    python examples/custom_op_plugin.py

The op, ``example_ops::SoftClip``, squashes values smoothly into (-bound, bound):
y = bound * tanh(x / bound). An ONNX node of that domain and op imports into the plugin; a
PyTorch module calling a torch.library op of the same name does too (tensorkiln.torch).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

import tensorkiln
from tensorkiln.builder import Builder
from tensorkiln.engine import Engine


@tensorkiln.plugin("example_ops::SoftClip", version="1", attributes={"bound": 3.0})
def soft_clip(x: tensorkiln.TensorDesc, *, bound: float) -> tensorkiln.TensorDesc:
    """The shape rule: the output is like the input."""
    return x


@soft_clip.reference
def _(x: np.ndarray, *, bound: float) -> np.ndarray:
    b = np.asarray(bound, dtype=x.dtype)
    return b * np.tanh(x / b)


try:  # the GPU (and fast CPU) implementation, where PyTorch is installed
    import torch

    @soft_clip.torch
    def _(x: torch.Tensor, *, bound: float) -> torch.Tensor:
        return torch.tanh(x / bound) * bound

except ImportError:
    pass


def model() -> bytes:
    """y = SoftClip(x @ w) + x, with a batch axis of any size."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], rng.standard_normal(64).tolist())
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("SoftClip", ["h"], ["c"], domain="example_ops", bound=2.0),
        helper.make_node("Add", ["c", "x"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "soft_clip_example",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        initializer=[w],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("example_ops", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def main() -> int:
    data = model()
    engine = Builder().build(data, progress=False)
    x = np.random.default_rng().standard_normal((4, 8)).astype(np.float32)
    y = engine.create_execution_context().infer({"x": x})["y"]
    y = y.cpu().numpy() if hasattr(y, "cpu") else np.asarray(y)
    w = np.asarray(np.random.default_rng(0).standard_normal(64), np.float32).reshape(8, 8)
    want = 2.0 * np.tanh((x @ w) / 2.0) + x
    err = float(np.abs(y - want).max())
    print(f"backend: {engine.backend}, layers: {[n.op for n in engine.graph.nodes]}")
    print(f"max abs difference from numpy: {err:.2e}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "soft_clip.engine"
        engine.save(path)
        again = Engine.load(path)  # needs the plugin registered: this script registered it
        y2 = again.create_execution_context().infer({"x": x})["y"]
        y2 = y2.cpu().numpy() if hasattr(y2, "cpu") else np.asarray(y2)
        print(f"saved and loaded: same outputs: {bool(np.array_equal(y, y2))}")
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
