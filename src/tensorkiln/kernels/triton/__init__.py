"""Triton kernels of the cuda backend: the generated alternatives the autotuner times.

The kernels run on CUDA tensors, or on CPU tensors through Triton's interpreter when
``TRITON_INTERPRET=1`` (the test suite sets it when there is no GPU). This package imports without
Triton installed; :func:`available` then returns False and no Triton tactic is registered.

The precision of float32 dot products is a per-engine choice: the builder calls
:func:`set_fp32_dot_precision` with ``"tf32"`` for engines built with TF32 allowed.
"""

from __future__ import annotations

import functools
import os

_PRECISIONS = ("ieee", "tf32")
_fp32_dot_precision = "ieee"


@functools.cache
def available() -> bool:
    """Whether Triton can be imported."""
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run through the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def set_fp32_dot_precision(precision: str) -> None:
    """How float32 dot products multiply: ``"ieee"`` (exact float32) or ``"tf32"`` (tensor cores)."""
    global _fp32_dot_precision
    if precision not in _PRECISIONS:
        raise ValueError(f"fp32 dot precision must be one of {_PRECISIONS}, not {precision!r}")
    _fp32_dot_precision = precision


def fp32_dot_precision() -> str:
    """The precision float32 dot products use now (``"ieee"`` unless set)."""
    return _fp32_dot_precision
