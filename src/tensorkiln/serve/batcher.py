"""Dynamic batching, as Triton's dynamic_batching does it: concurrent requests to one model are
gathered into one engine run, and the results are split back to each request.

One scheduler waits for a free instance (execution context), then takes the oldest waiting
request. It gathers more, in arrival order, until the batch reaches the largest preferred batch
size (max_batch_size when none is given) or the queue delay has passed since the first request.
The batch runs in a thread, off the event loop, and each request gets the rows of the results
that are its own. While every instance is busy, requests gather, so batches grow with the load.
Only requests whose inputs have the same non-batch shapes go into one batch; a request that
differs waits for a later batch, in order.
Requests never see each other's rows. A failing run fails only the requests in that batch, with
its error, and the worker goes on.

A model without dynamic batching goes through the same scheduler with ``gather=False``: each
request runs alone, as it came, ``workers`` at a time. Either way the engine is called from
``workers`` threads of the batcher's own, on which the batch runner also joins and splits the
rows (:func:`joined` makes one of a run over joined rows), so that the event loop only moves
requests and the engine's threads stay few and warm (a thread per request
would contend for the interpreter's lock with every other).

One exception, for latency at low load: a request that runs alone and finds the model idle, on
a model whose runs are short (``inline_max_s``), runs on the event loop's own thread. The hop to
a worker thread and back costs two thread wake-ups, as much as a short GPU run, and a lone
client pays both on every request. While it runs the loop does nothing else, which is why it is
kept to short runs and idle models. Idle means: no other request to the model in flight, none
in the last ``_BUSY_HOLD_S``, and the last run ended at least ``_IDLE_GAP_S`` ago (a request
that comes sooner may have waited behind that run, in the loop or in the transport). Requests
that reach the batcher in the turn of the loop in which one of them ran on the loop came
together, and count as load whatever the clock says (a run on the loop returns without
yielding, so "in flight" alone would not see them, and a host that stalls between them would
fool the gap). Under load requests are in flight together, and the model's requests go to the
worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class _Request:
    feeds: Mapping[str, np.ndarray]
    batch: int
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)
    # what must agree for requests to share a run: input names, dtypes, non-batch shapes
    key: tuple = field(init=False)

    def __post_init__(self) -> None:
        # (a tensor in CUDA shared memory has a torch dtype: never a numpy array's key)
        self.key = tuple(
            (n, x.dtype.str if isinstance(x, np.ndarray) else str(x.dtype), x.shape[1:])
            for n, x in sorted(self.feeds.items())
        )


# The event loop's timers wake up to a millisecond late (its selector waits in whole
# milliseconds), which would stretch a 200 us queue delay to over 1 ms: the last stretch of a
# delay is spent yielding to the loop instead.
_TIMER_SLACK = 0.0015
# after a request found another in flight, requests stay off the loop's thread this long
_BUSY_HOLD_S = 0.05
# a request that reaches the batcher this soon after the last run ended does not run on the loop
_IDLE_GAP_S = 0.0003
_RUN_TIMES_KEPT = 8  # the recent runs whose median decides whether a run is short
STATS_KEPT = 10_000  # engine runs the stats remember (a server runs for days: bounded)


@dataclass
class BatchStats:
    """The latest engine runs (the metrics count them all): one entry per run."""

    sizes: deque[int] = field(default_factory=lambda: deque(maxlen=STATS_KEPT))  # rows
    requests: deque[int] = field(default_factory=lambda: deque(maxlen=STATS_KEPT))


Feeds = Mapping[str, np.ndarray]
Outputs = dict[str, np.ndarray]


def split_rows(out: Mapping[str, np.ndarray], rows: list[int]) -> list[Outputs]:
    """The outputs of a run over joined requests, split back: the first ``rows[0]`` rows of
    every output for the first request, and so on."""
    parts, offset = [], 0
    for n in rows:
        parts.append({k: contiguous(v[offset : offset + n]) for k, v in out.items()})
        offset += n
    return parts


def contiguous(x: Any) -> Any:
    """``x`` C-ordered: a numpy array, or a torch tensor (outputs left on the GPU)."""
    return np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x.contiguous()


def joined(
    run: Callable[[dict[str, np.ndarray]], Outputs],
) -> Callable[[list[Feeds]], list[Outputs]]:
    """A batch runner for :class:`DynamicBatcher` from ``run`` (feeds with a batch dimension ->
    outputs with it): the requests' rows joined, run once, split back (one request: as it is)."""

    def run_batch(requests: list[Feeds]) -> list[Outputs]:
        if len(requests) == 1:
            return [run(dict(requests[0]))]
        feeds = {n: np.concatenate([r[n] for r in requests], axis=0) for n in requests[0]}
        return split_rows(run(feeds), [next(iter(r.values())).shape[0] for r in requests])

    return run_batch


class DynamicBatcher:
    """Gathers requests into batches of at most ``max_batch`` rows, waiting at most
    ``max_delay_s`` for more, and runs each batch with ``run`` (the requests' feeds -> their
    outputs, in order; :func:`joined` makes one of a run over joined rows), ``workers`` runs at
    a time. Start it inside a running event loop with :meth:`start`."""

    def __init__(
        self,
        run: Callable[[list[Feeds]], list[Outputs]],
        *,
        max_batch: int,
        max_delay_s: float = 0.0,
        preferred: tuple[int, ...] = (),
        workers: int = 1,
        gather: bool = True,
        inline_max_s: float = 0.0,
        on_batch: Callable[[int, list[float], float], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be 1 or more, got {max_batch}")
        self._run = run
        self.max_batch = max_batch
        self.max_delay_s = max(0.0, max_delay_s)
        self.preferred = tuple(sorted(p for p in preferred if 0 < p <= max_batch))
        self.workers = max(1, workers)
        self.gather = gather
        self.stats = BatchStats()
        self._on_batch = on_batch
        self._waiting: deque[_Request] = deque()
        self._arrived: asyncio.Event | None = None
        self._free: asyncio.Semaphore | None = None
        self._tasks: list[asyncio.Task] = []
        self._threads: ThreadPoolExecutor | None = None
        self._running: set[asyncio.Future] = set()  # engine runs in flight
        self._closed = False
        # running a lone request on the loop's thread (the module's docstring says when)
        self.inline_max_s = max(0.0, inline_max_s) if not gather else 0.0
        self._pending = 0  # requests submitted and not yet returned
        self._busy_until = 0.0  # perf_counter before which no request runs on the loop
        self._last_end = 0.0  # perf_counter when the last run ended
        self._ran_inline_this_turn = False  # a request ran on the loop in this loop turn
        self._run_times: deque[float] = deque(maxlen=_RUN_TIMES_KEPT)
        self.inline_runs = 0  # requests run on the loop's thread (statistics, tests)

    def start(self) -> None:
        """Start the scheduler on the running event loop."""
        self._arrived = asyncio.Event()
        self._free = asyncio.Semaphore(self.workers)
        self._threads = ThreadPoolExecutor(self.workers, thread_name_prefix="tensorkiln-engine")
        self._tasks = [asyncio.create_task(self._schedule())]

    async def submit(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        """Queue one request of ``batch`` rows (checked already); its results, when run."""
        if self._closed or self._arrived is None:
            raise RuntimeError("the batcher is not running")
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"a request of {batch} rows; the batcher takes 1 to {self.max_batch}")
        loop = asyncio.get_running_loop()
        request = _Request(feeds, batch, loop.create_future())
        self._pending += 1
        try:
            # (another request is in flight, or one ran on the loop in this very turn and this
            # one came with it: the model has load)
            if self._pending > 1 or self._ran_inline_this_turn:
                self._busy_until = request.arrived + _BUSY_HOLD_S
            if self._may_inline(request.arrived):
                await self._free.acquire()  # (returns at once: nothing in flight)
                self._run_inline(loop, request)
            else:
                await self._enqueue(loop, request)
            return await request.future
        finally:
            self._pending -= 1

    def _may_inline(self, now: float) -> bool:
        """Whether a lone request may run on the loop's thread: the model runs requests alone,
        has been idle for a while, and its recent runs were short."""
        if not self.inline_max_s or now < self._busy_until or self._running or self._waiting:
            return False
        if now - self._last_end < _IDLE_GAP_S:
            return False
        if self._free is None or self._free.locked() or len(self._run_times) < _RUN_TIMES_KEPT:
            return False  # (not enough runs yet to know: the first ones capture graphs, tune)
        return sorted(self._run_times)[_RUN_TIMES_KEPT // 2] <= self.inline_max_s

    def _run_inline(self, loop: asyncio.AbstractEventLoop, request: _Request) -> None:
        """Run ``request`` here, on the loop's thread (an instance's permit is held), and hand
        out its results as a worker's run would."""
        start = time.perf_counter()
        run = loop.create_future()
        try:
            run.set_result(self._run([request.feeds]))
        except Exception as exc:  # (its request fails; the batcher goes on)
            run.set_exception(exc)
        self.inline_runs += 1
        if not self._ran_inline_this_turn:  # (cleared by the loop's next turn)
            self._ran_inline_this_turn = True
            loop.call_soon(self._next_turn)
        self._ran([request], start, run)

    def _next_turn(self) -> None:
        self._ran_inline_this_turn = False

    async def _enqueue(self, loop: asyncio.AbstractEventLoop, request: _Request) -> None:
        """Hand ``request`` to a worker thread: at once when it runs alone and an instance is
        free with nobody ahead, else through the scheduler."""
        if (
            not self.gather
            and not self._waiting
            and self._free is not None
            and not self._free.locked()
        ):
            # Each request runs alone, an instance is free and nobody is ahead: what the
            # scheduler would do at once, done here without its turn of the loop (a request at
            # concurrency 1 pays every turn). (With dynamic batching the scheduler's turn is
            # what lets requests that arrive together share a run.)
            await self._free.acquire()  # (returns at once: not locked)
            self._launch(loop, [request])
        else:
            assert self._arrived is not None
            self._waiting.append(request)
            self._arrived.set()

    async def close(self) -> None:
        """Finish what is queued and running, then stop the scheduler."""
        self._closed = True
        while self._waiting or self._running:
            await asyncio.sleep(0.001)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._threads is not None:
            self._threads.shutdown(wait=False)

    # ------------------------------------------------------------------ workers
    def _target(self, rows: int) -> int:
        """The batch size to gather up to: the largest preferred size reachable, else the
        largest allowed."""
        for p in reversed(self.preferred):
            if p >= rows:
                return p if p <= self.max_batch else self.max_batch
        return self.max_batch

    def _take(self, first: _Request) -> list[_Request]:
        """``first`` and the waiting requests that fit beside it, in arrival order."""
        chosen, rows, key = [first], first.batch, first.key
        if not self.gather:
            return chosen
        target = self._target(rows)
        kept: deque[_Request] = deque()
        while self._waiting:
            r = self._waiting.popleft()
            if rows + r.batch <= target and r.key == key and not r.future.cancelled():
                chosen.append(r)
                rows += r.batch
            else:
                kept.append(r)
        kept.extend(self._waiting)
        self._waiting = kept
        return chosen

    async def _schedule(self) -> None:
        """One scheduler: wait for a free instance, form a batch, run it on that instance.
        While every instance is busy, requests gather, so batches grow with the load."""
        assert self._arrived is not None and self._free is not None
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            await self._free.acquire()  # (while every instance is busy, requests gather)
            if not self._waiting:  # (cancelled meanwhile)
                self._free.release()
                continue
            first = self._waiting.popleft()
            if first.future.cancelled():
                self._free.release()
                continue
            deadline = first.arrived + self.max_delay_s
            target = self._target(first.batch)
            # wait for more until the batch is full or the delay has passed
            while self.gather and self.max_delay_s > 0:
                rows = first.batch + sum(r.batch for r in self._waiting if r.key == first.key)
                left = deadline - time.perf_counter()
                if rows >= target or left <= 0:
                    break
                self._arrived.clear()
                if left > _TIMER_SLACK:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._arrived.wait(), left - _TIMER_SLACK)
                else:  # (the loop's timers wake up to a millisecond late: poll the rest)
                    await asyncio.sleep(0)
            self._launch(loop, self._take(first))

    def _launch(self, loop: asyncio.AbstractEventLoop, batch: list[_Request]) -> None:
        """Run ``batch`` on a worker thread (an instance's permit is held); :meth:`_ran` hands
        out the results and frees the permit."""
        start = time.perf_counter()
        run = loop.run_in_executor(self._threads, self._run, [r.feeds for r in batch])
        self._running.add(run)
        run.add_done_callback(functools.partial(self._ran, batch, start))

    def _ran(self, batch: list[_Request], start: float, run: asyncio.Future) -> None:
        self._running.discard(run)
        self._last_end = time.perf_counter()
        assert self._free is not None
        self._free.release()
        exc = asyncio.CancelledError() if run.cancelled() else run.exception()
        if exc is not None:  # the batch's requests fail; the worker goes on
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)
            return
        parts = run.result()
        compute = time.perf_counter() - start
        self._run_times.append(compute)
        rows = sum(r.batch for r in batch)
        self.stats.sizes.append(rows)
        self.stats.requests.append(len(batch))
        if self._on_batch is not None:  # (rows, each request's queue seconds, compute seconds)
            self._on_batch(rows, [start - r.arrived for r in batch], compute)
        for r, mine in zip(batch, parts):
            if not r.future.done():
                r.future.set_result(mine)
