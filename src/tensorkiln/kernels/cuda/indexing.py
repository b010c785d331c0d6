"""Torch kernels driven by index tensors: gathers, scatters, OneHot, NonZero, Unique, Compress.

They mirror :mod:`tensorkiln.kernels.reference.indexing`. Negative indices count from the end of
their axis. The reference raises on an index out of range; checking that here would cost a
device-to-host sync on every Gather, so indices beyond the axis are clamped to it instead (on the
GPU an unchecked one would fault the device). OneHot's depth is read to the host (it is the
output's shape); NonZero, Unique and Compress produce data-dependent shapes, so they synchronize
by nature. TensorScatter's write positions are kernels/common/indexing.py's.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tensorkiln.kernels.common.indexing import (
    ElementScatter,
    TensorScatter,
    check_nd_indices,
)
from tensorkiln.kernels.common.tensor import norm_axis
from tensorkiln.kernels.cuda.convert import host_values, kept
from tensorkiln.kernels.cuda.tensor import (
    as_signed,
    from_order_key,
    from_signed,
    host_scalar,
    order_key,
)
from tensorkiln.kernels.registry import register


def _indices(indices: torch.Tensor, size: int) -> torch.Tensor:
    """``indices`` as int64 in [0, size): negatives wrapped, others clamped (see the module doc),
    in two kernels: clamped to [-size, size), then the negatives wrapped by the remainder. Kept
    for constant indices (an engine's constants, values kept per input shape): none then."""

    def make() -> torch.Tensor:
        if size == 0:
            return indices.to(torch.int64).clamp(0, 0)
        return indices.to(torch.int64).clamp(-size, size - 1).remainder(size)

    return kept(indices, ("indices", size), make)


# ---------------------------------------------------------------------------------------------
# Gathers


@register("Gather", since=1, backend="cuda")
def gather(data: torch.Tensor, indices: torch.Tensor, *, axis: int = 0) -> torch.Tensor:
    """Take the slices of ``data`` at ``indices`` along ``axis``."""
    axis = norm_axis(axis, data.dim(), "Gather")
    view = _gather_view(data, host_values(indices), axis)
    if view is not None:
        return view
    idx = _indices(indices, data.shape[axis])
    out = data.index_select(axis, idx.reshape(-1))
    return out.reshape((*data.shape[:axis], *idx.shape, *data.shape[axis + 1 :]))


def _gather_view(data: torch.Tensor, known: np.ndarray | None, axis: int) -> torch.Tensor | None:
    """Gather at indices known on the host (a constant, or shape arithmetic mirrored there) as a
    view where they pick one slice or a run of consecutive ones: a scalar index is ``select``, a
    1-D ascending run is ``narrow``. No kernel runs: an attention block's Q/K/V split from a
    packed projection was three index_select copies (and their index arithmetic) per layer."""
    size = data.shape[axis]
    if known is None or known.ndim > 1 or known.dtype.kind not in "iu" or size == 0:
        return None
    idx = np.clip(np.where(known < 0, known + size, known), 0, size - 1)
    if idx.ndim == 0:
        return data.select(axis, int(idx))
    if idx.size and np.array_equal(idx, np.arange(idx[0], idx[0] + idx.size)):
        return data.narrow(axis, int(idx[0]), int(idx.size))
    return None


def _check_elements(data: torch.Tensor, indices: torch.Tensor, axis: int, op: str) -> None:
    if indices.dim() != data.dim():
        raise ValueError(
            f"{op}: indices of rank {indices.dim()} for data of rank {data.dim()} (must match)"
        )
    for d, (i, n) in enumerate(zip(indices.shape, data.shape)):
        if d != axis and i > n:
            raise ValueError(
                f"{op}: indices shape {list(indices.shape)} exceeds data shape "
                f"{list(data.shape)} on axis {d}"
            )


@register("GatherElements", since=11, backend="cuda")
def gather_elements(data: torch.Tensor, indices: torch.Tensor, *, axis: int = 0) -> torch.Tensor:
    """``out[i][j] = data[indices[i][j]][j]`` (for axis 0); the output is shaped like indices."""
    axis = norm_axis(axis, data.dim(), "GatherElements")
    _check_elements(data, indices, axis, "GatherElements")
    idx = _indices(indices, data.shape[axis])
    return from_signed(torch.gather(as_signed(data), axis, idx), data.dtype)


def _nd_rows(data: torch.Tensor, indices: torch.Tensor, batch_dims: int, op: str):
    """GatherND/ScatterND addressing: data as (batch, prod(indexed dims), *tail) and, for each
    batch entry, the linear position of every index tuple, shaped (batch, rows)."""
    b = batch_dims
    k = check_nd_indices(data.shape, indices.shape, b, op)
    batch = math.prod(data.shape[:b])
    indexed = data.shape[b : b + k]
    idx = indices.reshape(batch, math.prod(indices.shape[b:-1]), k)
    linear = torch.zeros(idx.shape[:2], dtype=torch.int64, device=data.device)
    for j, size in enumerate(indexed):
        linear = linear * size + _indices(idx[..., j], size)
    flat = data.reshape(batch, math.prod(indexed), *data.shape[b + k :])
    return flat, linear


@register("GatherND", since=11, backend="cuda")
def gather_nd(data: torch.Tensor, indices: torch.Tensor, *, batch_dims: int = 0) -> torch.Tensor:
    """Gather slices addressed by the last axis of ``indices`` (after ``batch_dims`` batch axes)."""
    flat, linear = _nd_rows(data, indices, batch_dims, "GatherND")
    k = indices.shape[-1]
    rows = torch.arange(flat.shape[0], device=data.device).unsqueeze(1)
    out = from_signed(as_signed(flat)[rows, linear], data.dtype)
    return out.reshape((*indices.shape[:-1], *data.shape[batch_dims + k :]))


# ---------------------------------------------------------------------------------------------
# Scatters

_TORCH_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _check_reduction(reduction: str, op: str) -> None:
    if reduction != "none" and reduction not in _TORCH_REDUCE:
        raise ValueError(f"{op}: unknown reduction '{reduction}' (none, add, mul, max or min)")


def _scatter_along(
    out: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, reduction: str
) -> torch.Tensor:
    """``out`` with ``src`` scattered (or reduced, numpy ``ufunc.at`` style) along ``dim``."""
    dtype = out.dtype
    if reduction == "none":
        return from_signed(as_signed(out).scatter_(dim, index, as_signed(src)), dtype)
    if reduction in ("max", "min") or dtype == torch.bool:
        key = order_key(out).scatter_reduce_(dim, index, order_key(src), _TORCH_REDUCE[reduction])
        return from_order_key(key, dtype)
    # add and mul wrap the same way on the signed view of an unsigned type
    reduced = as_signed(out).scatter_reduce_(dim, index, as_signed(src), _TORCH_REDUCE[reduction])
    return from_signed(reduced, dtype)


@register("ScatterND", since=11, backend="cuda")
def scatter_nd(
    data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor, *, reduction: str = "none"
) -> torch.Tensor:
    """A copy of ``data`` with slices addressed by ``indices[..., :]`` replaced by (or reduced
    with) ``updates``."""
    _check_reduction(reduction, "ScatterND")
    flat, linear = _nd_rows(data, indices, 0, "ScatterND")
    k = indices.shape[-1]
    tail = data.shape[k:]
    expected = (*indices.shape[:-1], *tail)
    if tuple(updates.shape) != expected:
        raise ValueError(
            f"ScatterND: updates shape {list(updates.shape)} != {list(expected)} expected from "
            f"indices {list(indices.shape)} and data {list(data.shape)}"
        )
    out = flat[0].clone(memory_format=torch.contiguous_format)  # (prod(indexed dims), *tail)
    upd = updates.reshape(-1, *tail)
    index = linear.reshape(-1, *([1] * len(tail))).expand(upd.shape)
    return _scatter_along(out, 0, index, upd, reduction).reshape(data.shape)


class TorchScatterArrays:
    """:class:`tensorkiln.kernels.common.indexing.ScatterArrays` on torch tensors."""

    def scatter_along(
        self,
        data: torch.Tensor,
        indices: torch.Tensor,
        updates: torch.Tensor,
        axis: int,
        reduction: str,
    ) -> torch.Tensor:
        _check_reduction(reduction, "ScatterElements")
        _check_elements(data, indices, axis, "ScatterElements")
        idx = _indices(indices, data.shape[axis])
        return _scatter_along(data.clone(), axis, idx, updates, reduction)

    def starts(self, write_indices: torch.Tensor | None, batch: int, like: torch.Tensor):
        if write_indices is None:
            return torch.zeros(batch, dtype=torch.int64, device=like.device)
        return write_indices.to(torch.int64).reshape(-1)

    def arange(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(n, device=like.device)

    def bound(self, pos: torch.Tensor, max_len: int) -> torch.Tensor:
        return pos.clamp(0, max(max_len - 1, 0))

    def write_rows(self, cache: torch.Tensor, axis: int, pos: torch.Tensor, update: torch.Tensor):
        out = cache.clone()
        view = as_signed(out).movedim(axis, 1)  # (batch, max_len, ...) view into out
        rows = torch.arange(cache.shape[0], device=cache.device).unsqueeze(1)
        view[rows, pos] = as_signed(update).movedim(axis, 1)
        return out


_ELEMENTS = ElementScatter(TorchScatterArrays())
register("ScatterElements", since=11, backend="cuda")(_ELEMENTS.scatter_elements)
register("Scatter", since=9, backend="cuda")(_ELEMENTS.scatter)
register("TensorScatter", since=24, backend="cuda")(
    TensorScatter(TorchScatterArrays()).tensor_scatter
)


# ---------------------------------------------------------------------------------------------
# OneHot, NonZero, Unique, Compress, ReverseSequence


@register("OneHot", since=9, backend="cuda")
def one_hot(
    indices: torch.Tensor, depth: torch.Tensor, values: torch.Tensor, *, axis: int = -1
) -> torch.Tensor:
    """``values[1]`` where the new ``axis`` position equals the index, ``values[0]`` elsewhere;
    indices outside [-depth, depth) give an all-off row."""
    n = int(host_scalar(depth))
    if n < 0:
        raise ValueError(f"OneHot: depth must be non-negative, got {n}")
    values = values.reshape(-1)
    if values.numel() != 2:
        raise ValueError(f"OneHot: values must hold [off_value, on_value], got {values.numel()}")
    axis = norm_axis(axis, indices.dim() + 1, "OneHot")
    idx = indices.to(torch.int64)
    idx = torch.where(idx < 0, idx + n, idx)
    hot = idx.unsqueeze(-1) == torch.arange(n, device=idx.device)
    v = as_signed(values)
    out = torch.where(hot, v[1], v[0])
    return from_signed(out.movedim(-1, axis).contiguous(), values.dtype)


@register("NonZero", since=9, backend="cuda")
def nonzero(X: torch.Tensor) -> torch.Tensor:
    """Indices of the non-zero elements, shape (rank, count) int64; a scalar counts as 1-D."""
    x = as_signed(X.reshape(1) if X.dim() == 0 else X)
    return torch.nonzero(x).t().contiguous()


def _first_occurrence(inverse: torch.Tensor, n_unique: int) -> torch.Tensor:
    """For each unique entry, the smallest position whose inverse index points to it."""
    positions = torch.arange(inverse.numel(), device=inverse.device)
    first = torch.full((n_unique,), inverse.numel(), dtype=torch.int64, device=inverse.device)
    return first.scatter_reduce_(0, inverse, positions, "amin")


@register("Unique", since=11, backend="cuda")
def unique(
    X: torch.Tensor, *, axis: int | None = None, sorted: int = 1, _n_outputs: int = 1
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Unique values (or slices along ``axis``), with first-occurrence indices, inverse indices
    and counts; ``sorted=0`` keeps first-occurrence order."""
    key = order_key(X)
    if axis is None:
        y, inverse, counts = torch.unique(
            key.reshape(-1), sorted=True, return_inverse=True, return_counts=True
        )
    else:
        axis = norm_axis(axis, X.dim(), "Unique")
        y, inverse, counts = torch.unique(
            key, sorted=True, return_inverse=True, return_counts=True, dim=axis
        )
    inverse = inverse.reshape(-1)
    first = _first_occurrence(inverse, counts.numel())
    if not sorted:
        order = torch.argsort(first)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        y = y.index_select(0 if axis is None else axis, order)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    outs = (from_order_key(y, X.dtype), first, inverse, counts.to(torch.int64))
    return outs[0] if _n_outputs == 1 else outs[:_n_outputs]


@register("Compress", since=9, backend="cuda")
def compress(input: torch.Tensor, condition: torch.Tensor, *, axis: int | None = None):
    """The slices (or, without ``axis``, the flattened elements) where ``condition`` is true."""
    cond = condition.reshape(-1).to(torch.bool)
    if axis is not None:
        axis = norm_axis(axis, input.dim(), "Compress")
    length = input.numel() if axis is None else input.shape[axis]
    if cond.numel() > length:
        where = "the flattened input" if axis is None else f"axis {axis}"
        raise ValueError(
            f"Compress: condition of length {cond.numel()} is longer than {where} ({length})"
        )
    picked = torch.nonzero(cond).reshape(-1)
    if axis is None:
        return input.reshape(-1).index_select(0, picked)
    return input.index_select(axis, picked)


@register("ReverseSequence", since=10, backend="cuda")
def reverse_sequence(
    input: torch.Tensor, sequence_lens: torch.Tensor, *, batch_axis: int = 1, time_axis: int = 0
) -> torch.Tensor:
    """Reverse the first ``sequence_lens[b]`` steps along ``time_axis`` of every batch entry b
    (lengths are clamped to [0, steps])."""
    if sorted((batch_axis, time_axis)) != [0, 1] or input.dim() < 2:
        raise ValueError(
            f"ReverseSequence: batch_axis {batch_axis} and time_axis {time_axis} must be 0 and 1 "
            f"(input shape {list(input.shape)})"
        )
    x = input.movedim((batch_axis, time_axis), (0, 1))
    batch, steps = x.shape[:2]
    lens = sequence_lens.to(torch.int64).reshape(-1)
    if lens.shape != (batch,):
        raise ValueError(
            f"ReverseSequence: sequence_lens of shape {list(sequence_lens.shape)} must hold "
            f"{batch} values"
        )
    lens = lens.clamp(0, steps).unsqueeze(1)
    t = torch.arange(steps, device=x.device)
    src = torch.where(t < lens, lens - 1 - t, t)
    out = from_signed(as_signed(x)[torch.arange(batch, device=x.device).unsqueeze(1), src], x.dtype)
    return out.movedim((0, 1), (batch_axis, time_axis)).contiguous()
