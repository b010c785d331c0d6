"""Sliding-window geometry shared by the convolution and pooling kernels of every backend: the
op-level geometry (:mod:`tensorkiln.ops.window`) and the input slices one kernel tap reads. It
reads shapes and attributes only, so numpy, torch and Triton kernels share it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorkiln.ops.window import Geometry, geometry, ints

__all__ = ["Geometry", "geometry", "ints", "tap_slices"]


def tap_slices(g: Geometry, tap: Sequence[int]) -> tuple[slice, ...]:
    """Slices of the padded input that one kernel tap reads for every output position."""
    return tuple(
        slice(t * d, t * d + (o - 1) * s + 1, s)
        for t, d, o, s in zip(tap, g.dilations, g.out, g.strides)
    )
