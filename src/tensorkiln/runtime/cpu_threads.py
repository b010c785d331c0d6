"""How many threads the cpu backend's runs use, chosen by measurement once per input shape.

torch runs each layer's kernel on its OpenMP threads, with a fork and a join per layer. On a
small network at batch 1 (MobileNetV3-Small: 74 layers of tens of microseconds each) the
fork/join costs more than the second core gives back: 4.0 ms on 1 thread against 8.0 ms on 2
on a 2-core machine (EfficientNet-B0: 16.5 against 19.5 ms). On large layers (batch 16, BERT, ResNet-50) every core pays. So a context
times its first runs at each new set of input shapes on 1 thread and on torch's current count,
and keeps the faster for later runs at those shapes. Runs slower than ``_MEASURE_BELOW_S`` (twice:
the very first run of an engine also uploads and packs its weights) are not measured: their
layers are large enough for every thread to pay, and measuring them would cost seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

_MEASURE_BELOW_S = 0.05  # runs longer than this keep torch's thread count
_ROUNDS = 4  # alternating runs per count when measuring
_GAIN = 0.95  # 1 thread is kept only when at most this fraction of the time of all threads


class ThreadChoice:
    """Runs a function at the number of torch threads measured best for its key (the inputs'
    shapes): torch's current count (:func:`torch.get_num_threads`, the upper bound: set it
    lower and that is what runs) or 1.

    ``torch.set_num_threads`` is process-wide: a run at 1 thread sets it for the run and
    restores the previous count after, so code outside the run sees its own setting. The
    caller holds the runtime's enqueue lock, so no other context of this process switches it
    meanwhile; other torch work on other Python threads would run at 1 thread during such a run.
    """

    def __init__(self) -> None:
        self._best: dict[Hashable, int] = {}
        self._slow: set[Hashable] = set()  # keys whose first run was too slow to measure
        self._lock = threading.Lock()

    def chosen(self, key: Hashable) -> int | None:
        """The thread count measured best for ``key`` (None before the first run with it)."""
        return self._best.get(key)

    def run(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """``fn()`` at the thread count chosen for ``key``, measured first when new."""
        import torch  # (an optional dependency: only the cpu backend gets here)

        most = torch.get_num_threads()
        n = self._best.get(key)
        if n is not None:
            return _at_threads(min(n, most), fn)
        t0 = time.perf_counter()
        result = fn()
        if most == 1:
            n = most
        elif time.perf_counter() - t0 > _MEASURE_BELOW_S:
            # (a first run also uploads and packs weights: slow once is not slow; twice is)
            if key not in self._slow:
                self._slow.add(key)
                return result
            n = most
        else:
            n = _measure(fn, most)
        with self._lock:
            self._best.setdefault(key, n)
        return result


def _at_threads(n: int, fn: Callable[[], Any]) -> Any:
    import torch

    before = torch.get_num_threads()
    if n == before:
        return fn()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _timed(n: int, fn: Callable[[], Any]) -> float:
    # (the switch of thread count is in the time: it is paid at every run at 1 thread)
    t0 = time.perf_counter()
    _at_threads(n, fn)
    return time.perf_counter() - t0


def _measure(fn: Callable[[], Any], most: int) -> int:
    """1 or ``most``: the faster, alternating the two to share the machine's noise. The fastest
    run of each counts: other work on the machine only ever adds time, and it swayed medians
    (EfficientNet-B0 at batch 1 kept 2 threads in some measurements and 1 in others)."""
    one: list[float] = []
    all_: list[float] = []
    _at_threads(1, fn)  # untimed: oneDNN makes its kernels for a thread count at the first call
    for i in range(_ROUNDS):  # (each count first in every other round)
        if i % 2:
            all_.append(_timed(most, fn))
        one.append(_timed(1, fn))
        if not i % 2:
            all_.append(_timed(most, fn))
    return 1 if min(one) <= _GAIN * min(all_) else most
