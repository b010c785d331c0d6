"""Checks of the index-driven ops, written once for both kernel trees (shapes and attributes
only, never values)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

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


class ScatterArrays(Protocol):
    """The array operations TensorScatter needs, on one backend's arrays."""

    def starts(self, write_indices: Any, batch: int, like: Any) -> Any:
        """Each batch entry's first write position (int64, 0 without ``write_indices``)."""

    def arange(self, n: int, like: Any) -> Any: ...

    def bound(self, pos: Any, max_len: int) -> Any:
        """``pos`` kept inside the cache's sequence length: an error on the host; clamped on the
        device, where checking would read the positions back."""

    def write_rows(self, cache: Any, axis: int, pos: Any, update: Any) -> Any:
        """A copy of ``cache`` with ``update``'s rows along ``axis`` written at ``pos`` (batch,
        seq) for every batch entry."""

    def scatter_along(self, data: Any, indices: Any, updates: Any, axis: int, reduction: str):
        """A copy of ``data`` with ``updates`` written (or reduced) at ``indices`` along the
        checked, non-negative ``axis`` (ScatterElements)."""


class TensorScatter:
    """TensorScatter (a KV-cache update) over one backend's :class:`ScatterArrays`."""

    def __init__(self, xp: ScatterArrays) -> None:
        self.xp = xp

    def tensor_scatter(
        self,
        past_cache: Any,
        update: Any,
        write_indices: Any = None,
        *,
        mode: str = "linear",
        axis: int = -2,
    ) -> Any:
        """KV-cache update: write ``update`` into a copy of ``past_cache`` along the sequence
        ``axis`` from ``write_indices[b]`` (0 by default) per batch entry; ``circular`` wraps
        around."""
        xp = self.xp
        axis = tensor_scatter_axis(past_cache.shape, update.shape, axis, mode)
        batch, max_len, seq = past_cache.shape[0], past_cache.shape[axis], update.shape[axis]
        starts = xp.starts(write_indices, batch, past_cache)
        pos = starts.reshape(-1, 1) + xp.arange(seq, past_cache)
        pos = pos % max_len if mode == "circular" else xp.bound(pos, max_len)
        return xp.write_rows(past_cache, axis, pos, update)


def check_nd_indices(
    data_shape: Sequence[int], indices_shape: Sequence[int], batch_dims: int, op: str
) -> int:
    """GatherND/ScatterND: the length of an index tuple, after checking that ``indices`` can
    index ``data`` past its ``batch_dims`` leading (shared) axes."""
    data, indices, b = tuple(data_shape), tuple(indices_shape), batch_dims
    k = indices[-1] if indices else 0
    if len(indices) < 1 or k > len(data) - b:
        raise ValueError(
            f"{op}: indices of shape {list(indices)} cannot index data of shape {list(data)} "
            f"with batch_dims={b}"
        )
    if data[:b] != indices[:b]:
        raise ValueError(
            f"{op}: batch dimensions differ: data {list(data[:b])} vs indices {list(indices[:b])}"
        )
    return k


def scatter_elements_axis(
    data_shape: Sequence[int], indices_shape: Sequence[int], updates_shape: Sequence[int], axis: int
) -> int:
    """ScatterElements' ``axis``, normalized, after checking that updates and indices agree."""
    axis = norm_axis(axis, len(data_shape), "ScatterElements")
    if tuple(updates_shape) != tuple(indices_shape):
        raise ValueError(
            f"ScatterElements: updates shape {list(updates_shape)} != indices shape "
            f"{list(indices_shape)}"
        )
    return axis


class ElementScatter:
    """ScatterElements and its opset-9 form Scatter over one backend's :class:`ScatterArrays`."""

    def __init__(self, xp: ScatterArrays) -> None:
        self.xp = xp

    def scatter_elements(
        self, data: Any, indices: Any, updates: Any, *, axis: int = 0, reduction: str = "none"
    ) -> Any:
        """A copy of ``data`` with ``updates`` written (or reduced) at ``indices`` along
        ``axis``."""
        axis = scatter_elements_axis(data.shape, indices.shape, updates.shape, axis)
        return self.xp.scatter_along(data, indices, updates, axis, reduction)

    def scatter(self, data: Any, indices: Any, updates: Any, *, axis: int = 0) -> Any:
        """Scatter (deprecated in opset 11): ScatterElements without reduction."""
        return self.scatter_elements(data, indices, updates, axis=axis)
