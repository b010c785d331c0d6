"""One ExecutionContext shared by several threads: each thread's shape queries answer for the
shapes that thread set, never another's, and runs stay right. Checked against onnxruntime, on the
reference backend and on the cuda backend's kernels over torch CPU tensors (and on the GPU, where
there is one)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import onnxruntime as ort
import pytest

from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.engine import Engine
from tensorkiln.errors import InputError
from tests.engine import models as M

THREADS = 4
ROUNDS = 150
MAX_BATCH = 16


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    return ort.InferenceSession(M.mlp().SerializeToString(), providers=["CPUExecutionProvider"])


def _engine(backend: str) -> Engine:
    config = BuilderConfig()
    config.add_optimization_profile(
        OptimizationProfile().set_shape("x", (1, 16), (4, 16), (MAX_BATCH, 16))
    )
    builder = Builder("cuda", device="cpu") if backend == "cuda-cpu" else Builder(backend)
    return Engine.deserialize(builder.build(M.mlp(), config, progress=False).serialize())


@pytest.fixture(params=["reference", "cuda-cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request: pytest.FixtureRequest) -> Engine:
    if request.param != "reference":
        pytest.importorskip("torch")
    return _engine(request.param)


@pytest.fixture
def busy_switching() -> Iterator[None]:
    # Switch threads as often as the interpreter allows, so that any state one thread leaves on
    # the context for its next call is seen by the others if it is shared.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _in_threads(work: Callable[[int], None], n: int = THREADS) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait()
            work(i)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


def _ort_shapes(session: ort.InferenceSession, batch: int) -> dict[str, tuple[int, ...]]:
    x = np.random.default_rng().standard_normal((batch, 16)).astype(np.float32)
    names = [o.name for o in session.get_outputs()]
    return {n: r.shape for n, r in zip(names, session.run(names, {"x": x}))}


def test_shape_queries_are_per_thread(engine: Engine, session, busy_switching) -> None:
    expected = {b: _ort_shapes(session, b) for b in range(1, MAX_BATCH + 1)}
    ctx = engine.create_execution_context()
    wrong: list[str] = []

    def work(i: int) -> None:
        rng = np.random.default_rng()
        for _ in range(ROUNDS):
            batch = int(rng.integers(1, MAX_BATCH + 1))
            ctx.set_input_shape("x", (batch, 16))
            time.sleep(0)  # let another thread in between the two calls
            got = {n: ctx.get_tensor_shape(n) for n in ("x", "logits", "probs")}
            want = {"x": (batch, 16), **expected[batch]}
            if got != want:
                wrong.append(f"thread {i}: set batch {batch}, read {got}")

    _in_threads(work)
    assert not wrong, f"{len(wrong)} of {THREADS * ROUNDS} reads saw another thread's shapes"


def test_shapes_and_runs_interleaved_in_threads(engine: Engine, session, busy_switching) -> None:
    ctx = engine.create_execution_context()
    names = [o.name for o in session.get_outputs()]
    wrong: list[str] = []

    def work(i: int) -> None:
        rng = np.random.default_rng()
        for _ in range(ROUNDS // 5):
            batch = int(rng.integers(1, MAX_BATCH + 1))
            x = rng.standard_normal((batch, 16)).astype(np.float32)
            ctx.set_input_shape("x", x.shape)
            out = ctx.infer({"x": x})
            want = dict(zip(names, session.run(names, {"x": x})))
            for n in names:
                if ctx.get_tensor_shape(n) != want[n].shape:
                    wrong.append(f"thread {i}: shape of {n} {ctx.get_tensor_shape(n)}")
                np.testing.assert_allclose(np.asarray(out[n]), want[n], rtol=1e-4, atol=1e-5)
            if ctx.last_compute_s <= 0.0:
                wrong.append(f"thread {i}: last_compute_s {ctx.last_compute_s}")
            gpu_s = ctx.last_gpu_s  # this thread's own CUDA events (None off the GPU)
            if engine.backend == "cuda" and engine.device == "cuda" and not gpu_s:
                wrong.append(f"thread {i}: last_gpu_s {gpu_s}")

    _in_threads(work)
    assert not wrong, wrong


def test_a_thread_sees_only_the_shapes_it_set() -> None:
    ctx = _engine("reference").create_execution_context()
    ctx.set_input_shape("x", (3, 16))
    assert ctx.get_tensor_shape("logits") == (3, 10)
    seen: dict[str, object] = {}

    def other(_: int) -> None:
        seen["compute_s"] = ctx.last_compute_s
        with pytest.raises(InputError, match="per thread") as exc:
            ctx.get_tensor_shape("logits")
        seen["error"] = str(exc.value)
        ctx.set_input_shape("x", (5, 16))
        seen["own"] = ctx.get_tensor_shape("probs")

    _in_threads(other, n=1)
    assert seen["compute_s"] == 0.0 and seen["own"] == (5, 10), seen
    assert "set_input_shape" in str(seen["error"])
    assert ctx.get_tensor_shape("logits") == (3, 10)  # untouched by the other thread
