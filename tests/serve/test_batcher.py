"""Dynamic batching: concurrent requests gathered into engine runs and split back, every request
getting exactly its own rows, checked against running each request alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tensorkiln.serve import ModelRepository
from tensorkiln.serve.batcher import DynamicBatcher, joined
from tensorkiln.serve.model import ServedModel
from tests.serve.test_repository import _model, digit_inputs


def _run_all(batcher: DynamicBatcher, requests: list[dict], delays: list[float] | None = None):
    async def main():
        batcher.start()

        async def one(i, feeds):
            if delays:
                await asyncio.sleep(delays[i])
            n = next(iter(feeds.values())).shape[0]
            return await batcher.submit(feeds, n)

        try:
            return await asyncio.gather(
                *(one(i, f) for i, f in enumerate(requests)), return_exceptions=True
            )
        finally:
            await batcher.close()

    return asyncio.run(main())


def _served_digits(root, count: int) -> tuple[ServedModel, list[dict]]:
    """The digits model served from ``root``, and ``count`` requests of 1 to 3 random rows."""
    _model(root)
    entry = ModelRepository(root).read("digits")
    served = ServedModel.load(entry, entry.versions[0])
    return served, [{"input": x} for x in digit_inputs(count)]


def test_concurrent_requests_get_their_own_rows_of_shared_runs(tmp_path):
    served, requests = _served_digits(tmp_path, 40)
    batcher = DynamicBatcher(served.infer_batch, max_batch=16, max_delay_s=0.05, workers=2)
    results = _run_all(batcher, requests)
    for feeds, got in zip(requests, results):
        want = served.infer(feeds)["logits"]  # the same request, alone
        np.testing.assert_allclose(
            got["logits"], want, rtol=1e-5, atol=1e-5
        )  # (BLAS blocks by batch size)
    assert sum(batcher.stats.requests) == 40
    assert max(batcher.stats.requests) > 1 and max(batcher.stats.sizes) <= 16
    assert sum(batcher.stats.sizes) == sum(r["input"].shape[0] for r in requests)


def test_without_gathering_every_request_runs_alone_on_the_workers(tmp_path):
    served, requests = _served_digits(tmp_path, 20)
    batcher = DynamicBatcher(
        served.infer_batch, max_batch=16, max_delay_s=0.05, workers=2, gather=False
    )
    results = _run_all(batcher, requests)
    for feeds, got in zip(requests, results):
        np.testing.assert_allclose(got["logits"], served.infer(feeds)["logits"], rtol=1e-6)
    assert list(batcher.stats.requests) == [1] * 20
    assert sorted(batcher.stats.sizes) == sorted(r["input"].shape[0] for r in requests)


def _rows(feeds):
    """An oracle run: each output row names its input row (its sum), so mixing shows."""
    x = feeds["x"]
    return {"y": x.reshape(x.shape[0], -1).sum(axis=1, keepdims=True) * 2.0}


def test_requests_of_other_shapes_are_never_mixed():
    rng = np.random.default_rng()
    seen = []

    def run(feeds):
        seen.append(feeds["x"].shape)
        return _rows(feeds)

    requests = [
        {"x": rng.standard_normal((1, 3 if i % 2 else 5)).astype(np.float32)} for i in range(12)
    ]
    results = _run_all(DynamicBatcher(joined(run), max_batch=8, max_delay_s=0.05), requests)
    for feeds, got in zip(requests, results):
        np.testing.assert_allclose(got["y"], _rows(feeds)["y"], rtol=1e-6)
    assert all(len(s) == 2 for s in seen) and {s[1] for s in seen} == {3, 5}
    assert max(s[0] for s in seen) > 1  # (still batched, each shape with its own kind)


def test_preferred_batch_sizes_shape_the_runs():
    rng = np.random.default_rng()
    seen = []

    def run(feeds):
        seen.append(feeds["x"].shape[0])
        return _rows(feeds)

    # nine requests queued before the one instance is free: runs of the preferred 4, then the rest
    requests = [{"x": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(9)]
    batcher = DynamicBatcher(joined(run), max_batch=16, max_delay_s=0.0, preferred=(4,))
    results = _run_all(batcher, requests)
    for feeds, got in zip(requests, results):
        np.testing.assert_allclose(got["y"], _rows(feeds)["y"], rtol=1e-6)
    assert seen == [4, 4, 1], seen


def test_a_failing_run_fails_only_its_own_requests():
    rng = np.random.default_rng()

    def run(feeds):
        if np.isnan(feeds["x"]).any():
            raise RuntimeError("the engine refused a NaN")
        return _rows(feeds)

    requests = [{"x": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(6)]
    requests[0]["x"][0, 0] = np.nan
    delays = [0.0] + [0.1] * 5  # (the bad one alone in the first run)
    results = _run_all(DynamicBatcher(joined(run), max_batch=8, max_delay_s=0.02), requests, delays)
    assert isinstance(results[0], RuntimeError) and "NaN" in str(results[0])
    for feeds, got in zip(requests[1:], results[1:]):
        np.testing.assert_allclose(got["y"], _rows(feeds)["y"], rtol=1e-6)


def test_bad_uses_are_refused():
    with pytest.raises(ValueError, match="max_batch must be 1 or more"):
        DynamicBatcher(joined(_rows), max_batch=0)
    batcher = DynamicBatcher(joined(_rows), max_batch=2)
    x = np.ones((3, 4), np.float32)
    results = _run_all(batcher, [{"x": x}])
    assert isinstance(results[0], ValueError) and "1 to 2" in str(results[0])

    async def after_close():
        return await batcher.submit({"x": x[:1]}, 1)

    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(after_close())


def _threads_run(delay: float = 0.0, fail_nan: bool = False):
    """A run that notes the thread it ran on (and sleeps ``delay``, refusing NaN if asked)."""
    import threading
    import time

    threads: list[int] = []

    def run(feeds):
        threads.append(threading.get_ident())
        if delay:
            time.sleep(delay)
        if fail_nan and np.isnan(feeds["x"]).any():
            raise RuntimeError("the engine refused a NaN")
        return _rows(feeds)

    return joined(run), threads


def test_a_lone_request_to_an_idle_short_model_runs_on_the_loop_thread():
    import threading

    rng = np.random.default_rng()
    run, threads = _threads_run(fail_nan=True)
    batcher = DynamicBatcher(run, max_batch=4, workers=2, gather=False, inline_max_s=0.05)

    async def main():
        batcher.start()
        try:
            got = []
            for i in range(30):  # one at a time, as a client at concurrency 1 over a network
                await asyncio.sleep(0.002)
                x = rng.standard_normal((1 + i % 3, 4)).astype(np.float32)
                if i == 20:
                    x[0, 0] = np.nan
                try:
                    got.append((x, await batcher.submit({"x": x}, x.shape[0])))
                except RuntimeError as exc:
                    got.append((x, exc))
            return got
        finally:
            await batcher.close()

    results = asyncio.run(main())
    loop_thread = threading.get_ident()  # (asyncio.run runs the loop on this thread)
    # the first runs go to the workers (too few to know the model is short), then on the loop
    assert all(t != loop_thread for t in threads[:8])
    assert threads[8:] == [loop_thread] * 22 and batcher.inline_runs == 22
    for i, (x, got) in enumerate(results):
        if i == 20:  # a failing run on the loop fails its own request, and the batcher goes on
            assert isinstance(got, RuntimeError) and "NaN" in str(got)
        else:
            np.testing.assert_allclose(got["y"], _rows({"x": x})["y"], rtol=1e-6)


@pytest.mark.parametrize("idle_gap_s", [None, 0.0], ids=["idle-gap", "no-idle-gap"])
def test_concurrent_requests_and_long_runs_stay_off_the_loop_thread(idle_gap_s, monkeypatch):
    import threading

    if idle_gap_s is not None:
        # (as a host that stalls between requests arriving together would make it: the gap
        # since the last run no longer tells; the requests of one loop turn still count as load)
        monkeypatch.setattr("tensorkiln.serve.batcher._IDLE_GAP_S", idle_gap_s)

    rng = np.random.default_rng()

    def lone_then_together(batcher, runs_before: int, together: int):
        async def main():
            batcher.start()
            try:
                for _ in range(runs_before):  # (a lone client first)
                    await asyncio.sleep(0.002)
                    x = rng.standard_normal((1, 4)).astype(np.float32)
                    await batcher.submit({"x": x}, 1)
                inline_before.append(batcher.inline_runs)
                await asyncio.sleep(0.002)
                xs = [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(together)]
                ys = await asyncio.gather(*(batcher.submit({"x": x}, 1) for x in xs))
                return xs, ys
            finally:
                await batcher.close()

        return asyncio.run(main())

    inline_before: list[int] = []
    # load: requests in flight together go to the workers (at most the first runs on the loop)
    run, threads = _threads_run(delay=0.002)
    batcher = DynamicBatcher(run, max_batch=1, workers=2, gather=False, inline_max_s=0.05)
    xs, ys = lone_then_together(batcher, 10, 24)
    for x, y in zip(xs, ys):
        np.testing.assert_allclose(y["y"], _rows({"x": x})["y"], rtol=1e-6)
    loop_thread = threading.get_ident()
    assert inline_before[-1] == 2  # (the lone client's last two runs: on the loop)
    assert threads[10:].count(loop_thread) <= 1 and batcher.inline_runs <= 3
    # runs longer than inline_max_s never run on the loop, nor with dynamic batching
    for kwargs in ({"gather": False, "inline_max_s": 0.001}, {"inline_max_s": 0.05}):
        run, threads = _threads_run(delay=0.003)
        batcher = DynamicBatcher(run, max_batch=1, workers=2, **kwargs)
        lone_then_together(batcher, 12, 2)
        assert loop_thread not in threads and batcher.inline_runs == 0
