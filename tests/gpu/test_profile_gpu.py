"""The per-layer profile on a real GPU: layer times are CUDA-event times, close to what torch's own
events measure for the same product, and the achieved rates stay under the device's roof.

Run on a GPU machine:  PYTHONPATH=src python3 -m pytest -q -m gpu tests/gpu/test_profile_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from tensorkiln.backends.cuda import CudaEventLayerTimer  # noqa: E402
from tensorkiln.builder import Builder, BuilderConfig  # noqa: E402
from tensorkiln.runtime.peaks import device_peaks  # noqa: E402
from tensorkiln.runtime.profile import profile_layers  # noqa: E402

pytestmark = pytest.mark.gpu
N, K = 256, 4096


def _model(rng: np.random.Generator) -> tuple[bytes, np.ndarray]:
    w = (rng.standard_normal((K, K)) / np.sqrt(K)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "mm_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, K])],
        [numpy_helper.from_array(w, "w")],
    )
    opsets = [helper.make_opsetid("", 17)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString(), w


def _torch_matmul_ms(x: np.ndarray, w: np.ndarray, runs: int) -> float:
    """The oracle: torch's own CUDA events around the same fp32 product (TF32 off, as an fp32
    engine computes)."""
    a, b = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.matmul(a, b)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(runs):
            torch.matmul(a, b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / runs
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_layer_times_are_cuda_event_times_under_the_roof() -> None:
    rng = np.random.default_rng()
    model, w = _model(rng)
    config = BuilderConfig(optimization_level=0)
    engine = Builder("cuda").build(model, config, progress=False)
    assert isinstance(engine.runtime_backend.layer_timer(), CudaEventLayerTimer)
    x = rng.standard_normal((N, K)).astype(np.float32)
    name = torch.cuda.get_device_name()
    peaks = device_peaks(name)
    with engine.create_execution_context() as ctx:
        ctx.infer({"x": x})
        rows = {r["name"]: r for r in profile_layers(ctx, {"x": x}, 20, peaks)}
    mm, relu = rows["mm"], rows["relu"]
    assert mm["flops"] == 2 * N * K * K and relu["flops"] == N * K
    assert mm["bytes"] == 4 * (N * K + K * K + N * K)
    want = _torch_matmul_ms(x, w, 20)
    assert 0.5 * want < mm["average_ms"] < 2.0 * want, (mm["average_ms"], want)
    if peaks is not None:  # (a GPU of the table: the fp32 product runs on the CUDA cores)
        assert mm["peak_tflops"] == peaks.tflops["fp32"] and mm["peak_gbps"] == peaks.gbps
        assert mm["tflops"] < 1.05 * mm["peak_tflops"] and mm["bound"] == "compute"
        assert 0 < mm["roofline_percent"] < 105
        assert relu["bound"] == "memory" and relu["gbps"] < 1.05 * peaks.gbps


def _chain(n: int, width: int) -> bytes:
    """A launch-bound model: ``n`` small elementwise layers on a [1, width] input."""
    nodes, prev = [], "x"
    for i in range(n):
        op = ("Relu", "Neg", "Abs", "Sigmoid")[i % 4]
        nodes.append(helper.make_node(op, [prev], [f"t{i}"], name=f"layer{i}"))
        prev = f"t{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])],
    )
    opsets = [helper.make_opsetid("", 17)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def test_batch_1_layer_times_are_kernel_times_not_launch_gaps() -> None:
    """At batch 1 the host launches layers slower than the GPU runs them; the profile holds the
    GPU until the host has queued the run, so the summed layer times stay near what the same
    kernels take replayed as a CUDA graph (without the hold they read the host's pace)."""
    n = 60
    engine = Builder("cuda").build(
        _chain(n, 64), BuilderConfig(optimization_level=0), progress=False
    )
    x = np.random.default_rng().standard_normal((1, 64)).astype(np.float32)
    xt = torch.from_numpy(x).cuda()
    with engine.create_execution_context(use_cuda_graph=True) as graphed:
        for _ in range(3):
            graphed.infer({"x": xt})
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graphed.infer({"x": xt})
        end.record()
        end.synchronize()
        replay_ms = start.elapsed_time(end) / 20
    with engine.create_execution_context() as ctx:
        rows = profile_layers(ctx, {"x": xt}, 30)
    summed = sum(r["average_ms"] for r in rows)
    assert len(rows) >= n
    assert summed <= 4 * replay_ms + 0.05, (summed, replay_ms)
