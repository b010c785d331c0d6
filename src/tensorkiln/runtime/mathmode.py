"""The math mode an engine's layers run under: TF32 on or off for cuBLAS, cuDNN and Triton dots,
and float32 accumulation in cuBLAS's fp16/bf16 GEMMs (torch lets cuBLAS reduce split-K partial
sums in the reduced type by default, where large sums can overflow or lose precision).

torch keeps these switches process-wide; an engine sets them for the span of each run (and of its
build's tuning) and restores what it found, so engines of different precisions share a process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tensorkiln.kernels import triton as tk_triton  # (imports without Triton itself)


@contextlib.contextmanager
def math_mode(precision: str) -> Iterator[None]:
    import torch

    tf32 = precision == "tf32"
    matmul = torch.backends.cuda.matmul
    saved = (
        matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        matmul.allow_fp16_reduced_precision_reduction,
        matmul.allow_bf16_reduced_precision_reduction,
    )
    matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_bf16_reduced_precision_reduction = False
    triton_saved = _set_triton_dot("tf32" if tf32 else "ieee")
    try:
        yield
    finally:
        (
            matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction,
        ) = saved
        if triton_saved is not None:
            _set_triton_dot(triton_saved)


def _set_triton_dot(mode: str) -> str | None:
    """Set the Triton kernels' float32 dot precision; returns the previous one (None: no Triton)."""
    getter = getattr(tk_triton, "fp32_dot_precision", None)
    setter = getattr(tk_triton, "set_fp32_dot_precision", None)
    if getter is None or setter is None:
        return None
    before = getter()
    setter(mode)
    return before
