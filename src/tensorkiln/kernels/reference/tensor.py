"""Reference kernels that move data without computing on it: reshapes, slices, pads, constants.

Gathers, scatters and the other index-driven ops live in :mod:`.indexing`. Kernels that only change
the view of their input (Reshape, Transpose, Slice, Squeeze, Unsqueeze, Flatten, Split) return numpy
views; the executor never writes into its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tensorkiln.ir.dtypes import DType
from tensorkiln.kernels.common import tensor as common
from tensorkiln.kernels.common.tensor import norm_axes, norm_axis
from tensorkiln.kernels.registry import register


def _ints(value: np.ndarray | Sequence[int] | None) -> list[int] | None:
    return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]


# ---------------------------------------------------------------------------------------------
# Reshape, Flatten, Squeeze, Unsqueeze, Transpose


@register("Reshape", since=1)
def reshape(
    data: np.ndarray,
    shape: np.ndarray | Sequence[int] = (),
    *,
    allowzero: int = 0,
    consumed_inputs: Sequence[int] | None = None,
) -> np.ndarray:
    """Reshape; 0 copies the input's dimension unless ``allowzero``, -1 is inferred. The target
    is an input from opset 5 and an attribute of the same name in Reshape-1, so it binds to
    ``shape`` either way."""
    return data.reshape(common.reshape_dims(data.shape, data.size, _ints(shape), allowzero))


@register("Flatten", since=1)
def flatten(input: np.ndarray, *, axis: int = 1) -> np.ndarray:
    """Flatten into 2-D: dimensions before ``axis`` become the rows, the rest the columns."""
    rank = input.ndim
    if not -rank <= axis <= rank:
        raise ValueError(f"Flatten: axis {axis} is out of range [-{rank}, {rank}]")
    axis = axis + rank if axis < 0 else axis
    return input.reshape(math.prod(input.shape[:axis]), math.prod(input.shape[axis:]))


@register("Squeeze", since=1)
def squeeze(data: np.ndarray, axes: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
    """Remove size-1 dimensions (``axes`` as attribute before opset 13, as input from 13).

    Without axes, or with an empty axes input (as onnxruntime treats it), remove every size-1 one.
    """
    if axes is None or np.size(axes) == 0:
        return np.squeeze(data)
    norm = norm_axes(_ints(axes), data.ndim, "Squeeze")
    bad = [a for a in norm if data.shape[a] != 1]
    if bad:
        raise ValueError(
            f"Squeeze: cannot squeeze axes {bad} of a tensor of shape {data.shape}: size is not 1"
        )
    return np.squeeze(data, axis=tuple(norm))


@register("Unsqueeze", since=1)
def unsqueeze(data: np.ndarray, axes: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
    """Insert size-1 dimensions at ``axes`` of the output (attribute before 13, input from 13)."""
    if axes is None:
        raise ValueError("Unsqueeze: axes are required")
    out_rank = data.ndim + len(_ints(axes))
    norm = norm_axes(_ints(axes), out_rank, "Unsqueeze")
    return np.expand_dims(data, tuple(norm))


@register("Transpose", since=1)
def transpose(data: np.ndarray, *, perm: Sequence[int] | None = None) -> np.ndarray:
    """Permute the axes; without ``perm`` reverse them."""
    if perm is None:
        return np.transpose(data)
    if sorted(perm) != list(range(data.ndim)):
        raise ValueError(f"Transpose: perm {list(perm)} is not a permutation of 0..{data.ndim - 1}")
    return np.transpose(data, perm)


# ---------------------------------------------------------------------------------------------
# Concat, Split, Slice, Expand, Tile


@register("Concat", since=1)
def concat(*inputs: np.ndarray, axis: int = 1) -> np.ndarray:
    """Join the inputs along ``axis``."""
    if not inputs:
        raise ValueError("Concat: needs at least one input")
    rank = inputs[0].ndim
    axis = norm_axis(axis, rank, "Concat")
    for x in inputs:
        if x.ndim != rank or any(
            x.shape[d] != inputs[0].shape[d] for d in range(rank) if d != axis
        ):
            shapes = [x.shape for x in inputs]
            raise ValueError(f"Concat: input shapes {shapes} differ outside axis {axis}")
    return np.concatenate(inputs, axis=axis)


@register("Split", since=1)
def split(
    input: np.ndarray,
    split: np.ndarray | Sequence[int] | None = None,
    *,
    axis: int = 0,
    num_outputs: int | None = None,
    _n_outputs: int = 1,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Split along ``axis`` by the sizes in ``split`` (input or attribute), else into equal parts.

    With ``num_outputs`` (opset 18) an uneven split makes the last part smaller; without it the
    dimension must divide evenly into the node's outputs.
    """
    axis = norm_axis(axis, input.ndim, "Split")
    dim = int(input.shape[axis])
    sizes = common.split_sizes(dim, axis, _ints(split), num_outputs, _n_outputs)
    parts = tuple(np.split(input, np.cumsum(sizes)[:-1], axis=axis))
    return parts[0] if len(parts) == 1 else parts


@register("Slice", since=1)
def slice_(
    data: np.ndarray,
    starts: np.ndarray | Sequence[int] = (),
    ends: np.ndarray | Sequence[int] = (),
    axes: np.ndarray | Sequence[int] | None = None,
    steps: np.ndarray | None = None,
) -> np.ndarray:
    """Strided slice; out-of-range starts/ends clamp like Python slicing does. Slice-1's starts,
    ends and axes are attributes of the same names as Slice-10's inputs (and it has no steps)."""
    plan = common.slice_plan(_ints(starts), _ints(ends), _ints(axes), _ints(steps), data.ndim)
    index = [slice(None)] * data.ndim
    for axis, start, end, step in plan:
        index[axis] = slice(start, end, step)
    return data[tuple(index)]


@register("Expand", since=8)
def expand(input: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """Broadcast ``input`` against ``shape`` (the output may be larger than ``shape``)."""
    target = tuple(_ints(shape))
    try:
        out_shape = np.broadcast_shapes(input.shape, target)
    except ValueError:
        raise ValueError(
            f"Expand: input shape {input.shape} does not broadcast with shape {target}"
        ) from None
    return np.broadcast_to(input, out_shape).copy()


@register("Tile", since=1)
def tile(
    input: np.ndarray, repeats: np.ndarray, axis: np.ndarray | None = None, *, _opset: int = 6
) -> np.ndarray:
    """Repeat the whole tensor ``repeats[i]`` times along each axis i; Tile-1 repeats it
    ``tiles`` (its second input) times along the single axis ``axis``."""
    reps = common.tile_repeats(input.shape, _ints(repeats), _ints(axis), _opset)
    return np.tile(input, reps)


# ---------------------------------------------------------------------------------------------
# Pad, CenterCropPad


@register("Pad", since=1)
def pad(
    data: np.ndarray,
    pads: np.ndarray | Sequence[int] | None = None,
    constant_value: np.ndarray | None = None,
    axes: np.ndarray | None = None,
    *,
    mode: str = "constant",
    value: float = 0.0,
    paddings: Sequence[int] | None = None,
) -> np.ndarray:
    """Pad (negative pads crop). Handles pads as attribute (opset 1 ``paddings``, 2 ``pads``/
    ``value``) and as inputs (11: ``pads``/``constant_value``, 18: ``axes``)."""
    flat = _ints(pads if pads is not None else paddings)
    crop, widths = common.pad_plan(data.shape, flat, _ints(axes), mode)
    data = data[crop]
    if mode == "constant":
        fill = value if constant_value is None else np.asarray(constant_value).reshape(-1)
        fill = fill if np.ndim(fill) == 0 else (fill[0] if fill.size else 0)
        return np.pad(data, widths, mode="constant", constant_values=fill)
    common.check_pad_widths(data.shape, widths, mode)
    return np.pad(data, widths, mode=mode)


@register("CenterCropPad", since=18)
def center_crop_pad(
    input_data: np.ndarray, shape: np.ndarray, *, axes: Sequence[int] | None = None
) -> np.ndarray:
    """Crop or zero-pad the given axes to ``shape``, keeping the content centred."""
    out_shape, src, dst = common.crop_pad_plan(input_data.shape, _ints(shape), axes)
    out = np.zeros(out_shape, dtype=input_data.dtype)
    out[dst] = input_data[src]
    return out


# ---------------------------------------------------------------------------------------------
# Shape, Size, constants, Identity, Range, EyeLike, Trilu


@register("Shape", since=1)
def shape(data: np.ndarray, *, start: int = 0, end: int | None = None) -> np.ndarray:
    """The input's shape as int64, optionally only dimensions [start, end) (clamped)."""
    return np.array(data.shape[start:end], dtype=np.int64)


@register("Size", since=1)
def size(data: np.ndarray) -> np.ndarray:
    """The number of elements, as an int64 scalar."""
    return np.array(data.size, dtype=np.int64)


@register("ConstantOfShape", since=9)
def constant_of_shape(input: np.ndarray, *, value: np.ndarray | None = None) -> np.ndarray:
    """A tensor of shape ``input`` filled with ``value`` (float32 0 by default)."""
    dims = _ints(input)
    if any(d < 0 for d in dims):
        raise ValueError(f"ConstantOfShape: negative dimension in shape {dims}")
    if value is None:
        value = np.zeros(1, dtype=np.float32)
    value = np.asarray(value)
    if value.size != 1:
        raise ValueError(f"ConstantOfShape: value must hold one element, not {value.size}")
    return np.full(dims, value.reshape(-1)[0], dtype=value.dtype)


register("Constant", since=1)(common.constant)


@register("Identity", since=1)
def identity(input: np.ndarray | list | None) -> np.ndarray | list | None:
    """The input unchanged: a tensor, a sequence (list) or an optional (``None`` when empty)."""
    return list(input) if isinstance(input, list) else input


_STASH_DTYPES = {1: np.float32, 11: np.float64}


@register("Range", since=11)
def range_(
    start: np.ndarray, limit: np.ndarray, delta: np.ndarray, *, stash_type: int = 1
) -> np.ndarray:
    """``start + i * delta`` for i in [0, ceil((limit - start) / delta)), in start's type."""
    dtype = start.dtype
    if dtype.kind in "iu":
        s, lim, d = (int(np.asarray(v).reshape(-1)[0]) for v in (start, limit, delta))
        if d == 0:
            raise ValueError("Range: delta is 0")
        n = max(-((s - lim) // d), 0)
        return (s + np.arange(n, dtype=np.int64) * d).astype(dtype)
    # float16/bfloat16 compute in the stash type (float32 by default); other floats in their own.
    compute = _STASH_DTYPES.get(stash_type, np.float32) if dtype.itemsize <= 2 else dtype
    s, lim, d = (np.asarray(v).astype(compute).reshape(()) for v in (start, limit, delta))
    if d == 0:
        raise ValueError("Range: delta is 0")
    n = max(math.ceil(float(lim - s) / float(d)), 0)
    return (s + np.arange(n, dtype=compute) * d).astype(dtype)


@register("EyeLike", since=9)
def eye_like(input: np.ndarray, *, dtype: int | None = None, k: int = 0) -> np.ndarray:
    """A 2-D tensor shaped like ``input`` with ones on diagonal ``k``."""
    if input.ndim != 2:
        raise ValueError(f"EyeLike: input must be 2-D, got shape {input.shape}")
    out_dtype = input.dtype if dtype is None else DType(dtype).numpy
    return np.eye(*input.shape, k=k, dtype=out_dtype)


@register("Trilu", since=14)
def trilu(input: np.ndarray, k: np.ndarray | None = None, *, upper: int = 1) -> np.ndarray:
    """Keep the upper (or lower) triangle of the last two axes from diagonal ``k``; zero others."""
    if input.ndim < 2:
        raise ValueError(f"Trilu: input must have rank >= 2, got shape {input.shape}")
    k = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
    return np.triu(input, k) if upper else np.tril(input, k)


# ---------------------------------------------------------------------------------------------
# DepthToSpace, SpaceToDepth


register("DepthToSpace", since=1)(common.depth_to_space)
register("SpaceToDepth", since=1)(common.space_to_depth)
