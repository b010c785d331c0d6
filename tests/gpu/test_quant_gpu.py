"""INT8 and FP8 engines on a real GPU, autotuned there: the same quantized layers as the
reference build from one calibration cache, the tensor-core tactics timed and checked against the
exact kernel, outputs within float32 rounding of the reference backend's (fp32 epilogue) and of
the fp16 engine's tolerance with fp16 allowed.

Run on a GPU machine:  PYTHONPATH=src python3 -m pytest -q -m gpu tests
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from tensorkiln.builder import Builder, BuilderConfig  # noqa: E402

pytestmark = pytest.mark.gpu


def _net(rng: np.random.Generator) -> onnx.ModelProto:
    """3x3 conv (64 -> 64, ReLU), a 1x1 conv with a residual, a global pool and a GEMM: shapes
    the tensor-core tactics take (channels multiples of 16)."""
    inits = {
        "w1": rng.standard_normal((64, 64, 3, 3)) * 0.05, "b1": rng.standard_normal(64) * 0.1,
        "w2": rng.standard_normal((64, 64, 1, 1)) * 0.1, "b2": rng.standard_normal(64) * 0.1,
        "w3": rng.standard_normal((128, 64)) * 0.1, "b3": rng.standard_normal(128) * 0.1,
    }  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], "conv2"),
        helper.make_node("Add", ["c2", "x"], ["s"], "residual"),
        helper.make_node("Relu", ["s"], ["r2"], "relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], "pool"),
        helper.make_node("Flatten", ["p"], ["f"], "flatten"),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], "fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 64, 14, 14])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a.astype(np.float32), k) for k, a in inits.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_engine_on_the_gpu(tmp_path: Path, precision: str) -> None:
    rng = np.random.default_rng()
    path = tmp_path / "net.onnx"
    onnx.save(_net(rng), path)
    cache = tmp_path / "calib.json"
    calib = [{"x": rng.standard_normal((32, 64, 14, 14)).astype(np.float32)} for _ in range(2)]
    ref_config = BuilderConfig()
    ref_config.set_flag(precision)
    ref_config.calibration_data, ref_config.calibration_cache = calib, str(cache)
    ref = Builder("reference").build(path, ref_config)
    config = BuilderConfig()
    config.set_flag(precision)
    config.calibration_cache = str(cache)
    engine = Builder("cuda").build(path, config)
    chosen = {x["name"]: x.get("tactic", "default") for x in engine.layers}
    quantized = [n.name for n in engine.graph.nodes if n.op in ("QConvAct", "QGemmAct")]
    assert len(quantized) == 3, [n.op for n in engine.graph.nodes]
    print({k: chosen[k] for k in quantized})  # (the tactics the autotuner kept)
    x = rng.standard_normal((32, 64, 14, 14)).astype(np.float32)
    want = ref.create_execution_context().infer({"x": x})["y"]
    got = np.asarray(engine.create_execution_context().infer({"x": x})["y"])
    # (a tactic may run a quantized layer's dequantized product in fp16, cuDNN's: its output
    # rounded to fp16, about 1e-3 of the reference's float32 arithmetic; Hopper's E4M3 tensor
    # cores add partial sums with fewer bits than float32, and an E4M3 code one step off the
    # reference's is 6% of its value: 4e-3 measured over the three layers)
    tol = 4e-3 if precision == "int8" else 1.5e-2
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
    config.set_flag("fp16")
    mixed = Builder("cuda").build(path, config)
    half = np.asarray(mixed.create_execution_context().infer({"x": x})["y"], np.float32)
    assert np.linalg.norm(half - want) / np.linalg.norm(want) < 5e-2
