"""Sequence and optional operators on torch tensors.

They mirror :mod:`tensorkiln.kernels.reference.sequence`: a sequence is a Python list of tensors,
an empty optional is ``None``, and no kernel mutates the list it is given. Positions and split
sizes are read to the host (they pick list elements and shapes); SequenceLength and
OptionalHasElement return their scalars on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorkiln.ir.dtypes import DType
from tensorkiln.kernels.cuda.convert import current_device
from tensorkiln.kernels.cuda.tensor import host_ints, host_scalar, norm_axis
from tensorkiln.kernels.registry import register

Sequence = list[torch.Tensor]


def _position(position: Any, length: int, *, insert: bool, op: str) -> int:
    """A checked, non-negative index from a scalar position tensor (``None``: the end)."""
    if position is None:
        return length if insert else length - 1
    pos = int(host_scalar(position))
    hi = length if insert else length - 1
    if not -length <= pos <= hi:
        raise ValueError(
            f"{op}: position {pos} is out of range for a sequence of length {length} "
            f"(allowed: {-length}..{hi})."
        )
    return pos + length if pos < 0 else pos


@register("SequenceConstruct", since=1, backend="cuda")
def sequence_construct(*inputs: torch.Tensor) -> Sequence:
    """The sequence of the inputs, in order."""
    if len({x.dtype for x in inputs}) > 1:
        raise ValueError("SequenceConstruct: all inputs must have the same element type.")
    return list(inputs)


@register("SequenceEmpty", since=1, backend="cuda")
def sequence_empty(*, dtype: int = DType.FLOAT) -> Sequence:
    """An empty sequence (the element type ``dtype`` is carried by the graph, not the list)."""
    return []


@register("SequenceAt", since=1, backend="cuda")
def sequence_at(seq: Sequence, position: Any) -> torch.Tensor:
    """The element of ``seq`` at ``position`` (negative counts from the back)."""
    return seq[_position(position, len(seq), insert=False, op="SequenceAt")]


@register("SequenceErase", since=1, backend="cuda")
def sequence_erase(seq: Sequence, position: Any = None) -> Sequence:
    """``seq`` without the element at ``position`` (default: the last)."""
    if not seq:
        raise ValueError("SequenceErase: cannot erase from an empty sequence.")
    pos = _position(position, len(seq), insert=False, op="SequenceErase")
    return seq[:pos] + seq[pos + 1 :]


@register("SequenceInsert", since=1, backend="cuda")
def sequence_insert(seq: Sequence, tensor: torch.Tensor, position: Any = None) -> Sequence:
    """``seq`` with ``tensor`` inserted before ``position`` (default: appended)."""
    if seq and seq[0].dtype != tensor.dtype:
        raise ValueError(
            f"SequenceInsert: tensor of type {tensor.dtype} does not match the sequence's "
            f"element type {seq[0].dtype}."
        )
    pos = _position(position, len(seq), insert=True, op="SequenceInsert")
    return [*seq[:pos], tensor, *seq[pos:]]


@register("SequenceLength", since=1, backend="cuda")
def sequence_length(seq: Sequence) -> torch.Tensor:
    """The number of elements of ``seq`` as an int64 scalar on the device."""
    return torch.tensor(len(seq), dtype=torch.int64, device=current_device())


def _split_sizes(split: Any, dim: int) -> list[int]:
    if split.dim() == 0:
        size = int(host_scalar(split))
        if size <= 0:
            raise ValueError(f"SplitToSequence: scalar split must be positive, got {size}.")
        return [size] * (dim // size) + ([dim % size] if dim % size else [])
    sizes = host_ints(split)
    if any(s < 0 for s in sizes) or sum(sizes) != dim:
        raise ValueError(
            f"SplitToSequence: split sizes {sizes} must be non-negative and sum to the "
            f"length {dim} of the split axis."
        )
    return sizes


@register("SplitToSequence", since=1, backend="cuda")
def split_to_sequence(
    input: torch.Tensor, split: torch.Tensor | None = None, *, axis: int = 0, keepdims: int = 1
) -> Sequence:
    """Split ``input`` along ``axis`` into a sequence of views.

    Without ``split`` every slice has length 1 and ``keepdims=0`` drops the axis; a scalar
    ``split`` gives chunks of that length (the last may be shorter); a 1-D ``split`` gives sizes.
    """
    axis = norm_axis(axis, input.dim(), "SplitToSequence")
    if split is None:
        if keepdims:
            return list(torch.split(input, 1, dim=axis))
        return list(torch.unbind(input, dim=axis))
    return list(torch.split(input, _split_sizes(split, input.shape[axis]), dim=axis))


@register("ConcatFromSequence", since=1, backend="cuda")
def concat_from_sequence(seq: Sequence, *, axis: int, new_axis: int = 0) -> torch.Tensor:
    """Concatenate ``seq`` along ``axis`` (stack along a new axis if ``new_axis``)."""
    if not seq:
        raise ValueError("ConcatFromSequence: the input sequence is empty.")
    rank = seq[0].dim() + (1 if new_axis else 0)
    axis = norm_axis(axis, rank, "ConcatFromSequence")
    if new_axis:
        return torch.stack(seq, dim=axis)
    return torch.cat(seq, dim=axis)


@register("Optional", since=1, backend="cuda")
def optional(input: Any = None, *, type: object = None) -> Any:
    """An optional holding ``input``, or an empty optional (``None``) without one."""
    return input


@register("OptionalGetElement", since=1, backend="cuda")
def optional_get_element(input: Any) -> Any:
    """The value held by an optional (a plain tensor or sequence is returned as is)."""
    if input is None:
        raise ValueError("OptionalGetElement: the optional input is empty.")
    return input


@register("OptionalHasElement", since=1, backend="cuda")
def optional_has_element(input: Any = None) -> torch.Tensor:
    """Whether the optional holds a value, as a bool scalar on the device (an omitted input is
    empty)."""
    return torch.tensor(input is not None, device=current_device())
