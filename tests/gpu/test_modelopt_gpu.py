"""Model Optimizer's Q/DQ models (tests/passes/data/modelopt) on the cuda backend, autotuned on
the GPU: quantized layers kept, outputs against onnxruntime's reference run of the same files.
The tactics compute INT8 sums exactly and FP8 sums in float32 (or a layer in fp16 through cuDNN),
so a value on a rounding boundary may take the neighbouring code: the bound is a hundredth of
the output's norm, not float32 rounding as on the reference backend.

Run on a GPU machine:  PYTHONPATH=src python3 -m pytest -q -m gpu tests
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.builder import Builder  # noqa: E402
from tests.passes.test_modelopt_models import (  # noqa: E402
    DATA,
    QUANTIZED,
    feeds,
    onnxruntime_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_model_optimizer_models_on_the_gpu(name: str) -> None:
    rng = np.random.default_rng()
    path = DATA / f"{name}.onnx"
    engine = Builder("cuda").build(str(path), progress=False)
    op, count, precision = QUANTIZED[name]
    layers = [n for n in engine.graph.nodes if n.op == op]
    assert len(layers) == count and {n.precision for n in layers} == {precision}
    context = engine.create_execution_context()
    for _ in range(2):
        inputs = feeds(name, 2, rng)
        want = onnxruntime_reference(path, inputs).astype(np.float64)
        got = np.asarray(context.infer(inputs)["y"], np.float64)
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
