"""Sliding-window geometry of convolution and pooling: an op fact, read by the shape rules and
by the kernels of every backend.

It resolves ``auto_pad`` / ``pads`` / ``ceil_mode`` of a node on channels-first tensors
``(N, C, D1, ..., Dn)`` into begin and end pads and output sizes. It reads shapes and attributes
only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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

    @property
    def pointwise(self) -> bool:
        """A 1x1 window with unit strides and no padding: a convolution of it is a GEMM over
        the pixels (dilation does not matter to a 1x1 window)."""
        return (
            all(k == 1 for k in self.kernel)
            and all(s == 1 for s in self.strides)
            and (not self.padded)
        )


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
