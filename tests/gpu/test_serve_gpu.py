"""Serving on a GPU: requests received into page-locked memory (the pinned pool) go to the engine
from where they arrived, and every answer equals the direct engine run on the reference backend.

Run on a GPU machine:  PYTHONPATH=src python3 -m pytest -q -m gpu tests/gpu/test_serve_gpu.py
"""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.builder import Builder  # noqa: E402
from tensorkiln.serve import ModelRepository  # noqa: E402
from tensorkiln.serve.core import RECEIVE_PINNED_MIN, ServerCore  # noqa: E402
from tensorkiln.serve.model import PinnedPool, ServedModel  # noqa: E402
from tests.serve.test_repository import DIGITS, _model  # noqa: E402

pytestmark = pytest.mark.gpu


def _pinned(a: np.ndarray) -> bool:
    return bool(torch.from_numpy(a.reshape(-1).view(np.uint8)).is_pinned())


def test_the_pinned_pool_bounds_the_page_locked_bytes_in_use() -> None:
    pool = PinnedPool(limit=3 << 20)
    a = pool.take(2 << 20)
    assert a is not None and a.dtype == np.uint8 and a.size == 2 << 20 and _pinned(a)
    assert pool.used == 2 << 20
    assert pool.take(2 << 20) is None  # (over the limit: the caller takes pageable memory)
    view = np.frombuffer(memoryview(a)[5:4005], np.float32)  # (a request's tensor, unaligned)
    del a
    gc.collect()
    assert pool.used == 2 << 20  # (a view of the buffer holds it)
    assert _pinned(view)
    del view
    gc.collect()
    assert pool.used == 0
    b = pool.take(3 << 20)
    assert b is not None and _pinned(b)


def test_a_lone_request_in_page_locked_memory_runs_where_it_lies(tmp_path) -> None:
    _model(tmp_path)
    entry = ModelRepository(tmp_path).read("digits")
    served = ServedModel.load(entry, entry.versions[-1], backend="cuda")
    direct = Builder("reference").build(str(DIGITS), progress=False).create_execution_context()
    pool = PinnedPool()
    rng = np.random.default_rng()
    for n in (1, 2, 4, 3, 1):
        x = rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
        buf = pool.take(x.nbytes + 3)
        feed = np.frombuffer(memoryview(buf)[3:], np.float32).reshape(x.shape)  # (unaligned)
        feed[...] = x
        want = direct.infer({"input": x})["logits"]
        for given in (feed, x.copy()):  # page-locked, where it lies; pageable, staged
            got = served.infer({"input": given})["logits"]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(feed, x)  # (the request's own bytes are not written)
    # two requests joined in a batch
    xs = [rng.standard_normal((k, 1, 8, 8)).astype(np.float32) for k in (1, 2)]
    got = served.infer_batch([{"input": x} for x in xs])
    for x, g in zip(xs, got):
        np.testing.assert_allclose(
            g["logits"], direct.infer({"input": x})["logits"], rtol=1e-4, atol=1e-5
        )


def test_the_core_receives_large_requests_in_page_locked_memory_once_a_gpu_model_loads(
    tmp_path,
) -> None:
    _model(tmp_path / "repo")

    async def main() -> None:
        core = ServerCore(tmp_path / "repo", backend="cuda")
        before = core.receive_buffer(RECEIVE_PINNED_MIN)
        assert isinstance(before, bytearray) and len(before) == RECEIVE_PINNED_MIN
        await core.load("digits")
        try:
            big = core.receive_buffer(RECEIVE_PINNED_MIN + 7)
            assert isinstance(big, np.ndarray) and big.size == RECEIVE_PINNED_MIN + 7
            assert _pinned(big)
            small = core.receive_buffer(RECEIVE_PINNED_MIN - 1)
            assert isinstance(small, bytearray)
        finally:
            await core.close()
        off = ServerCore(tmp_path / "repo", backend="cuda", pinned_pool_bytes=0)
        await off.load("digits")
        try:  # (--pinned-memory-pool-byte-size 0: no pool, every request is staged)
            assert isinstance(off.receive_buffer(RECEIVE_PINNED_MIN + 7), bytearray)
        finally:
            await off.close()

    asyncio.run(main())
