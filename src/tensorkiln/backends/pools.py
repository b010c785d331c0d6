"""Device memory pools that outlive the contexts using them, each with the stream that uses it.

Each cuda execution context places its activations in a memory pool of its own (and captures its
CUDA graphs into another). torch frees a ``torch.cuda.MemPool``'s memory when the Python object
dies, and a pool destroyed while other threads allocate, or while blocks of it still wait on
another stream before they can be freed, can abort the whole process (torch 2.11: contexts that
died on worker threads did). So pools are never destroyed here: a dead context's pool goes back
to a free list, after its stream has finished, and the next context on that device takes it,
with whatever memory it already holds. The number of pools is therefore the largest number of
contexts alive at once, and their memory stays reserved for the contexts to come.

torch's allocator hands a free block only to allocations on the stream that freed it, so a pool
travels with its stream: the context that takes a pool runs on that pool's stream, and finds all
of the pool's memory usable.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

_lock = threading.Lock()
_free: dict[tuple[str, int], list[tuple[Any, Any]]] = {}  # (kind, device) -> idle (pool, stream)
# Pairs given back while this thread captured a CUDA graph (a context collected during another's
# capture): waiting on their streams then would break the capture, so they wait until the next
# acquire outside one.
_pending: list[tuple[tuple[str, int], Any, Any]] = []


def _key(kind: str, device: Any) -> tuple[str, int]:
    import torch

    index = torch.device(device).index
    return kind, torch.cuda.current_device() if index is None else index


def acquire(device: Any, kind: str = "activations") -> tuple[Any, Any]:
    """An idle pool of ``kind`` on ``device`` and its stream, or new ones (the pool is None where
    torch has no MemPool)."""
    import torch

    key = _key(kind, device)
    _settle()
    with _lock:
        idle = _free.get(key)
        if idle:
            return idle.pop()
    with torch.cuda.device(key[1]):
        stream = torch.cuda.Stream(key[1])
        if not hasattr(torch.cuda, "MemPool"):
            return None, stream
        pool = torch.cuda.MemPool()
    # one reference that is never dropped: not even the interpreter's shutdown destroys the pool
    # (the driver takes the memory back when the process ends)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))
    return pool, stream


def release(pool: Any, stream: Any, device: Any, kind: str = "activations") -> None:
    """Give ``pool`` and ``stream`` back for reuse, once the stream has finished its work."""
    key = _key(kind, device)
    if _capturing():
        with _lock:
            _pending.append((key, pool, stream))
        return
    _give_back(key, pool, stream)


def _give_back(key: tuple[str, int], pool: Any, stream: Any) -> None:
    """``pool`` and ``stream`` onto the free list of ``key`` once the stream has finished."""
    stream.synchronize()
    if pool is not None:
        with _lock:
            _free.setdefault(key, []).append((pool, stream))


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _settle() -> None:
    """The pairs given back during a capture, onto the free list once their streams finish."""
    if not _pending or _capturing():
        return
    with _lock:
        waiting = list(_pending)
        _pending.clear()
    for key, pool, stream in waiting:
        _give_back(key, pool, stream)
