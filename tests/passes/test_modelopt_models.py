"""Q/DQ models as NVIDIA Model Optimizer writes them (tests/passes/data/modelopt: INT8 and FP8,
a residual conv net and a BERT encoder) are honoured as written: their convolutions and GEMMs
become quantized layers where the backend has them, and every engine agrees with onnxruntime's
reference run of the same file on fresh inputs (graph optimizations off: the ONNX semantics)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tensorkiln.builder import Builder
from tensorkiln.ir import DType

ort = pytest.importorskip("onnxruntime")

DATA = Path(__file__).parent / "data" / "modelopt"
# model -> (quantized layer, how many, their precision) on the reference backend
QUANTIZED = {
    "convnet_int8": ("QConvAct", 8, "int8"),
    "convnet_fp8": ("QConvAct", 2, "fp8"),
    "encoder_int8": ("QGemmAct", 12, "int8"),
    "encoder_fp8": ("QGemmAct", 12, "fp8"),
}


def feeds(name: str, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh inputs: images, or token ids with a mask hiding the tail of one sequence."""
    if name.startswith("convnet"):
        return {"x": rng.standard_normal((batch, 3, 16, 16)).astype(np.float32)}
    mask = np.ones((batch, 16), np.int64)
    mask[0, int(rng.integers(4, 16)) :] = 0
    ids = rng.integers(0, 100, (batch, 16)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask}


def onnxruntime_reference(path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_model_optimizer_qdq_models_run_as_written(name: str, backend: str) -> None:
    if backend == "cpu":
        pytest.importorskip("torch")
    rng = np.random.default_rng()
    path = DATA / f"{name}.onnx"
    engine = Builder(backend).build(str(path), progress=False)
    if backend == "reference":  # (the cpu backend runs Q/DQ models in float, as written)
        op, count, precision = QUANTIZED[name]
        layers = [n for n in engine.graph.nodes if n.op == op]
        assert len(layers) == count, Counter(n.op for n in engine.graph.nodes)
        assert {n.precision for n in layers} == {precision}
        # (a quantized block's residual is read quantized, its DequantizeLinear fused)
        if op == "QConvAct":
            residuals = [n.inputs[5] for n in layers if len(n.inputs) > 5 and n.inputs[5]]
            assert residuals and all(z.dtype in (DType.INT8, DType.FLOAT8E4M3FN) for z in residuals)
    context = engine.create_execution_context()
    exact = 0
    for _ in range(4):  # (the files keep the export's batch of 2)
        inputs = feeds(name, 2, rng)
        want = onnxruntime_reference(path, inputs)
        got = context.infer(inputs)["y"]
        assert got.shape == want.shape
        scale = np.abs(want).max()
        error = np.abs(got - want)
        # The float layers round differently from onnxruntime's in the last bit, and once in
        # about fifty draws such a value lies on a rounding boundary of the next quantizer and
        # takes the neighbouring code: one quantization step, about a hundredth of the output's
        # scale here. Any other difference in the quantization would show in every draw.
        assert error.max() <= 2e-2 * scale
        exact += bool(np.all(error <= 1e-4 * np.abs(want) + 1e-5 * scale))
    assert exact >= 2


def test_fp8_qdq_pairs_fuse_as_the_int8_ones_do() -> None:
    """The encoder's FP8 file has its Q/DQ pairs where the INT8 one has them (around the
    attention's products, after the LayerNorms): the same layers come of both, the FP8 pairs
    inside Pointwise kernels as the INT8 ones."""
    layers = {
        precision: Counter(
            n.op
            for n in Builder("reference").build(str(DATA / f"encoder_{precision}.onnx")).graph.nodes
        )
        for precision in ("int8", "fp8")
    }
    assert layers["fp8"] == layers["int8"]
    assert layers["fp8"]["QuantizeLinear"] <= 4 and layers["fp8"]["Pointwise"] >= 10
