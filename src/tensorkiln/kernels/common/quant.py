"""The checks of linear quantization (QuantizeLinear, DequantizeLinear), written once for both
kernel trees: where a scale or zero point applies, and the quantized type."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

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


REQUANTIZED = (3, 17)  # the out_dtype of a layer that quantizes its output: int8, float8 E4M3


def check_quantized_output(out_dtype: int, y_scale_size: int | None) -> None:
    """A quantized layer's (QConvAct's, QGemmAct's) ``out_dtype`` against its Y_scale (of
    ``y_scale_size`` values; None: absent): with it, one value and an 8-bit type; without, a
    float type (the caller checks which)."""
    if y_scale_size is None:
        if out_dtype in REQUANTIZED:
            raise ValueError(f"out_dtype {out_dtype} (8-bit) needs the output's scale Y_scale")
        return
    if out_dtype not in REQUANTIZED:
        raise ValueError(
            f"a quantized output (Y_scale given) is int8 or float8 E4M3 (out_dtype 3 or 17), "
            f"not type {out_dtype}"
        )
    if y_scale_size != 1:
        raise ValueError(f"Y_scale must be one value, got {y_scale_size}")


def check_quantized_residual(eight_bit: bool, what: str, z_scale_size: int) -> None:
    """QConvAct's residual read with Z_scale (of ``z_scale_size`` values): ``eight_bit``,
    whether the residual (``what``: its type, for the message) is an int8 or float8 tensor."""
    if not eight_bit or z_scale_size != 1:
        raise ValueError(
            "QConvAct: a residual with Z_scale must be int8 or float8 with one scale, got "
            f"{what} and {z_scale_size} scales"
        )


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


class QuantArrays(Protocol):
    """The array operations QLinearMatMul and MatMulInteger need, on one backend's arrays."""

    m: Any  # the array module (numpy or torch): matmul, round (half to even in both)
    float64: Any
    int32: Any

    def astype(self, x: Any, dtype: Any) -> Any: ...

    def is_integer_target(self, dtype: Any) -> bool:
        """Whether ``dtype`` is one of the integer types a quantized value may have."""

    def add_zero_point(self, y: Any, zero_point: Any) -> Any:
        """``y + zero_point`` (float64), leaving ``y`` as it is where the zero point is 0."""

    def saturate(self, y: Any, target: Any) -> Any:
        """``y`` (rounded for integer targets) cast to ``target``, saturating at its range."""


def _per_row(v: Any) -> Any:
    # A 1-D scale or zero point of A holds one value per row of A.
    return v.reshape(-1, 1) if len(v.shape) == 1 and math.prod(v.shape) > 1 else v


class QLinearMatMul:
    """QLinearMatMul and MatMulInteger over one backend's :class:`QuantArrays`."""

    def __init__(self, xp: QuantArrays) -> None:
        self.xp = xp

    def _exact_product(self, a: Any, b: Any, a_zero_point: Any, b_zero_point: Any) -> Any:
        """(A - a_zp) @ (B - b_zp) as a float64 matmul, exact for any realistic K (|sum| <
        2**53); A's zero point per row, B's per column."""
        xp, f64 = self.xp, self.xp.float64
        a64, b64 = xp.astype(a, f64), xp.astype(b, f64)
        if a_zero_point is not None:
            a64 = a64 - _per_row(xp.astype(a_zero_point, f64))
        if b_zero_point is not None:
            b64 = b64 - xp.astype(b_zero_point, f64)
        return xp.m.matmul(a64, b64)

    def matmul_integer(
        self, a: Any, b: Any, a_zero_point: Any = None, b_zero_point: Any = None
    ) -> Any:
        """(A - a_zero_point) @ (B - b_zero_point) in int32; A's zero point per row, B's per
        column."""
        return self.xp.astype(self._exact_product(a, b, a_zero_point, b_zero_point), self.xp.int32)

    def qlinear_matmul(
        self,
        a: Any,
        a_scale: Any,
        a_zero_point: Any,
        b: Any,
        b_scale: Any,
        b_zero_point: Any,
        y_scale: Any,
        y_zero_point: Any = None,
    ) -> Any:
        """Quantized MatMul: round((A - a_zp) @ (B - b_zp) * a_scale * b_scale / y_scale) + y_zp.

        The integer product runs as a float64 matmul, exact for any realistic K (|sum| < 2**53).
        """
        xp, f64 = self.xp, self.xp.float64
        acc = self._exact_product(a, b, a_zero_point, b_zero_point)
        # the rescale factor is formed in the scales' own type, as the spec's formula reads
        factor = _per_row(a_scale) * b_scale / y_scale
        y = acc * xp.astype(factor, f64)
        target = y_zero_point.dtype if y_zero_point is not None else a.dtype
        if xp.is_integer_target(target):
            y = xp.m.round(y)
        if y_zero_point is not None:
            y = xp.add_zero_point(y, y_zero_point)
        return xp.saturate(y, target)
