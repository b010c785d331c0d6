"""Backend-neutral checks and geometry of the pools (MaxPool, AveragePool, LpPool), LpPool's
powers, and MaxUnpool written once."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

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


def pow_p(m: Any, x: Any, p: float) -> Any:
    """|x|^p for LpPool (``m``: numpy or torch)."""
    return x * x if p == 2 else m.abs(x) ** p


def root_p(m: Any, x: Any, p: float) -> Any:
    """x^(1/p), LpPool's last step (``m``: numpy or torch)."""
    return m.sqrt(x) if p == 2 else x ** (1.0 / p)


class UnpoolArrays(Protocol):
    """The array operations MaxUnpool needs, on one backend's arrays."""

    int64: Any

    def zeros(self, shape: tuple[int, ...], like: Any) -> Any:
        """Zeros of ``shape`` with ``like``'s dtype and device."""

    def astype(self, x: Any, dtype: Any) -> Any: ...

    def host_ints(self, v: Any) -> list[int]:
        """A small integer input (a shape), read on the host."""


def _unpool_shape(x_shape, i_shape, kernel_shape, pads, strides) -> tuple[int, ...]:
    """MaxUnpool's inferred output shape; ValueError when X and I or the attributes do not fit."""
    x_shape, i_shape = tuple(x_shape), tuple(i_shape)
    if x_shape != i_shape:
        raise ValueError(f"MaxUnpool: X of shape {x_shape} and I of shape {i_shape} differ")
    if not kernel_shape:
        raise ValueError("MaxUnpool: the kernel_shape attribute is required")
    nsp = len(x_shape) - 2
    st = list(strides or [1] * nsp)
    pd = list(pads or [0] * (2 * nsp))
    sp = [
        (i - 1) * s + k - b - e
        for i, s, k, b, e in zip(x_shape[2:], st, kernel_shape, pd[:nsp], pd[nsp:])
    ]
    return (*x_shape[:2], *sp)


class MaxUnpool:
    """MaxUnpool over one backend's :class:`UnpoolArrays`."""

    def __init__(self, xp: UnpoolArrays) -> None:
        self.xp = xp

    def max_unpool(
        self,
        x: Any,
        indices: Any,
        output_shape: Any = None,
        *,
        kernel_shape: Sequence[int] | None = None,
        pads: Sequence[int] | None = None,
        strides: Sequence[int] | None = None,
    ) -> Any:
        """Scatter ``x`` to the flat positions ``indices`` (MaxPool's) of a zero tensor."""
        xp = self.xp
        shape = _unpool_shape(x.shape, indices.shape, kernel_shape, pads, strides)
        size = math.prod(shape)
        flat = xp.astype(indices.reshape(-1), xp.int64)
        # an index outside the output would write past it (on the device: a fault), so check
        if flat.shape[0] and (int(flat.min()) < 0 or int(flat.max()) >= size):
            raise ValueError(f"MaxUnpool: an index in I lies outside the output of shape {shape}")
        y = xp.zeros((size,), x)
        y[flat] = x.reshape(-1)
        y = y.reshape(shape)
        if output_shape is None:
            return y
        # the indices address the inferred shape; output_shape only adds zeros at the ends
        wanted = tuple(xp.host_ints(output_shape))
        if len(wanted) != len(shape):
            raise ValueError(f"MaxUnpool: output_shape {wanted} must have rank {len(shape)}")
        out = xp.zeros(wanted, x)
        common = tuple(slice(0, min(a, b)) for a, b in zip(wanted, shape))
        out[common] = y[common]
        return out
