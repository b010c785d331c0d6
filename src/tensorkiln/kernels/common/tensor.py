"""Data movement written once for both kernel trees: axis and shape arithmetic, the checks of
Reshape, Slice, Tile, CenterCropPad and Constant, and DepthToSpace/SpaceToDepth themselves.

Everything here reads shapes and small host lists (ints), never a tensor's values, so the cuda
kernels use it without a device synchronization. DepthToSpace and SpaceToDepth only reshape and
permute, which numpy arrays and torch tensors both do, so one function serves both backends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Shape = Sequence[int]


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


def reshape_dims(shape: Shape, numel: int, dims: list[int], allowzero: int) -> list[int]:
    """Reshape's target for an input of ``shape``: 0 copies the input's dimension unless
    ``allowzero``, one -1 is inferred; ValueError when the element counts differ."""
    shape, dims = list(shape), list(dims)
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
                f"Reshape: cannot infer -1 in {dims} for an input of shape {shape} "
                f"({numel} elements)"
            )
        dims[dims.index(-1)] = numel // known
    if math.prod(dims) != numel:
        raise ValueError(
            f"Reshape: cannot reshape input of shape {shape} ({numel} elements) to "
            f"{dims} ({math.prod(dims)} elements)"
        )
    return dims


def split_sizes(
    dim: int, axis: int, sizes: list[int] | None, num_outputs: int | None, n_outputs: int
) -> list[int]:
    """Split's part sizes along ``axis`` (of size ``dim``): the ``split`` input or attribute, else
    equal parts; with ``num_outputs`` (opset 18) an uneven split makes the last part smaller,
    without it the dimension must divide evenly into the node's outputs."""
    if not sizes:  # None, or an empty 'split' input
        n = num_outputs if num_outputs is not None else n_outputs
        if num_outputs is None and dim % n:
            raise ValueError(
                f"Split: dimension {axis} of size {dim} is not divisible into {n} parts"
            )
        chunk = -(-dim // n)
        sizes = [min(chunk, max(dim - i * chunk, 0)) for i in range(n)]
    elif len(sizes) != n_outputs:
        raise ValueError(f"Split: {len(sizes)} sizes {sizes} given for {n_outputs} outputs")
    if sum(sizes) != dim or any(s < 0 for s in sizes):
        raise ValueError(f"Split: sizes {sizes} do not add up to dimension {axis} of size {dim}")
    return sizes


def slice_plan(
    starts: list[int],
    ends: list[int],
    axes: list[int] | None,
    steps: list[int] | None,
    rank: int,
) -> list[tuple[int, int, int, int]]:
    """Slice's (axis, start, end, step) per sliced axis, axes normalized; Slice-1 has no steps."""
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError(
            f"Slice: starts, ends, axes and steps differ in length "
            f"({len(starts)}, {len(ends)}, {len(axes)}, {len(steps)})"
        )
    plan = list(zip(norm_axes(axes, rank, "Slice"), starts, ends, steps))
    for axis, _, _, step in plan:
        if step == 0:
            raise ValueError(f"Slice: step of axis {axis} is 0")
    return plan


def tile_repeats(shape: Shape, repeats: list[int], axis: list[int] | None, opset: int) -> list[int]:
    """Tile's repeats per axis: Tile-6 gives one per axis; Tile-1 gives ``tiles`` (here
    ``repeats``) for the single axis ``axis``."""
    rank = len(shape)
    if opset < 6:
        if axis is None:
            raise ValueError("Tile-1 needs its axis input")
        reps = [1] * rank
        reps[norm_axis(axis[0], rank, "Tile")] = repeats[0]
        return reps
    if len(repeats) != rank or any(r < 0 for r in repeats):
        raise ValueError(
            f"Tile: repeats {repeats} must be {rank} non-negative values for input {list(shape)}"
        )
    return repeats


PAD_MODES = ("constant", "reflect", "edge", "wrap")


def pad_plan(
    shape: Shape, pads: list[int] | None, axes: list[int] | None, mode: str
) -> tuple[tuple[slice, ...], list[tuple[int, int]]]:
    """Pad's crop of the input (negative pads crop first) and the (before, after) widths of each
    axis that then pad it; pads come as an attribute (opsets 1, 2) or an input (11; axes from
    18)."""
    if mode not in PAD_MODES:
        raise ValueError(f"Pad: unknown mode '{mode}' (constant, reflect, edge or wrap)")
    if pads is None:
        raise ValueError("Pad: pads are required")
    rank = len(shape)
    axes_list = list(range(rank)) if axes is None else norm_axes(axes, rank, "Pad")
    if len(pads) != 2 * len(axes_list):
        raise ValueError(
            f"Pad: {len(pads)} pads given for {len(axes_list)} axes; expected {2 * len(axes_list)}"
        )
    begin, end = [0] * rank, [0] * rank
    for i, a in enumerate(axes_list):
        begin[a], end[a] = pads[i], pads[i + len(axes_list)]
    crop = tuple(
        slice(max(-b, 0), shape[d] - max(-e, 0)) for d, (b, e) in enumerate(zip(begin, end))
    )
    widths = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
    return crop, widths


def check_pad_widths(shape: Shape, widths: list[tuple[int, int]], mode: str) -> None:
    """The non-constant modes read the (cropped) input's edge: it must exist, and reflect's pads
    must be smaller than the axis."""
    for d, (b, e) in enumerate(widths):
        if (b or e) and shape[d] == 0:
            raise ValueError(f"Pad: cannot pad empty axis {d} in '{mode}' mode")
        if mode == "reflect" and max(b, e) >= shape[d]:
            raise ValueError(
                f"Pad: reflect pads ({b}, {e}) of axis {d} must be smaller than its size "
                f"{shape[d]} (after negative pads crop)"
            )


def crop_pad_plan(
    shape: Shape, target: list[int], axes: Sequence[int] | None
) -> tuple[list[int], tuple[slice, ...], tuple[slice, ...]]:
    """CenterCropPad's output shape and the (source, destination) windows of the kept content,
    centred on each axis of ``axes``."""
    rank = len(shape)
    axes_list = norm_axes(list(range(rank)) if axes is None else list(axes), rank, "CenterCropPad")
    if len(target) != len(axes_list):
        raise ValueError(f"CenterCropPad: shape {target} has not one value per axis {axes_list}")
    out_shape = list(shape)
    src = [slice(None)] * rank
    dst = [slice(None)] * rank
    for a, size in zip(axes_list, target):
        dim = shape[a]
        out_shape[a] = size
        if size < dim:
            start = (dim - size) // 2
            src[a] = slice(start, start + size)
        elif size > dim:
            start = (size - dim) // 2
            dst[a] = slice(start, start + dim)
    return out_shape, tuple(src), tuple(dst)


def constant(
    *,
    value: np.ndarray | None = None,
    sparse_value: np.ndarray | None = None,
    value_float: float | None = None,
    value_floats: Sequence[float] | None = None,
    value_int: int | None = None,
    value_ints: Sequence[int] | None = None,
    value_string: str | None = None,
    value_strings: Sequence[str] | None = None,
) -> np.ndarray:
    """Constant's value: the one attribute that is set, as a host array (the cuda backend
    uploads it)."""
    given = {
        "value": None if value is None else np.asarray(value),
        "sparse_value": None if sparse_value is None else np.asarray(sparse_value),
        "value_float": None if value_float is None else np.array(value_float, np.float32),
        "value_floats": None if value_floats is None else np.array(value_floats, np.float32),
        "value_int": None if value_int is None else np.array(value_int, np.int64),
        "value_ints": None if value_ints is None else np.array(value_ints, np.int64),
        "value_string": None if value_string is None else np.array(value_string, dtype=object),
        "value_strings": None
        if value_strings is None
        else np.array(list(value_strings), dtype=object).reshape(-1),
    }
    set_ = [k for k, v in given.items() if v is not None]
    if len(set_) != 1:
        raise ValueError(f"Constant: exactly one value attribute must be set, got {set_ or 'none'}")
    return given[set_[0]]


def _permute(x: Any, perm: tuple[int, ...]) -> Any:
    """``x`` with its axes in ``perm`` order: torch spells it permute, numpy transpose."""
    return x.permute(*perm) if hasattr(x, "permute") else x.transpose(perm)


def _check_nchw(op: str, shape: Shape, blocksize: int) -> None:
    if len(shape) != 4:
        raise ValueError(f"{op}: input must be 4-D (N, C, H, W), got shape {list(shape)}")
    if blocksize < 1:
        raise ValueError(f"{op}: blocksize must be positive, got {blocksize}")


def depth_to_space(input: Any, *, blocksize: int, mode: str = "DCR") -> Any:
    """Move blocks of channels into (H, W) blocks; DCR: depth-column-row, CRD: column-row-depth.
    (A numpy array or a torch tensor; the result is a view where the strides allow.)"""
    _check_nchw("DepthToSpace", input.shape, blocksize)
    n, c, h, w = input.shape
    b = blocksize
    if c % (b * b):
        raise ValueError(f"DepthToSpace: channels {c} not divisible by blocksize^2 = {b * b}")
    if mode == "DCR":
        x = _permute(input.reshape(n, b, b, c // (b * b), h, w), (0, 3, 4, 1, 5, 2))
    elif mode == "CRD":
        x = _permute(input.reshape(n, c // (b * b), b, b, h, w), (0, 1, 4, 2, 5, 3))
    else:
        raise ValueError(f"DepthToSpace: unknown mode '{mode}' (DCR or CRD)")
    return x.reshape(n, c // (b * b), h * b, w * b)


def space_to_depth(input: Any, *, blocksize: int, mode: str = "DCR") -> Any:
    """Move (H, W) blocks into channels; the inverse of DepthToSpace with the same mode."""
    _check_nchw("SpaceToDepth", input.shape, blocksize)
    n, c, h, w = input.shape
    b = blocksize
    if h % b or w % b:
        raise ValueError(f"SpaceToDepth: H={h} and W={w} must be divisible by blocksize {b}")
    x = input.reshape(n, c, h // b, b, w // b, b)
    if mode == "DCR":
        x = _permute(x, (0, 3, 5, 1, 2, 4))
    elif mode == "CRD":
        x = _permute(x, (0, 1, 3, 5, 2, 4))
    else:
        raise ValueError(f"SpaceToDepth: unknown mode '{mode}' (DCR or CRD)")
    return x.reshape(n, c * b * b, h // b, w // b)
