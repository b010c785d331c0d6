"""Values derived from one tensor, computed once for all the layers of a run that read it.

Every attention layer of a model reads the same mask tensor, and the kernels derive the same
thing from it each time: the flash kernel's per-row key bounds, FlashAttention-2's cumulative
sequence lengths. Inside :func:`scope` (the executor enters one per run of an engine),
:func:`derived` keeps the derived value with the source tensor object until the run ends; outside
a scope (a kernel called on its own, the autotuner timing one layer) it computes every time.

Why per run: within a run the engine's tensors change only through its own kernels (in-place
writes bump a tensor's version, and a changed version recomputes); between runs a caller may
rewrite an input tensor in ways torch does not see (a kernel of their own writing its memory).
Inside one CUDA graph capture the layers share the mask object, so the capture records the
derivation once and every replay recomputes it before the layers that read it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

_local = threading.local()


@contextmanager
def scope() -> Iterator[None]:
    """Derived values kept for the block (nested scopes share the outermost one's)."""
    if getattr(_local, "cache", None) is not None:
        yield
        return
    _local.cache = {}
    try:
        yield
    finally:
        _local.cache = None


def derived(source: Any, key: Hashable, make: Callable[[], T]) -> T:
    """``make()``, or inside a :func:`scope` the value it gave there for this ``source`` object
    and ``key`` while ``source`` has not been written since."""
    cache: dict | None = getattr(_local, "cache", None)
    if cache is None:
        return make()
    version = getattr(source, "_version", 0)
    slot = (id(source), key)
    hit = cache.get(slot)
    if hit is not None and hit[0] is source and hit[1] == version:
        return hit[2]
    value = make()
    cache[slot] = (source, version, value)  # (the source held: its id is not reused meanwhile)
    return value
