"""Torch kernels that move data without computing on it: reshapes, slices, pads, constants.

They mirror :mod:`tensorkiln.kernels.reference.tensor`, sharing its shape arithmetic and checks
(kernels/common/tensor.py, where DepthToSpace, SpaceToDepth and Constant are written once). Reshape, Flatten, Squeeze, Unsqueeze,
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
from tensorkiln.kernels.common import tensor as common
from tensorkiln.kernels.common.tensor import norm_axes, norm_axis
from tensorkiln.kernels.cuda.convert import current_device, host_list, to_torch, torch_dtype
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


@register("Reshape", since=1, backend="cuda")
def reshape(
    data: torch.Tensor, shape: Any = (), *, allowzero: int = 0, consumed_inputs: Any = None
) -> torch.Tensor:
    """Reshape (a view where the strides allow); 0 copies a dimension unless ``allowzero``.
    Reshape-1's attribute of the same name binds to ``shape`` (see the reference)."""
    dims = common.reshape_dims(data.shape, data.numel(), host_ints(shape), allowzero)
    return data.reshape(dims)


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
    dim = int(input.shape[axis])
    sizes = common.split_sizes(dim, axis, host_ints(split), num_outputs, _n_outputs)
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


@register("Slice", since=1, backend="cuda")
def slice_(
    data: torch.Tensor, starts: Any = (), ends: Any = (), axes: Any = None, steps: Any = None
) -> torch.Tensor:
    """Strided slice; out-of-range starts/ends clamp like Python slicing does (Slice-1's
    attributes bind to the inputs of the same names)."""
    plan = common.slice_plan(
        host_ints(starts), host_ints(ends), host_ints(axes), host_ints(steps), data.dim()
    )
    out = data
    for axis, start, end, step in plan:
        out = _slice_axis(out, axis, start, end, step)
    return out


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


@register("Tile", since=1, backend="cuda")
def tile(input: torch.Tensor, repeats: Any, axis: Any = None, *, _opset: int = 6) -> torch.Tensor:
    """Repeat the whole tensor ``repeats[i]`` times along each axis i (Tile-1: ``tiles`` times
    along the single axis ``axis``)."""
    reps = common.tile_repeats(input.shape, host_ints(repeats), host_ints(axis), _opset)
    if not reps:
        return input.clone()
    return input.repeat(*reps)


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
    flat = host_ints(pads if pads is not None else paddings)
    crop, widths = common.pad_plan(data.shape, flat, host_ints(axes), mode)
    data = data[crop]  # a view
    if mode == "constant":
        out_shape = [s + b + e for s, (b, e) in zip(data.shape, widths)]
        out = torch.empty(out_shape, dtype=data.dtype, device=data.device)
        out.fill_(_fill_value(data, constant_value, value))
        out[tuple(slice(b, b + s) for s, (b, _) in zip(data.shape, widths))] = data
        return out
    common.check_pad_widths(data.shape, widths, mode)
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
    out_shape, src, dst = common.crop_pad_plan(input_data.shape, host_ints(shape), axes)
    out = torch.zeros(out_shape, dtype=input_data.dtype, device=input_data.device)
    out[dst] = input_data[src]
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
    return to_device(common.constant(**attrs), current_device())


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


register("DepthToSpace", since=1, backend="cuda")(common.depth_to_space)
register("SpaceToDepth", since=1, backend="cuda")(common.space_to_depth)
