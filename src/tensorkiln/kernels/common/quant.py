"""The checks of linear quantization (QuantizeLinear, DequantizeLinear), written once for both
kernel trees: where a scale or zero point applies, and the quantized type."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from onnx.helper import tensor_dtype_to_np_dtype


def scale_layout(
    v: Sequence[int], shape: Sequence[int], axis: int, block_size: int, what: str
) -> tuple[str, int, list[int]]:
    """How a scale or zero point of shape ``v`` applies to an input of ``shape``: ("tensor", ...)
    for one value, ("axis", axis, dims) per axis (``dims`` to reshape it to), or ("block", axis,
    []) per block of ``block_size`` along ``axis``; ValueError when its shape fits none."""
    if math.prod(v) == 1:
        return "tensor", 0, []
    rank = len(shape)
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for an input of rank {rank}")
    axis %= rank
    if not block_size:
        if len(v) != 1 or v[0] != shape[axis]:
            raise ValueError(
                f"per-axis {what} must be 1-D of length {shape[axis]} (input dim {axis}), "
                f"got shape {tuple(v)}; for blocked quantization set block_size"
            )
        dims = [1] * rank
        dims[axis] = v[0]
        return "axis", axis, dims
    expected = list(shape)
    expected[axis] = -(-shape[axis] // block_size)
    if list(v) != expected:
        raise ValueError(
            f"blocked {what} must have shape {tuple(expected)} for input {tuple(shape)}, axis "
            f"{axis} and block_size {block_size}; got {tuple(v)}"
        )
    return "block", axis, []


def quant_target(zero_point_dtype: np.dtype | None, output_dtype: int) -> np.dtype:
    """QuantizeLinear's result type: y_zero_point's type, which ``output_dtype`` must match when
    both are given, else ``output_dtype``, else uint8."""
    target = np.dtype(tensor_dtype_to_np_dtype(output_dtype)) if output_dtype else None
    if zero_point_dtype is not None:
        if target is not None and target != zero_point_dtype:
            raise ValueError(
                f"output_dtype {target} does not match y_zero_point's type {zero_point_dtype}"
            )
        target = zero_point_dtype
    return target or np.dtype(np.uint8)
