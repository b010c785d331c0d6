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


def _reference_and_gpu(tmp_path: Path, model: onnx.ModelProto, shape: tuple[int, ...],
                       precision: str, quantize_all: bool = False) -> tuple:  # fmt: skip
    """``model`` (input x of ``shape``) calibrated and built on the reference backend (two random
    batches, written to a calibration cache), then built and autotuned on the GPU from that
    cache: (its path, the reference engine, the GPU engine, the GPU build's config)."""
    rng = np.random.default_rng()
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    cache = tmp_path / "calib.json"
    calib = [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(2)]
    configs = []
    for data in (calib, None):
        config = BuilderConfig()
        config.set_flag(precision)
        config.calibration_data, config.calibration_cache = data, str(cache)
        if quantize_all:
            config.choose_precision_per_layer = False
        configs.append(config)
    ref = Builder("reference").build(path, configs[0])
    return path, ref, Builder("cuda").build(path, configs[1]), configs[1]


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_engine_on_the_gpu(tmp_path: Path, precision: str) -> None:
    rng = np.random.default_rng()
    path, ref, engine, config = _reference_and_gpu(tmp_path, _net(rng), (32, 64, 14, 14),
                                                   precision)  # fmt: skip
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


def _stage(rng: np.random.Generator) -> onnx.ModelProto:
    """A ResNet's stem and the first block of a stage, at channel counts the tensor-core tactics
    take: conv (3 -> 64, ReLU), a 3x3 max pool of stride 2, then 1x1 (ReLU), 3x3 of stride 2
    (ReLU), 1x1 to 256 channels, plus a 1x1 shortcut of stride 2, ReLU; pool and a Gemm."""

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))

    inits = {
        "w0": w(64, 3, 3, 3), "w1": w(64, 64, 1, 1), "w2": w(64, 64, 3, 3),
        "w3": w(256, 64, 1, 1), "ws": w(256, 64, 1, 1), "wf": w(10, 256),
        **{f"b{k}": rng.standard_normal(n) * 0.1
           for k, n in (("0", 64), ("1", 64), ("2", 64), ("3", 256), ("s", 256), ("f", 10))},
    }  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], "stem", pads=[1] * 4),
        helper.make_node("Relu", ["c0"], ["r0"], "stem_relu"),
        helper.make_node(
            "MaxPool", ["r0"], ["m"], "pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4
        ),
        helper.make_node("Conv", ["m", "w1", "b1"], ["c1"], "conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], "conv2", pads=[1] * 4, strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"], "relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], "conv3"),
        helper.make_node("Conv", ["m", "ws", "bs"], ["cs"], "shortcut", strides=[2, 2]),
        helper.make_node("Add", ["c3", "cs"], ["s"], "add"),
        helper.make_node("Relu", ["s"], ["r3"], "relu3"),
        helper.make_node("GlobalAveragePool", ["r3"], ["p"], "gap"),
        helper.make_node("Flatten", ["p"], ["f"], "flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], "fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "stage", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a.astype(np.float32), k) for k, a in inits.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_quantized_resnet_stage_stays_8_bit_on_the_gpu(tmp_path: Path, precision: str) -> None:
    """Every layer quantized (no per-layer choice): the stem and its pool are one layer
    (QConvPool) writing the pooled 8 bits, the shortcut's sum is handed over in 8 bits, and the
    engine autotuned on the GPU agrees with the reference backend's build (the stem and the
    pool apart) from the same calibration cache."""
    rng = np.random.default_rng()
    _, ref, engine, _ = _reference_and_gpu(tmp_path, _stage(rng), (16, 3, 32, 32), precision,
                                           quantize_all=True)  # fmt: skip
    eight_bit = {"int8", "float8_e4m3fn", "INT8", "FLOAT8E4M3FN"}
    (stem,) = [n for n in engine.graph.nodes if n.name == "stem"]
    assert stem.op == "QConvPool" and stem.outputs[0].dtype.name in eight_bit
    assert not any(n.op == "MaxPool" for n in engine.graph.nodes)
    quantized = [n.name for n in engine.graph.nodes if n.op in ("QConvAct", "QConvPool")]
    assert len(quantized) == 5
    adds = [n for n in engine.graph.nodes if n.op == "QConvAct" and len(n.inputs) > 5
            and n.inputs[5] is not None]  # fmt: skip
    assert len(adds) == 1 and adds[0].inputs[5].dtype.name in eight_bit
    chosen = {x["name"]: x.get("tactic", "default") for x in engine.layers}
    print({k: chosen[k] for k in quantized})  # (the tactics the autotuner kept)
    x = rng.standard_normal((16, 3, 32, 32)).astype(np.float32)
    want = ref.create_execution_context().infer({"x": x})["y"]
    got = np.asarray(engine.create_execution_context().infer({"x": x})["y"])
    # (as above, over five quantized layers: an E4M3 code a step off is 6% of its value)
    tol = 1e-2 if precision == "int8" else 5e-2
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
