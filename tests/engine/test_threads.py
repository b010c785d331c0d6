"""Several execution contexts of one engine, run at once from threads, each get their own answer."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.engine import Engine
from tests.engine import models as M
from tests.engine.test_roundtrip import assert_identical

THREADS = 4
RUNS = 20


def _engine(model, name: str, rest: tuple[int, ...]) -> Engine:
    config = BuilderConfig()
    config.add_optimization_profile(
        OptimizationProfile().set_shape(name, (1, *rest), (4, *rest), (16, *rest))
    )
    return Engine.deserialize(Builder().build(model, config).serialize())


def _run_threads(engine: Engine, feeds: list[list[dict[str, np.ndarray]]]) -> list[list[dict]]:
    results: list[list[dict]] = [[] for _ in feeds]
    errors: list[BaseException] = []
    start = threading.Barrier(len(feeds))

    def work(i: int) -> None:
        try:
            with engine.create_execution_context() as ctx:
                start.wait()
                for f in feeds[i]:
                    results[i].append(ctx.infer(f))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


@pytest.mark.parametrize(
    "maker, name, rest",
    [(M.cnn, "x", (3, 12, 12)), (M.mlp, "x", (16,)), (M.residual, "x", (8,))],
    ids=["cnn", "mlp", "residual"],
)
def test_contexts_in_threads_match_single_thread(maker, name: str, rest: tuple[int, ...]) -> None:
    engine = _engine(maker(), name, rest)
    rng = np.random.default_rng()
    feeds = [
        [
            {name: rng.standard_normal((int(rng.integers(1, 17)), *rest)).astype(np.float32)}
            for _ in range(RUNS)
        ]
        for _ in range(THREADS)
    ]
    threaded = _run_threads(engine, feeds)
    with engine.create_execution_context() as ctx:
        for i in range(THREADS):
            assert len(threaded[i]) == RUNS
            for j, f in enumerate(feeds[i]):
                assert_identical(threaded[i][j], ctx.infer(f), f"thread {i} run {j}")


def test_control_flow_contexts_in_threads() -> None:
    # Subgraph plans are made lazily, per context, while other threads run: exercise that path.
    engine = Engine.deserialize(Builder().build(M.control_flow()).serialize())
    rng = np.random.default_rng()
    feeds = [
        [{"x": rng.standard_normal((2, 4)).astype(np.float32)} for _ in range(RUNS)]
        for _ in range(THREADS)
    ]
    threaded = _run_threads(engine, feeds)
    ctx = engine.create_execution_context()
    for i in range(THREADS):
        for j, f in enumerate(feeds[i]):
            assert_identical(threaded[i][j], ctx.infer(f), f"thread {i} run {j}")


def test_weights_are_not_changed_by_running() -> None:
    engine = _engine(M.cnn(), "x", (3, 12, 12))
    before = {v.name: v.const.copy() for v in engine.graph.initializers}
    rng = np.random.default_rng()
    _run_threads(
        engine,
        [[{"x": rng.standard_normal((3, 3, 12, 12)).astype(np.float32)}] * 5] * THREADS,
    )
    after = {v.name: v.const for v in engine.graph.initializers}
    assert_identical(after, before, "weights after running")
