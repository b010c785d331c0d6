"""Reference kernels driven by index tensors: gathers, scatters, OneHot, NonZero, Unique, Compress.

Index inputs may be negative (counted from the end of their axis); an index out of range raises
IndexError naming the axis and its size. Everything is vectorized with numpy fancy indexing.
TensorScatter's write positions are kernels/common/indexing.py's.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.kernels.common.indexing import (
    ElementScatter,
    TensorScatter,
    check_nd_indices,
)
from tensorkiln.kernels.common.tensor import norm_axis
from tensorkiln.kernels.registry import register


def _indices(indices: np.ndarray, size: int, op: str, axis: int | str) -> np.ndarray:
    """``indices`` as int64 with negatives wrapped; IndexError when any is outside [-size, size)."""
    idx = np.asarray(indices).astype(np.int64, copy=False)
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -size or hi >= size:
            bad = lo if lo < -size else hi
            raise IndexError(
                f"{op}: index {bad} is out of range for axis {axis} of size {size} "
                f"(valid: {-size} to {size - 1})"
            )
    return np.where(idx < 0, idx + size, idx)


def _element_index(data_shape: tuple, indices: np.ndarray, axis: int, op: str) -> tuple:
    """Index tuple for ``data[...]`` that takes ``indices`` along ``axis`` and the position
    elsewhere (GatherElements / ScatterElements); ``indices`` may be smaller than data."""
    if indices.ndim != len(data_shape):
        raise ValueError(
            f"{op}: indices of rank {indices.ndim} for data of rank {len(data_shape)} (must match)"
        )
    for d, (i, n) in enumerate(zip(indices.shape, data_shape)):
        if d != axis and i > n:
            raise ValueError(
                f"{op}: indices shape {indices.shape} exceeds data shape {data_shape} on axis {d}"
            )
    grids = list(np.ix_(*[np.arange(s) for s in indices.shape]))
    grids[axis] = _indices(indices, data_shape[axis], op, axis)
    return tuple(grids)


# ---------------------------------------------------------------------------------------------
# Gathers


@register("Gather", since=1)
def gather(data: np.ndarray, indices: np.ndarray, *, axis: int = 0) -> np.ndarray:
    """Take the slices of ``data`` at ``indices`` along ``axis``."""
    axis = norm_axis(axis, data.ndim, "Gather")
    idx = _indices(indices, data.shape[axis], "Gather", axis)
    return np.asarray(np.take(data, idx, axis=axis))


@register("GatherElements", since=11)
def gather_elements(data: np.ndarray, indices: np.ndarray, *, axis: int = 0) -> np.ndarray:
    """``out[i][j] = data[indices[i][j]][j]`` (for axis 0); the output is shaped like indices."""
    axis = norm_axis(axis, data.ndim, "GatherElements")
    return data[_element_index(data.shape, indices, axis, "GatherElements")]


def _nd_index(data: np.ndarray, indices: np.ndarray, batch_dims: int, op: str):
    """Flattened GatherND/ScatterND addressing: (data as (B, ...), index tuple, result prefix)."""
    b = batch_dims
    k = check_nd_indices(data.shape, indices.shape, b, op)
    batch = int(np.prod(data.shape[:b], dtype=np.int64))
    rows = int(np.prod(indices.shape[b:-1], dtype=np.int64))
    flat = data.reshape(batch, *data.shape[b:])
    idx = indices.reshape(batch, rows, k)
    cols = [_indices(idx[..., j], data.shape[b + j], op, b + j) for j in range(k)]
    index = (np.broadcast_to(np.arange(batch)[:, None], (batch, rows)), *cols)
    return flat, index, indices.shape[:-1]


@register("GatherND", since=11)
def gather_nd(data: np.ndarray, indices: np.ndarray, *, batch_dims: int = 0) -> np.ndarray:
    """Gather slices addressed by the last axis of ``indices`` (after ``batch_dims`` batch axes)."""
    flat, index, prefix = _nd_index(data, indices, batch_dims, "GatherND")
    k = indices.shape[-1]
    out = flat[index]
    return out.reshape((*prefix, *data.shape[batch_dims + k :]))


# ---------------------------------------------------------------------------------------------
# Scatters

_REDUCERS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_into(out: np.ndarray, index: tuple, updates: np.ndarray, reduction: str, op: str):
    if reduction == "none":
        out[index] = updates
    elif reduction in _REDUCERS:
        _REDUCERS[reduction].at(out, index, updates)
    else:
        raise ValueError(f"{op}: unknown reduction '{reduction}' (none, add, mul, max or min)")


@register("ScatterND", since=11)
def scatter_nd(
    data: np.ndarray, indices: np.ndarray, updates: np.ndarray, *, reduction: str = "none"
) -> np.ndarray:
    """A copy of ``data`` with slices addressed by ``indices[..., :]`` replaced by (or reduced
    with) ``updates``."""
    flat, index, prefix = _nd_index(data, indices, 0, "ScatterND")
    k = indices.shape[-1]
    expected = (*prefix, *data.shape[k:])
    if updates.shape != expected:
        raise ValueError(
            f"ScatterND: updates shape {updates.shape} != {expected} expected from indices "
            f"{indices.shape} and data {data.shape}"
        )
    out = flat.copy()
    upd = updates.reshape(1, -1, *data.shape[k:])
    _scatter_into(out, index, upd, reduction, "ScatterND")
    return out.reshape(data.shape)


class NumpyScatterArrays:
    """:class:`tensorkiln.kernels.common.indexing.ScatterArrays` on numpy arrays."""

    def scatter_along(
        self, data: np.ndarray, indices: np.ndarray, updates: np.ndarray, axis: int, reduction: str
    ) -> np.ndarray:
        out = data.copy()
        index = _element_index(data.shape, indices, axis, "ScatterElements")
        _scatter_into(out, index, updates, reduction, "ScatterElements")
        return out

    def starts(self, write_indices: np.ndarray | None, batch: int, like: np.ndarray) -> np.ndarray:
        if write_indices is None:
            return np.zeros(batch, np.int64)
        return write_indices.astype(np.int64).reshape(-1)

    def arange(self, n: int, like: np.ndarray) -> np.ndarray:
        return np.arange(n)

    def bound(self, pos: np.ndarray, max_len: int) -> np.ndarray:
        if pos.size and (pos.min() < 0 or pos.max() >= max_len):
            raise IndexError(
                f"TensorScatter: write positions {int(pos.min())}..{int(pos.max())} fall outside "
                f"the cache's sequence length {max_len}"
            )
        return pos

    def write_rows(self, cache: np.ndarray, axis: int, pos: np.ndarray, update: np.ndarray):
        out = cache.copy()
        view = np.moveaxis(out, axis, 1)  # (batch, max_len, ...) view into out
        view[np.arange(cache.shape[0])[:, None], pos] = np.moveaxis(update, axis, 1)
        return out


_ELEMENTS = ElementScatter(NumpyScatterArrays())
register("ScatterElements", since=11)(_ELEMENTS.scatter_elements)
register("Scatter", since=9)(_ELEMENTS.scatter)
register("TensorScatter", since=24)(TensorScatter(NumpyScatterArrays()).tensor_scatter)


# ---------------------------------------------------------------------------------------------
# OneHot, NonZero, Unique, Compress, ReverseSequence


@register("OneHot", since=9)
def one_hot(
    indices: np.ndarray, depth: np.ndarray, values: np.ndarray, *, axis: int = -1
) -> np.ndarray:
    """``values[1]`` where the new ``axis`` position equals the index, ``values[0]`` elsewhere;
    indices outside [-depth, depth) give an all-off row."""
    n = int(np.asarray(depth).reshape(-1)[0])
    if n < 0:
        raise ValueError(f"OneHot: depth must be non-negative, got {n}")
    values = np.asarray(values).reshape(-1)
    if values.size != 2:
        raise ValueError(f"OneHot: values must hold [off_value, on_value], got {values.size}")
    axis = norm_axis(axis, indices.ndim + 1, "OneHot")
    idx = np.asarray(indices).astype(np.int64)
    idx = np.where(idx < 0, idx + n, idx)
    hot = idx[..., None] == np.arange(n)
    out = np.where(hot, values[1], values[0]).astype(values.dtype)
    return np.moveaxis(out, -1, axis)


@register("NonZero", since=9)
def nonzero(X: np.ndarray) -> np.ndarray:
    """Indices of the non-zero elements, shape (rank, count) int64; a scalar counts as 1-D."""
    return np.array(np.nonzero(np.atleast_1d(X)), dtype=np.int64).reshape(max(X.ndim, 1), -1)


@register("Unique", since=11)
def unique(
    X: np.ndarray, *, axis: int | None = None, sorted: int = 1, _n_outputs: int = 1
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Unique values (or slices along ``axis``), with first-occurrence indices, inverse indices
    and counts; ``sorted=0`` keeps first-occurrence order."""
    if axis is not None:
        axis = norm_axis(axis, X.ndim, "Unique")
    y, first, inverse, counts = np.unique(
        X, return_index=True, return_inverse=True, return_counts=True, axis=axis
    )
    inverse = inverse.reshape(-1)
    if not sorted:
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        y = np.take(y, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    outs = (y, *(a.astype(np.int64) for a in (first, inverse, counts)))
    return outs[0] if _n_outputs == 1 else outs[:_n_outputs]


@register("Compress", since=9)
def compress(input: np.ndarray, condition: np.ndarray, *, axis: int | None = None) -> np.ndarray:
    """The slices (or, without ``axis``, the flattened elements) where ``condition`` is true."""
    cond = np.asarray(condition).reshape(-1).astype(bool)
    if axis is not None:
        axis = norm_axis(axis, input.ndim, "Compress")
    length = input.size if axis is None else input.shape[axis]
    if cond.size > length:
        where = "the flattened input" if axis is None else f"axis {axis}"
        raise ValueError(
            f"Compress: condition of length {cond.size} is longer than {where} ({length})"
        )
    return np.compress(cond, input, axis=axis)


@register("ReverseSequence", since=10)
def reverse_sequence(
    input: np.ndarray, sequence_lens: np.ndarray, *, batch_axis: int = 1, time_axis: int = 0
) -> np.ndarray:
    """Reverse the first ``sequence_lens[b]`` steps along ``time_axis`` of every batch entry b."""
    if sorted((batch_axis, time_axis)) != [0, 1] or input.ndim < 2:
        raise ValueError(
            f"ReverseSequence: batch_axis {batch_axis} and time_axis {time_axis} must be 0 and 1 "
            f"(input shape {input.shape})"
        )
    x = np.moveaxis(input, (batch_axis, time_axis), (0, 1))
    batch, steps = x.shape[:2]
    lens = np.asarray(sequence_lens).astype(np.int64).reshape(-1)
    if lens.shape != (batch,) or (lens.size and (lens.min() < 0 or lens.max() > steps)):
        raise ValueError(
            f"ReverseSequence: sequence_lens {lens.tolist()} must be {batch} values in [0, {steps}]"
        )
    t = np.arange(steps)
    src = np.where(t < lens[:, None], lens[:, None] - 1 - t, t)
    out = x[np.arange(batch)[:, None], src]
    return np.moveaxis(out, (0, 1), (batch_axis, time_axis))
