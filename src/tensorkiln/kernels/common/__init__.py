"""Backend-neutral kernel helpers: validation, geometry and attribute checks written once and used
by every kernel tree (reference, cuda, cpu, triton), and ops whose math is the same on every
backend written once over a small array adapter each tree supplies (rnn, control, attention,
deform, sampling, ...). Nothing here imports numpy-only or torch-only code paths; a module is
named after the kernel family it serves (conv, pool, rnn, ...)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def bind(entry: Callable[..., Any], xp: Any, module: str) -> functools.partial:
    """``entry`` (an op entry written once, whose first argument is a backend's arrays adapter)
    over ``xp``, named as a kernel of ``module`` (engines record a layer's kernel by module and
    name). A partial keeps the entry's signature, which the registry reads the keywords from,
    and takes a backend's ``specialize`` hook as an attribute (a bound method would not)."""
    kernel = functools.partial(entry, xp)
    kernel.__name__ = kernel.__qualname__ = entry.__name__  # type: ignore[attr-defined]
    kernel.__module__ = module
    kernel.__doc__ = entry.__doc__
    return kernel
