"""Checks of the index-driven ops, written once for both kernel trees (shapes and attributes
only, never values)."""

from __future__ import annotations

from collections.abc import Sequence

from tensorkiln.kernels.common.tensor import norm_axis


def tensor_scatter_axis(shape: Sequence[int], update: Sequence[int], axis: int, mode: str) -> int:
    """TensorScatter's sequence axis, normalized, after checking the mode and that ``update``
    fits the cache ``shape`` on every other axis and is no longer along this one."""
    rank = len(shape)
    axis = norm_axis(axis, rank, "TensorScatter")
    if axis == 0:
        raise ValueError("TensorScatter: the sequence axis cannot be the batch axis 0")
    if mode not in ("linear", "circular"):
        raise ValueError(f"TensorScatter: unknown mode '{mode}' (linear or circular)")
    if (
        len(update) != rank
        or any(update[d] != shape[d] for d in range(rank) if d != axis)
        or update[axis] > shape[axis]
    ):
        raise ValueError(
            f"TensorScatter: update shape {list(update)} does not fit cache shape {list(shape)} "
            f"on axis {axis}"
        )
    return axis
