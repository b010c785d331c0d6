"""Torch kernels that move data without computing on it: reshapes, slices, pads, constants.

They mirror :mod:`tensorkiln.kernels.reference.tensor`. Reshape, Flatten, Squeeze, Unsqueeze,
Transpose, Split and Slice (with positive steps) return views of their input; nothing downstream
writes into its inputs. Shape-like inputs (Reshape's shape, Slice's starts/ends, Pad's pads,
Tile's repeats, Range's scalars, ...) are read to the host: they decide the output's shape, so the
host needs them anyway. Constants come from the executor's host copy (no device sync), other
values through ``tolist()``.

The module also holds the dtype helpers the other data-movement modules share: torch implements
few ops for uint16/32/64, so those move as the signed type of the same width (a bit-for-bit view)
and compare through an order-preserving signed key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tensorkiln.ir.dtypes import DType
from tensorkiln.kernels.cuda.convert import current_device, host_list, to_torch, torch_dtype
from tensorkiln.kernels.reference import tensor as ref
from tensorkiln.kernels.registry import register

# ---------------------------------------------------------------------------------------------
# Helpers shared with indexing.py, sequence.py and math.py

_SIGNED_OF = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _flat(values: Any) -> list:
    if isinstance(values, list | tuple):
        return [v for item in values for v in _flat(item)]
    return [values]


def host_values(value: Any) -> list:
    """A small shape-like value (tensor, array, list or scalar) flattened to a host list.

    Constants the executor uploaded come from their host copy, without a device sync.
    """
    if isinstance(value, torch.Tensor | np.ndarray):
        return _flat(host_list(value))
    if isinstance(value, np.generic):
        return [value.item()]
    return _flat(value)


def host_ints(value: Any) -> list[int] | None:
    """:func:`host_values` as ints (None stays None)."""
    return None if value is None else [int(v) for v in host_values(value)]


def host_scalar(value: Any) -> Any:
    """The first (only) element of a small tensor or array as a Python number."""
    return host_values(value)[0]


def norm_axis(axis: int, rank: int, op: str, what: str = "axis") -> int:
    """``axis`` normalized to [0, rank); ValueError when it is out of [-rank, rank)."""
    axis = int(axis)
    if not -rank <= axis < rank:
        raise ValueError(f"{op}: {what} {axis} is out of range for a tensor of rank {rank}")
    return axis % rank


def norm_axes(axes: Sequence[int], rank: int, op: str) -> list[int]:
    """Every axis normalized; ValueError on out-of-range or repeated axes."""
    out = [norm_axis(a, rank, op) for a in axes]
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: axes {list(axes)} name the same axis twice")
    return out


def as_signed(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed bit for bit as the signed type of its width when torch lacks ops for it."""
    signed = _SIGNED_OF.get(x.dtype)
    return x if signed is None else x.view(signed)


def from_signed(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo :func:`as_signed`: ``y`` viewed back as ``dtype``."""
    return y if y.dtype == dtype else y.view(dtype)


def order_key(x: torch.Tensor) -> torch.Tensor:
    """A tensor that sorts like ``x`` and that torch can sort, compare and arg-reduce.

    Unsigned 16/32/64-bit values become signed ones with the sign bit flipped (same order);
    bool becomes uint8.
    """
    if x.dtype == torch.bool:
        return x.to(torch.uint8)
    signed = _SIGNED_OF.get(x.dtype)
    if signed is None:
        return x
    return x.view(signed) ^ torch.iinfo(signed).min


def from_order_key(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo :func:`order_key` on (a selection of) its values."""
    if dtype == torch.bool:
        return k.to(torch.bool)
    if dtype in _SIGNED_OF:
        return (k ^ torch.iinfo(k.dtype).min).view(dtype)
    return k


def to_device(value: Any, device: torch.device) -> Any:
    """A host array as a tensor on ``device`` (:func:`to_torch`), keeping 0-d arrays 0-d."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        t = to_torch(value.reshape(1), device)
        return t.reshape(()) if isinstance(t, torch.Tensor) else value
    return to_torch(value, device)


def device_of(*values: Any) -> torch.device:
    """The device of the first tensor among ``values``, else the current device."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return current_device()


# ---------------------------------------------------------------------------------------------
# Reshape, Flatten, Squeeze, Unsqueeze, Transpose


def _reshape_dims(shape: tuple[int, ...], numel: int, dims: list[int], allowzero: int) -> list[int]:
    if not allowzero:
        for i, d in enumerate(dims):
            if d == 0:
                if i >= len(shape):
                    raise ValueError(
                        f"Reshape: shape {dims} has 0 at position {i}, but the input has only "
                        f"{len(shape)} dimensions to copy from"
                    )
                dims[i] = shape[i]
    if dims.count(-1) > 1 or any(d < -1 for d in dims):
        raise ValueError(
            f"Reshape: invalid target shape {dims} (at most one -1, no other negatives)"
        )
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        if known == 0 or numel % known:
            raise ValueError(
                f"Reshape: cannot infer -1 in {dims} for an input of shape {list(shape)} "
                f"({numel} elements)"
            )
        dims[dims.index(-1)] = numel // known
    if math.prod(dims) != numel:
        raise ValueError(
            f"Reshape: cannot reshape input of shape {list(shape)} ({numel} elements) to "
            f"{dims} ({math.prod(dims)} elements)"
        )
    return dims


@register("Reshape", since=5, backend="cuda")
def reshape(data: torch.Tensor, shape: Any, *, allowzero: int = 0) -> torch.Tensor:
    """Reshape (a view where the strides allow); 0 copies a dimension unless ``allowzero``."""
    dims = _reshape_dims(tuple(data.shape), data.numel(), host_ints(shape), allowzero)
    return data.reshape(dims)


@register("Reshape", since=1, backend="cuda")
def reshape_from_attribute(
    data: torch.Tensor, *, shape: Sequence[int] = (), consumed_inputs=None
) -> torch.Tensor:
    """Reshape-1: the target shape is an attribute."""
    return reshape(data, list(shape))


@register("Flatten", since=1, backend="cuda")
def flatten(input: torch.Tensor, *, axis: int = 1) -> torch.Tensor:
    """Flatten into 2-D: dimensions before ``axis`` become the rows, the rest the columns."""
    rank = input.dim()
    if not -rank <= axis <= rank:
        raise ValueError(f"Flatten: axis {axis} is out of range [-{rank}, {rank}]")
    axis = axis + rank if axis < 0 else axis
    return input.reshape(math.prod(input.shape[:axis]), math.prod(input.shape[axis:]))


@register("Squeeze", since=1, backend="cuda")
def squeeze(data: torch.Tensor, axes: Any = None) -> torch.Tensor:
    """Remove size-1 dimensions (all of them without axes or with an empty axes input)."""
    axes = host_ints(axes)
    if not axes:
        return data.squeeze()
    norm = norm_axes(axes, data.dim(), "Squeeze")
    bad = [a for a in norm if data.shape[a] != 1]
    if bad:
        raise ValueError(
            f"Squeeze: cannot squeeze axes {bad} of a tensor of shape {list(data.shape)}: "
            "size is not 1"
        )
    return data.squeeze(tuple(norm))


@register("Unsqueeze", since=1, backend="cuda")
def unsqueeze(data: torch.Tensor, axes: Any = None) -> torch.Tensor:
    """Insert size-1 dimensions at ``axes`` of the output (attribute before 13, input from 13)."""
    axes = host_ints(axes)
    if axes is None:
        raise ValueError("Unsqueeze: axes are required")
    for a in sorted(norm_axes(axes, data.dim() + len(axes), "Unsqueeze")):
        data = data.unsqueeze(a)
    return data


@register("Transpose", since=1, backend="cuda")
def transpose(data: torch.Tensor, *, perm: Sequence[int] | None = None) -> torch.Tensor:
    """Permute the axes (a view); without ``perm`` reverse them."""
    if perm is None:
        return data.permute(*reversed(range(data.dim())))
    if sorted(perm) != list(range(data.dim())):
        raise ValueError(
            f"Transpose: perm {list(perm)} is not a permutation of 0..{data.dim() - 1}"
        )
    return data.permute(*perm)


# ---------------------------------------------------------------------------------------------
# Concat, Split, Slice, Expand, Tile


@register("Concat", since=1, backend="cuda")
def concat(*inputs: torch.Tensor, axis: int = 1) -> torch.Tensor:
    """Join the inputs along ``axis``."""
    if not inputs:
        raise ValueError("Concat: needs at least one input")
    rank = inputs[0].dim()
    axis = norm_axis(axis, rank, "Concat")
    first = inputs[0].shape
    for x in inputs:
        if x.dim() != rank or any(x.shape[d] != first[d] for d in range(rank) if d != axis):
            shapes = [list(x.shape) for x in inputs]
            raise ValueError(f"Concat: input shapes {shapes} differ outside axis {axis}")
    return torch.cat(inputs, dim=axis)


@register("Split", since=1, backend="cuda")
def split(
    input: torch.Tensor,
    split: Any = None,
    *,
    axis: int = 0,
    num_outputs: int | None = None,
    _n_outputs: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Split along ``axis`` (views) by the sizes in ``split``, else into equal parts."""
    axis = norm_axis(axis, input.dim(), "Split")
    dim = input.shape[axis]
    sizes = host_ints(split)
    if not sizes:  # None, or an empty 'split' input
        n = num_outputs if num_outputs is not None else _n_outputs
        if num_outputs is None and dim % n:
            raise ValueError(
                f"Split: dimension {axis} of size {dim} is not divisible into {n} parts"
            )
        chunk = -(-dim // n)
        sizes = [min(chunk, max(dim - i * chunk, 0)) for i in range(n)]
    elif len(sizes) != _n_outputs:
        raise ValueError(f"Split: {len(sizes)} sizes {sizes} given for {_n_outputs} outputs")
    if sum(sizes) != dim or any(s < 0 for s in sizes):
        raise ValueError(f"Split: sizes {sizes} do not add up to dimension {axis} of size {dim}")
    parts = tuple(torch.split(input, sizes, dim=axis))
    return parts[0] if len(parts) == 1 else parts


def _slice_axis(x: torch.Tensor, axis: int, start: int, end: int, step: int) -> torch.Tensor:
    """``x[..., start:end:step, ...]`` along ``axis`` with Python's clamping; a view unless
    ``step`` is negative (torch has no negative strides: those flip a narrowed copy)."""
    start, end, step = slice(start, end, step).indices(x.shape[axis])
    if step > 0:
        index = [slice(None)] * x.dim()
        index[axis] = slice(start, max(end, start), step)
        return x[tuple(index)]
    count = len(range(start, end, step))
    if count == 0:
        return x.narrow(axis, 0, 0)
    last = start + (count - 1) * step
    flipped = x.narrow(axis, last, start - last + 1).flip(axis)
    index = [slice(None)] * x.dim()
    index[axis] = slice(None, None, -step)
    return flipped[tuple(index)]


@register("Slice", since=10, backend="cuda")
def slice_(
    data: torch.Tensor, starts: Any, ends: Any, axes: Any = None, steps: Any = None
) -> torch.Tensor:
    """Strided slice; out-of-range starts/ends clamp like Python slicing does."""
    starts, ends = host_ints(starts), host_ints(ends)
    axes = list(range(len(starts))) if axes is None else host_ints(axes)
    steps = [1] * len(starts) if steps is None else host_ints(steps)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError(
            f"Slice: starts, ends, axes and steps differ in length "
            f"({len(starts)}, {len(ends)}, {len(axes)}, {len(steps)})"
        )
    out = data
    for start, end, axis, step in zip(starts, ends, norm_axes(axes, data.dim(), "Slice"), steps):
        if step == 0:
            raise ValueError(f"Slice: step of axis {axis} is 0")
        out = _slice_axis(out, axis, start, end, step)
    return out


@register("Slice", since=1, backend="cuda")
def slice_from_attributes(
    data: torch.Tensor,
    *,
    starts: Sequence[int] = (),
    ends: Sequence[int] = (),
    axes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Slice-1: starts, ends and axes are attributes; step 1."""
    return slice_(data, list(starts), list(ends), None if axes is None else list(axes))


@register("Expand", since=8, backend="cuda")
def expand(input: torch.Tensor, shape: Any) -> torch.Tensor:
    """Broadcast ``input`` against ``shape`` (the output may be larger than ``shape``)."""
    target = host_ints(shape)
    try:
        out_shape = torch.broadcast_shapes(tuple(input.shape), tuple(target))
    except RuntimeError:
        raise ValueError(
            f"Expand: input shape {list(input.shape)} does not broadcast with shape {target}"
        ) from None
    return input.expand(out_shape).contiguous()


@register("Tile", since=6, backend="cuda")
def tile(input: torch.Tensor, repeats: Any) -> torch.Tensor:
    """Repeat the whole tensor ``repeats[i]`` times along each axis i."""
    reps = host_ints(repeats)
    if len(reps) != input.dim() or any(r < 0 for r in reps):
        raise ValueError(
            f"Tile: repeats {reps} must be {input.dim()} non-negative values for input "
            f"{list(input.shape)}"
        )
    if not reps:
        return input.clone()
    return input.repeat(*reps)


@register("Tile", since=1, backend="cuda")
def tile_one_axis(input: torch.Tensor, tiles: Any, axis: Any) -> torch.Tensor:
    """Tile-1: repeat ``tiles`` times along the single axis ``axis``."""
    reps = [1] * input.dim()
    reps[norm_axis(host_ints(axis)[0], input.dim(), "Tile")] = host_ints(tiles)[0]
    return tile(input, reps)


# ---------------------------------------------------------------------------------------------
# Pad, CenterCropPad


def _pad_index(size: int, before: int, after: int, mode: str, device: torch.device):
    """Source positions along one axis for the padded output (edge, reflect or wrap)."""
    i = torch.arange(-before, size + after, device=device)
    if mode == "edge":
        return i.clamp(0, size - 1)
    if mode == "wrap":
        return i.remainder(size)
    period = 2 * (size - 1)  # reflect: mirror about the first and the last element
    if period == 0:
        return torch.zeros_like(i)
    m = i.abs().remainder(period)
    return torch.where(m >= size, period - m, m)


def _fill_value(data: torch.Tensor, constant_value: Any, value: float) -> Any:
    if constant_value is None:
        return value
    if isinstance(constant_value, torch.Tensor):
        if constant_value.numel() == 0:
            return 0
        return constant_value.reshape(-1)[0].to(data.dtype)  # stays on the device
    flat = np.asarray(constant_value).reshape(-1)
    return flat[0].item() if flat.size else 0


@register("Pad", since=1, backend="cuda")
def pad(
    data: torch.Tensor,
    pads: Any = None,
    constant_value: Any = None,
    axes: Any = None,
    *,
    mode: str = "constant",
    value: float = 0.0,
    paddings: Sequence[int] | None = None,
) -> torch.Tensor:
    """Pad (negative pads crop) in constant, reflect, edge or wrap mode, pads as attribute
    (opsets 1, 2) or input (11; axes from 18)."""
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise ValueError(f"Pad: unknown mode '{mode}' (constant, reflect, edge or wrap)")
    flat = host_ints(pads if pads is not None else paddings)
    if flat is None:
        raise ValueError("Pad: pads are required")
    rank = data.dim()
    axes_list = list(range(rank)) if axes is None else norm_axes(host_ints(axes), rank, "Pad")
    if len(flat) != 2 * len(axes_list):
        raise ValueError(
            f"Pad: {len(flat)} pads given for {len(axes_list)} axes; expected {2 * len(axes_list)}"
        )
    begin, end = [0] * rank, [0] * rank
    for i, a in enumerate(axes_list):
        begin[a], end[a] = flat[i], flat[i + len(axes_list)]
    # Negative pads crop the input first (a view); then the positive ones pad.
    crop = tuple(
        slice(max(-b, 0), data.shape[d] - max(-e, 0)) for d, (b, e) in enumerate(zip(begin, end))
    )
    data = data[crop]
    widths = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
    if mode == "constant":
        out_shape = [s + b + e for s, (b, e) in zip(data.shape, widths)]
        out = torch.empty(out_shape, dtype=data.dtype, device=data.device)
        out.fill_(_fill_value(data, constant_value, value))
        out[tuple(slice(b, b + s) for s, (b, _) in zip(data.shape, widths))] = data
        return out
    for d, (b, e) in enumerate(widths):
        if (b or e) and data.shape[d] == 0:
            raise ValueError(f"Pad: cannot pad empty axis {d} in '{mode}' mode")
        if mode == "reflect" and max(b, e) >= data.shape[d]:
            raise ValueError(
                f"Pad: reflect pads ({b}, {e}) of axis {d} must be smaller than its size "
                f"{data.shape[d]} (after negative pads crop)"
            )
    out = data
    for d, (b, e) in enumerate(widths):
        if b or e:
            out = out.index_select(d, _pad_index(data.shape[d], b, e, mode, data.device))
    return out.clone() if out is data else out


@register("CenterCropPad", since=18, backend="cuda")
def center_crop_pad(
    input_data: torch.Tensor, shape: Any, *, axes: Sequence[int] | None = None
) -> torch.Tensor:
    """Crop or zero-pad the given axes to ``shape``, keeping the content centred."""
    target = host_ints(shape)
    rank = input_data.dim()
    axes_list = norm_axes(list(range(rank)) if axes is None else list(axes), rank, "CenterCropPad")
    if len(target) != len(axes_list):
        raise ValueError(f"CenterCropPad: shape {target} has not one value per axis {axes_list}")
    out_shape = list(input_data.shape)
    src = [slice(None)] * rank
    dst = [slice(None)] * rank
    for a, size in zip(axes_list, target):
        dim = input_data.shape[a]
        out_shape[a] = size
        if size < dim:
            start = (dim - size) // 2
            src[a] = slice(start, start + size)
        elif size > dim:
            start = (size - dim) // 2
            dst[a] = slice(start, start + dim)
    out = torch.zeros(out_shape, dtype=input_data.dtype, device=input_data.device)
    out[tuple(dst)] = input_data[tuple(src)]
    return out


# ---------------------------------------------------------------------------------------------
# Shape, Size, constants, Identity, Range, EyeLike, Trilu


@register("Shape", since=1, backend="cuda")
def shape(data: Any, *, start: int = 0, end: int | None = None) -> torch.Tensor:
    """The input's shape as int64 on the device, optionally only dimensions [start, end)."""
    dims = list(data.shape)[start:end]
    return to_device(np.array(dims, dtype=np.int64), device_of(data))


@register("Size", since=1, backend="cuda")
def size(data: Any) -> torch.Tensor:
    """The number of elements, as an int64 scalar on the device."""
    return to_device(np.array(math.prod(data.shape), dtype=np.int64), device_of(data))


@register("ConstantOfShape", since=9, backend="cuda")
def constant_of_shape(input: Any, *, value: np.ndarray | None = None) -> torch.Tensor:
    """A tensor of shape ``input`` filled with ``value`` (float32 0 by default)."""
    dims = host_ints(input)
    if any(d < 0 for d in dims):
        raise ValueError(f"ConstantOfShape: negative dimension in shape {dims}")
    value = np.zeros(1, dtype=np.float32) if value is None else np.asarray(value)
    if value.size != 1:
        raise ValueError(f"ConstantOfShape: value must hold one element, not {value.size}")
    fill = to_device(value.reshape(()), device_of(input))
    return fill.expand(dims).contiguous() if dims else fill


@register("Constant", since=1, backend="cuda")
def constant(**attrs: Any) -> Any:
    """The one value attribute that is set, as a tensor on the current device (strings stay
    numpy arrays on the host)."""
    return to_device(ref.constant(**attrs), current_device())


@register("Identity", since=1, backend="cuda")
def identity(input: Any) -> Any:
    """The input unchanged: a tensor, a sequence (list) or an optional (``None`` when empty)."""
    return list(input) if isinstance(input, list) else input


_STASH_DTYPES = {1: torch.float32, 11: torch.float64}


@register("Range", since=11, backend="cuda")
def range_(
    start: torch.Tensor, limit: torch.Tensor, delta: torch.Tensor, *, stash_type: int = 1
) -> torch.Tensor:
    """``start + i * delta`` for i in [0, ceil((limit - start) / delta)), in start's type."""
    dtype, device = start.dtype, start.device
    if not dtype.is_floating_point:
        s, lim, d = (int(host_scalar(v)) for v in (start, limit, delta))
        if d == 0:
            raise ValueError("Range: delta is 0")
        n = max(-((s - lim) // d), 0)
        return (s + torch.arange(n, dtype=torch.int64, device=device) * d).to(dtype)
    # float16/bfloat16 compute in the stash type (float32 by default); other floats in their own.
    # The three scalars are rebuilt on the host (exactly: Python floats hold any of these types).
    compute = _STASH_DTYPES.get(stash_type, torch.float32) if dtype.itemsize <= 2 else dtype
    s, lim, d = (
        torch.tensor(host_scalar(v), dtype=dtype).to(compute) for v in (start, limit, delta)
    )
    if d == 0:
        raise ValueError("Range: delta is 0")
    n = max(math.ceil((lim - s).item() / d.item()), 0)
    return (torch.arange(n, dtype=compute, device=device) * d.item() + s.item()).to(dtype)


@register("EyeLike", since=9, backend="cuda")
def eye_like(input: torch.Tensor, *, dtype: int | None = None, k: int = 0) -> torch.Tensor:
    """A 2-D tensor shaped like ``input`` with ones on diagonal ``k``."""
    if input.dim() != 2:
        raise ValueError(f"EyeLike: input must be 2-D, got shape {list(input.shape)}")
    out_dtype = input.dtype if dtype is None else torch_dtype(DType(dtype).numpy)
    rows, cols = input.shape
    r = torch.arange(rows, device=input.device).unsqueeze(1)
    c = torch.arange(cols, device=input.device)
    return (c - r == k).to(out_dtype)


@register("Trilu", since=14, backend="cuda")
def trilu(input: torch.Tensor, k: Any = None, *, upper: int = 1) -> torch.Tensor:
    """Keep the upper (or lower) triangle of the last two axes from diagonal ``k``; zero others."""
    if input.dim() < 2:
        raise ValueError(f"Trilu: input must have rank >= 2, got shape {list(input.shape)}")
    k = 0 if k is None else int(host_scalar(k))
    x = as_signed(input)
    y = torch.triu(x, k) if upper else torch.tril(x, k)
    return from_signed(y, input.dtype)


# ---------------------------------------------------------------------------------------------
# DepthToSpace, SpaceToDepth


def _check_nchw(op: str, x: torch.Tensor, blocksize: int) -> None:
    if x.dim() != 4:
        raise ValueError(f"{op}: input must be 4-D (N, C, H, W), got shape {list(x.shape)}")
    if blocksize < 1:
        raise ValueError(f"{op}: blocksize must be positive, got {blocksize}")


@register("DepthToSpace", since=1, backend="cuda")
def depth_to_space(input: torch.Tensor, *, blocksize: int, mode: str = "DCR") -> torch.Tensor:
    """Move blocks of channels into (H, W) blocks; DCR: depth-column-row, CRD: column-row-depth."""
    _check_nchw("DepthToSpace", input, blocksize)
    n, c, h, w = input.shape
    b = blocksize
    if c % (b * b):
        raise ValueError(f"DepthToSpace: channels {c} not divisible by blocksize^2 = {b * b}")
    if mode == "DCR":
        x = input.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        x = input.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    else:
        raise ValueError(f"DepthToSpace: unknown mode '{mode}' (DCR or CRD)")
    return x.reshape(n, c // (b * b), h * b, w * b)


@register("SpaceToDepth", since=1, backend="cuda")
def space_to_depth(input: torch.Tensor, *, blocksize: int, mode: str = "DCR") -> torch.Tensor:
    """Move (H, W) blocks into channels; the inverse of DepthToSpace with the same mode."""
    _check_nchw("SpaceToDepth", input, blocksize)
    n, c, h, w = input.shape
    b = blocksize
    if h % b or w % b:
        raise ValueError(f"SpaceToDepth: H={h} and W={w} must be divisible by blocksize {b}")
    x = input.reshape(n, c, h // b, b, w // b, b)
    if mode == "DCR":
        x = x.permute(0, 3, 5, 1, 2, 4)
    elif mode == "CRD":
        x = x.permute(0, 1, 3, 5, 2, 4)
    else:
        raise ValueError(f"SpaceToDepth: unknown mode '{mode}' (DCR or CRD)")
    return x.reshape(n, c * b * b, h // b, w // b)
