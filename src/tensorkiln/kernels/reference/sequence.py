"""Sequence and optional operators.

A sequence is a Python list of numpy arrays; an empty optional is ``None``. Kernels never mutate
the list they are given: a sequence value may be read by several nodes.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.ir.dtypes import DType
from tensorkiln.kernels.registry import register

Sequence = list[np.ndarray]


def _position(position: np.ndarray | None, length: int, *, insert: bool, op: str) -> int:
    """A checked, non-negative index from a scalar position tensor (``None``: the end)."""
    if position is None:
        return length if insert else length - 1
    pos = int(np.asarray(position).reshape(()))
    hi = length if insert else length - 1
    if not -length <= pos <= hi:
        raise ValueError(
            f"{op}: position {pos} is out of range for a sequence of length {length} "
            f"(allowed: {-length}..{hi})."
        )
    return pos + length if pos < 0 else pos


@register("SequenceConstruct", since=1)
def sequence_construct(*inputs: np.ndarray) -> Sequence:
    """The sequence of the inputs, in order."""
    if len({np.asarray(x).dtype for x in inputs}) > 1:
        raise ValueError("SequenceConstruct: all inputs must have the same element type.")
    return list(inputs)


@register("SequenceEmpty", since=1)
def sequence_empty(*, dtype: int = DType.FLOAT) -> Sequence:
    """An empty sequence (the element type ``dtype`` is carried by the graph, not the list)."""
    return []


@register("SequenceAt", since=1)
def sequence_at(seq: Sequence, position: np.ndarray) -> np.ndarray:
    """The element of ``seq`` at ``position`` (negative counts from the back)."""
    return seq[_position(position, len(seq), insert=False, op="SequenceAt")]


@register("SequenceErase", since=1)
def sequence_erase(seq: Sequence, position: np.ndarray | None = None) -> Sequence:
    """``seq`` without the element at ``position`` (default: the last)."""
    if not seq:
        raise ValueError("SequenceErase: cannot erase from an empty sequence.")
    pos = _position(position, len(seq), insert=False, op="SequenceErase")
    return seq[:pos] + seq[pos + 1 :]


@register("SequenceInsert", since=1)
def sequence_insert(
    seq: Sequence, tensor: np.ndarray, position: np.ndarray | None = None
) -> Sequence:
    """``seq`` with ``tensor`` inserted before ``position`` (default: appended)."""
    if seq and np.asarray(seq[0]).dtype != np.asarray(tensor).dtype:
        raise ValueError(
            f"SequenceInsert: tensor of type {tensor.dtype} does not match the sequence's "
            f"element type {seq[0].dtype}."
        )
    pos = _position(position, len(seq), insert=True, op="SequenceInsert")
    return [*seq[:pos], tensor, *seq[pos:]]


@register("SequenceLength", since=1)
def sequence_length(seq: Sequence) -> np.ndarray:
    """The number of elements of ``seq`` as an int64 scalar."""
    return np.asarray(len(seq), dtype=np.int64)


def _split_sizes(split: np.ndarray, dim: int) -> list[int]:
    split = np.asarray(split)
    if split.ndim == 0:
        size = int(split)
        if size <= 0:
            raise ValueError(f"SplitToSequence: scalar split must be positive, got {size}.")
        return [size] * (dim // size) + ([dim % size] if dim % size else [])
    sizes = [int(s) for s in split.reshape(-1)]
    if any(s < 0 for s in sizes) or sum(sizes) != dim:
        raise ValueError(
            f"SplitToSequence: split sizes {sizes} must be non-negative and sum to the "
            f"length {dim} of the split axis."
        )
    return sizes


@register("SplitToSequence", since=1)
def split_to_sequence(
    input: np.ndarray, split: np.ndarray | None = None, *, axis: int = 0, keepdims: int = 1
) -> Sequence:
    """Split ``input`` along ``axis`` into a sequence.

    Without ``split`` every slice has length 1 and ``keepdims=0`` drops the axis; a scalar
    ``split`` gives chunks of that length (the last may be shorter); a 1-D ``split`` gives sizes.
    """
    if not -input.ndim <= axis < input.ndim:
        raise ValueError(f"SplitToSequence: axis {axis} is out of range for rank {input.ndim}.")
    axis %= input.ndim
    if split is None:
        parts = np.split(input, input.shape[axis], axis=axis)
        return parts if keepdims else [np.squeeze(p, axis=axis) for p in parts]
    bounds = np.cumsum(_split_sizes(split, input.shape[axis]))[:-1]
    return list(np.split(input, bounds, axis=axis))


@register("ConcatFromSequence", since=1)
def concat_from_sequence(seq: Sequence, *, axis: int, new_axis: int = 0) -> np.ndarray:
    """Concatenate ``seq`` along ``axis`` (stack along a new axis if ``new_axis``)."""
    if not seq:
        raise ValueError("ConcatFromSequence: the input sequence is empty.")
    rank = np.ndim(seq[0]) + (1 if new_axis else 0)
    if not -rank <= axis < rank:
        raise ValueError(f"ConcatFromSequence: axis {axis} is out of range for rank {rank}.")
    if new_axis:
        return np.stack(seq, axis=axis)
    return np.concatenate(seq, axis=axis)


@register("Optional", since=1)
def optional(input: np.ndarray | Sequence | None = None, *, type: object = None) -> object:
    """An optional holding ``input``, or an empty optional (``None``) without one."""
    return input


@register("OptionalGetElement", since=1)
def optional_get_element(input: np.ndarray | Sequence | None) -> np.ndarray | Sequence:
    """The value held by an optional (a plain tensor or sequence is returned as is)."""
    if input is None:
        raise ValueError("OptionalGetElement: the optional input is empty.")
    return input


@register("OptionalHasElement", since=1)
def optional_has_element(input: np.ndarray | Sequence | None = None) -> np.ndarray:
    """Whether the optional holds a value, as a bool scalar (an omitted input is empty)."""
    return np.asarray(input is not None)
