"""An engine's weights are put on its device once and read by all of its execution contexts."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from tensorkiln.builder import Builder, BuilderConfig  # noqa: E402
from tensorkiln.runtime import Runner  # noqa: E402
from tests.passes.util import model  # noqa: E402


def _mlp(rng):
    w1 = rng.standard_normal((32, 64)).astype(np.float32)
    w2 = rng.standard_normal((64, 8)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("MatMul", ["t", "w2"], ["y"]),
    ]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )


def test_contexts_of_an_engine_share_its_device_weights() -> None:
    rng = np.random.default_rng()
    m = _mlp(rng)
    engine = Builder("cuda", device="cpu").build(
        m, BuilderConfig(tactic_sources=set()), progress=False
    )
    contexts = [engine.create_execution_context() for _ in range(3)]
    results: dict[int, np.ndarray] = {}
    feeds = [rng.standard_normal((4 + i, 32)).astype(np.float32) for i in range(3)]

    def run(i: int) -> None:
        results[i] = contexts[i].infer({"x": feeds[i]})["y"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reference = Runner(m)
    for i in range(3):
        np.testing.assert_allclose(
            results[i], reference.infer({"x": feeds[i]})["y"], rtol=1e-5, atol=1e-5
        )
    # one copy of each initializer, whichever context first needed it
    (weights,) = engine.device_weights.values()
    assert sorted(v.name for v in weights) == sorted(v.name for v in engine.graph.initializers)
    for ctx in contexts:
        for v in engine.graph.initializers:
            assert ctx._executor.const(v) is weights[v]
