"""Backend-neutral checks and geometry of the pools (MaxPool, AveragePool, LpPool)."""

from __future__ import annotations

from collections.abc import Sequence

from tensorkiln.kernels.common.window import Geometry, geometry


def pool_geometry(
    shape: Sequence[int], op: str, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode
) -> Geometry:
    """The window geometry of ``op`` over an input of ``shape`` (N, C, D1, ...)."""
    shape = tuple(shape)
    if len(shape) < 3:
        raise ValueError(f"{op}: input must be (N, C, D1, ...), got shape {shape}")
    if not kernel_shape:
        raise ValueError(f"{op}: the kernel_shape attribute is required")
    if len(kernel_shape) != len(shape) - 2:
        raise ValueError(
            f"{op}: kernel_shape {tuple(kernel_shape)} has {len(kernel_shape)} axes but the input "
            f"of shape {shape} has {len(shape) - 2} spatial axes"
        )
    return geometry(shape[2:], kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
