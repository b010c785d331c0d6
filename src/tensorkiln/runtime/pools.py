"""Device memory pools that outlive the contexts using them.

Each cuda execution context places its activations in a memory pool of its own (and captures its
CUDA graphs into another). torch frees a ``torch.cuda.MemPool``'s memory when the Python object
dies, and a pool destroyed while other threads allocate, or while blocks of it still wait on
another stream before they can be freed, can abort the whole process (torch 2.11: contexts that
died on worker threads did). So pools are never destroyed here: a dead context's pool goes back
to a free list, after its stream has finished, and the next context on that device takes it,
with whatever memory it already holds. The number of pools is therefore the largest number of
contexts alive at once, and their memory stays reserved for the contexts to come.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

_lock = threading.Lock()
_free: dict[tuple[str, int], list[Any]] = {}  # (kind, device index) -> idle pools


def _key(kind: str, device: Any) -> tuple[str, int]:
    import torch

    index = torch.device(device).index
    return kind, torch.cuda.current_device() if index is None else index


def acquire(device: Any, kind: str = "activations") -> Any:
    """An idle pool of ``kind`` on ``device``, or a new one (None where torch has no MemPool)."""
    import torch

    if not hasattr(torch.cuda, "MemPool"):
        return None
    key = _key(kind, device)
    with _lock:
        idle = _free.get(key)
        if idle:
            return idle.pop()
    with torch.cuda.device(key[1]):
        pool = torch.cuda.MemPool()
    # one reference that is never dropped: not even the interpreter's shutdown destroys the pool
    # (the driver takes the memory back when the process ends)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))
    return pool


def release(pool: Any, device: Any, kind: str = "activations", stream: Any = None) -> None:
    """Give ``pool`` back for reuse, once ``stream`` (the last user's) has finished its work."""
    if pool is None:
        return
    if stream is not None:
        stream.synchronize()
    with _lock:
        _free.setdefault(_key(kind, device), []).append(pool)
