"""Sliding-window geometry shared by the convolution and pooling kernels.

Everything here works on channels-first tensors ``(N, C, D1, ..., Dn)``: it resolves ``auto_pad`` /
``pads`` / ``ceil_mode`` into begin and end pads and output sizes, pads a tensor, and builds
zero-copy strided views of the windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from numpy.lib.stride_tricks import as_strided


@dataclass(frozen=True, slots=True)
class Geometry:
    """Window geometry along the spatial axes."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]  # padding before each axis
    end: tuple[int, ...]  # padding after each axis (ceil_mode's extra rows included)
    out: tuple[int, ...]  # output size along each axis
    explicit_end: tuple[int, ...] = ()  # the end padding asked for, without ceil_mode's extra

    @property
    def padded(self) -> bool:
        return any(self.begin) or any(self.end)


def ints(values: Sequence[int] | None, n: int, default: int, what: str) -> tuple[int, ...]:
    """``values`` as a tuple of ``n`` ints (``default`` repeated when absent)."""
    if values is None or len(values) == 0:
        return (default,) * n
    if len(values) != n:
        raise ValueError(f"{what} has {len(values)} values but the input has {n} spatial axes")
    return tuple(int(v) for v in values)


def geometry(
    in_sizes: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int] | None = None,
    dilations: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
) -> Geometry:
    """Resolve the padding attributes of a conv/pool node into a :class:`Geometry`."""
    n = len(in_sizes)
    kernel = ints(kernel, n, 1, "kernel_shape")
    strides = ints(strides, n, 1, "strides")
    dilations = ints(dilations, n, 1, "dilations")
    eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-i // s) for i, s in zip(in_sizes, strides)]
        total = [max(0, (o - 1) * s + e - i) for o, s, e, i in zip(out, strides, eff, in_sizes)]
        small = [t // 2 for t in total]
        big = [t - t // 2 for t in total]
        begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    elif auto_pad == "VALID":
        begin = end = [0] * n
        out = [(i - e) // s + 1 for i, e, s in zip(in_sizes, eff, strides)]
    elif auto_pad in ("NOTSET", ""):
        pads = ints(pads, 2 * n, 0, "pads")
        begin, end = list(pads[:n]), list(pads[n:])
        span = [i + b + a - e for i, b, a, e in zip(in_sizes, begin, end, eff)]
        if ceil_mode:
            out = [-(-p // s) + 1 for p, s in zip(span, strides)]
            # the last window must start inside the input or the begin padding
            out = [
                o - 1 if (o - 1) * s >= i + b else o
                for o, s, i, b in zip(out, strides, in_sizes, begin)
            ]
        else:
            out = [p // s + 1 for p, s in zip(span, strides)]
    else:
        raise ValueError(
            f"auto_pad must be NOTSET, SAME_UPPER, SAME_LOWER or VALID, not {auto_pad!r}"
        )
    if any(o <= 0 for o in out):
        raise ValueError(
            f"input spatial size {tuple(in_sizes)} is too small for kernel {kernel} with "
            f"dilations {dilations} and pads {tuple(begin) + tuple(end)}"
        )
    # grow the end padding so that every window (ceil_mode's last one too) lies inside
    asked = tuple(end)
    end = [
        max(a, (o - 1) * s + e - i - b)
        for a, o, s, e, i, b in zip(end, out, strides, eff, in_sizes, begin)
    ]
    return Geometry(kernel, strides, dilations, tuple(begin), tuple(end), tuple(out), asked)


def pad(x: np.ndarray, begin: Sequence[int], end: Sequence[int], value: float = 0) -> np.ndarray:
    """Pad the trailing ``len(begin)`` axes of ``x`` with ``value`` (``x`` itself if no padding)."""
    if not any(begin) and not any(end):
        return x
    lead = x.ndim - len(begin)
    shape = x.shape[:lead] + tuple(s + b + e for s, b, e in zip(x.shape[lead:], begin, end))
    out = np.full(shape, value, dtype=x.dtype)
    inner = tuple(slice(b, b + s) for b, s in zip(begin, x.shape[lead:]))
    out[(Ellipsis, *inner)] = x
    return out


def windows(xp: np.ndarray, g: Geometry, kernel_first: bool = False) -> np.ndarray:
    """A read-only view of the windows of the padded tensor ``xp``.

    Shape ``(*lead, *out, *kernel)``, or ``(*lead, *kernel, *out)`` with ``kernel_first``.
    """
    n = len(g.kernel)
    lead_shape, lead_strides = xp.shape[:-n], xp.strides[:-n]
    sp = xp.strides[-n:]
    out_strides = tuple(a * s for a, s in zip(sp, g.strides))
    k_strides = tuple(a * d for a, d in zip(sp, g.dilations))
    if kernel_first:
        shape, strides = (*g.kernel, *g.out), (*k_strides, *out_strides)
    else:
        shape, strides = (*g.out, *g.kernel), (*out_strides, *k_strides)
    return as_strided(xp, lead_shape + shape, lead_strides + strides, writeable=False)


def tap_slices(g: Geometry, tap: Sequence[int]) -> tuple[slice, ...]:
    """Slices of the padded input that one kernel tap reads for every output position."""
    return tuple(
        slice(t * d, t * d + (o - 1) * s + 1, s)
        for t, d, o, s in zip(tap, g.dilations, g.out, g.strides)
    )


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype to do arithmetic in: float32 for the narrow floats, else ``dtype`` itself."""
    if dtype == np.float16 or dtype == ml_dtypes.bfloat16 or dtype.itemsize == 1:
        return np.dtype(np.float32)
    return np.dtype(dtype)
