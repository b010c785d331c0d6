"""A context whose activation memory plan cannot fit where it would run is refused with a clear
error before anything is reserved; one that fits is created and runs right (against onnxruntime).

The plan of a loaded engine is the graph's own (Engine.load plans it again and compares), so the
only way to a huge plan is a graph that allows huge shapes: a profile whose max batch is 2**40.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.engine import Engine
from tensorkiln.errors import EngineCompatibilityError
from tests.engine import models as M


def _engine(max_batch: int, device: str) -> Engine:
    config = BuilderConfig()
    config.add_optimization_profile(
        OptimizationProfile().set_shape("x", (1, 16), (4, 16), (max_batch, 16))
    )
    built = Builder("cuda", device=device).build(M.mlp(), config, progress=False)
    return Engine.deserialize(built.serialize())


def _check_refused(engine: Engine) -> None:
    with pytest.raises(EngineCompatibilityError) as exc:
        engine.create_execution_context()
    text = str(exc.value)
    assert f"{engine.memory['peak_bytes']:,} bytes" in text and "--max-shapes" in text, text


def _check_runs(engine: Engine) -> None:
    x = np.random.default_rng().standard_normal((8, 16)).astype(np.float32)
    session = ort.InferenceSession(M.mlp().SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(["probs"], {"x": x})[0]
    with engine.create_execution_context() as ctx:
        np.testing.assert_allclose(np.asarray(ctx.infer({"x": x})["probs"]), want, rtol=1e-4)


def test_plan_larger_than_the_machine_is_refused_on_cpu_tensors() -> None:
    pytest.importorskip("torch")
    huge = _engine(2**40, "cpu")  # 2**40 rows of 32 floats: far beyond any machine's memory
    assert huge.memory["peak_bytes"] > 2**46
    _check_refused(huge)
    _check_runs(_engine(16, "cpu"))


@pytest.mark.gpu
def test_plan_larger_than_free_gpu_memory_is_refused() -> None:
    import torch

    _, total = torch.cuda.mem_get_info()
    # a batch whose first activation alone (32 floats a row) is eight times the GPU's memory,
    # more than what is free and what recycled pools hold together
    huge = _engine(total // 16, "cuda")
    assert huge.memory["peak_bytes"] > total
    before = torch.cuda.memory_reserved()
    _check_refused(huge)
    assert torch.cuda.memory_reserved() == before  # refused before reserving anything
    _check_runs(_engine(16, "cuda"))
