"""Servers for the tests: one on an event loop in a thread of its own, on a free port."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tensorkiln.serve.core import ServerCore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving_with(
    repo: Path,
    start: Callable[[ServerCore, int], Awaitable[Callable[[], Awaitable[Any]]]],
    **core_kw: Any,
) -> Iterator[tuple[str, ServerCore]]:
    """``start(core, port)`` run on a loop in a thread (it returns the coroutine function that
    stops what it started); yields ("127.0.0.1:port", core), and stops and drains at the end."""
    port = free_port()
    core = ServerCore(repo, **core_kw)
    started = threading.Event()
    holder: dict[str, Any] = {}

    def main() -> None:
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        holder["stop"] = loop.run_until_complete(start(core, port))
        started.set()
        loop.run_forever()
        loop.run_until_complete(holder["stop"]())
        loop.run_until_complete(core.close())
        loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert started.wait(60), "the server did not start"
    try:
        yield f"127.0.0.1:{port}", core
    finally:
        holder["loop"].call_soon_threadsafe(holder["loop"].stop)
        thread.join(30)


def samples(metrics: Any, family: str) -> dict[tuple, float]:
    """A metric family's samples in a server's registry: sorted labels -> value."""
    out: dict[tuple, float] = {}
    if family.startswith("nv_inference"):  # (Triton's counters, kept outside the registry)
        return {
            (("model", m), ("version", v)): value
            for (m, v), value in metrics.counter_values(family).items()
        }
    for metric in metrics.registry.collect():
        for s in metric.samples:
            if s.name == family:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def wait_until(ready: Callable[[], bool], proc: Any = None, seconds: float = 120) -> None:
    """Poll ``ready()`` (an exception counts as not yet) until it is true; fail when ``proc``
    (a server process) exits first or ``seconds`` pass."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            if ready():
                return
        except Exception:  # (not listening yet)
            pass
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if getattr(proc, "stdout", None) else ""
            raise AssertionError(f"the server exited with {proc.returncode}: {out}")
        assert time.monotonic() < deadline, f"not ready within {seconds} s"
        time.sleep(0.2)
