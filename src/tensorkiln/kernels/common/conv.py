"""Backend-neutral checks and geometry of the convolutions (Conv, ConvTranspose, ConvInteger,
QLinearConv, DeformConv, ConvAct): every kernel tree takes them from here. Conv and ConvAct are
written here once (signature, checks, geometry) over each tree's :class:`ConvArrays`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

# The window geometry itself (Geometry, geometry, ints) is shared with the pools.
from tensorkiln.kernels.common.window import Geometry, geometry, ints
from tensorkiln.ops.fused import check_activation


def check_conv_shapes(
    x_shape: Sequence[int], w_shape: Sequence[int], group: int, what: str = "Conv"
) -> None:
    """Raise ValueError unless X (N, C, D1, ...) and W (M, C/group, k1, ...) fit ``group``."""
    x, w = tuple(x_shape), tuple(w_shape)
    if len(x) < 3 or len(w) != len(x):
        raise ValueError(
            f"{what}: X of shape {x} and W of shape {w} must both have rank >= 3 "
            "and the same rank (N, C, D1, ...) / (M, C/group, k1, ...)"
        )
    if group < 1 or x[1] != w[1] * group:
        raise ValueError(
            f"{what}: X has {x[1]} channels but W of shape {w} with group={group} "
            f"expects {w[1] * group}"
        )
    if w[0] % group:
        raise ValueError(f"{what}: W's {w[0]} output channels are not divisible by group={group}")


def conv_geometry(
    x_shape: Sequence[int], w_shape: Sequence[int], auto_pad, dilations, kernel_shape, pads, strides
) -> Geometry:
    """The window geometry of a convolution of X (N, C, *spatial) by W (M, C/g, *kernel); every
    backend's convolution takes it from here (ValueError when the attributes contradict W)."""
    kernel = tuple(w_shape[2:])
    if kernel_shape is not None and len(kernel_shape) and tuple(kernel_shape) != kernel:
        raise ValueError(
            f"kernel_shape {tuple(kernel_shape)} does not match W's shape {tuple(w_shape)}"
        )
    return geometry(tuple(x_shape[2:]), kernel, strides, dilations, pads, auto_pad)


def transpose_pads(
    in_sizes, kernel, strides, dilations, pads, auto_pad, output_padding, output_shape
) -> tuple[list[int], list[int]]:
    """ConvTranspose's begin pads and output sizes."""
    n = len(in_sizes)
    full = [
        (i - 1) * s + (k - 1) * d + 1 for i, s, k, d in zip(in_sizes, strides, kernel, dilations)
    ]
    full = [f + a for f, a in zip(full, output_padding)]
    if output_shape is not None and len(output_shape):
        out = [int(o) for o in output_shape[-n:]]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [i * s for i, s in zip(in_sizes, strides)]
    else:
        if auto_pad == "VALID":
            pads = None
        pads = ints(pads, 2 * n, 0, "pads")
        return list(pads[:n]), [f - b - e for f, b, e in zip(full, pads[:n], pads[n:])]
    total = [f - o for f, o in zip(full, out)]
    if auto_pad == "SAME_UPPER":
        begin = [t // 2 for t in total]
    else:
        begin = [t - t // 2 for t in total]
    return begin, out


class TransposeGeometry(NamedTuple):
    """A ConvTranspose's resolved window: the output is [begin, begin + out) of the full result."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: list[int]
    out: list[int]


def transpose_geometry(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    group: int,
    auto_pad: str,
    dilations: Sequence[int] | None,
    output_padding: Sequence[int] | None,
    output_shape: Sequence[int] | None,
    pads: Sequence[int] | None,
    strides: Sequence[int] | None,
) -> TransposeGeometry:
    """ConvTranspose's shapes checked (X (N, C, D...), W (C, M/group, k...)) and its window
    resolved; every backend's ConvTranspose takes it from here."""
    x, w = tuple(x_shape), tuple(w_shape)
    if len(x) < 3 or len(w) != len(x) or x[1] != w[0] or x[1] % group:
        raise ValueError(
            f"ConvTranspose: X of shape {x} needs W of shape (C={x[1] if len(x) > 1 else '?'}, "
            f"M/group, k...) with C divisible by group={group}; got W of shape {w}"
        )
    nsp = len(x) - 2
    kernel = w[2:]
    strides = ints(strides, nsp, 1, "strides")
    dilations = ints(dilations, nsp, 1, "dilations")
    output_padding = ints(output_padding, nsp, 0, "output_padding")
    begin, out = transpose_pads(
        x[2:], kernel, strides, dilations, pads, auto_pad, output_padding, output_shape
    )
    if any(o <= 0 for o in out):
        raise ValueError(f"ConvTranspose: computed output size {tuple(out)} is not positive")
    return TransposeGeometry(kernel, strides, dilations, begin, out)


CAUSAL_ACTIVATIONS = ("none", "silu", "swish")


def check_causal_conv(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    past_shape: Sequence[int] | None,
    activation: str,
) -> None:
    """Raise ValueError unless CausalConvWithState's X (B, C, L), W (C, 1, k) and past_state
    (B, C, k-1) fit and its activation is known."""
    if activation not in CAUSAL_ACTIVATIONS:
        raise ValueError(f"CausalConvWithState: activation must be one of {CAUSAL_ACTIVATIONS}")
    x, w = tuple(x_shape), tuple(w_shape)
    if len(x) != 3 or len(w) != 3 or w[:2] != (x[1], 1):
        raise ValueError(
            f"CausalConvWithState: input must be (B, C, L) and weight (C, 1, k); got {x} and {w}"
        )
    want = (x[0], x[1], w[2] - 1)
    if past_shape is not None and tuple(past_shape) != want:
        raise ValueError(
            f"CausalConvWithState: past_state has shape {tuple(past_shape)}, expected {want}"
        )


def check_conv_act(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    b_size: int | None,
    group: int,
    activation: str,
    residual_order: str,
) -> None:
    """Raise ValueError unless a tensorkiln.ConvAct node's X, W, bias size (None: no bias),
    group, activation and residual order fit together."""
    check_conv_shapes(x_shape, w_shape, group, "ConvAct")
    check_activation(activation, "ConvAct")
    if residual_order not in ("add_act", "act_add"):
        raise ValueError(
            f"ConvAct: residual_order must be add_act or act_add, not {residual_order!r}"
        )
    m = w_shape[0]
    if b_size is not None and b_size != m:
        raise ValueError(f"ConvAct: bias B has {b_size} values but there are {m} output channels")


class ConvArrays(Protocol):
    """What Conv and tensorkiln.ConvAct need from one backend: the geometry (memoized on the
    torch path) and the convolution with its epilogue (cuDNN / oneDNN / native, numpy)."""

    def geometry(
        self, x: Any, w: Any, auto_pad, dilations, kernel_shape, pads, strides
    ) -> Geometry:
        """:func:`conv_geometry` of ``x`` and ``w`` under the node's attributes."""

    def conv(self, x: Any, w: Any, b: Any, g: Geometry, group: int) -> Any:
        """The convolution of checked X, W under ``g``, + the bias B (None, or M values)."""

    def conv_act(
        self, x: Any, w: Any, b: Any, z: Any, g: Geometry, group: int, act: tuple, after: bool
    ) -> Any:
        """act(conv(x, w) + b + z), or act(conv(x, w) + b) + z when ``after``; ``act`` is
        (activation, activation_alpha, activation_beta, activation_min, activation_max)."""

    def conv_transpose(self, x: Any, w: Any, b: Any, tg: TransposeGeometry, group: int) -> Any:
        """The transposed convolution of checked X, W: the window [begin, begin + out) of the
        unpadded result, + the bias B (None, or group * W.shape[1] values)."""


def conv(
    xp: ConvArrays,
    x: Any,
    w: Any,
    b: Any = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Any:
    """Conv: N-d convolution (cross-correlation) with groups, dilations, strides and padding."""
    check_conv_shapes(x.shape, w.shape, group)
    g = xp.geometry(x, w, auto_pad, dilations, kernel_shape, pads, strides)
    return xp.conv(x, w, b, g, group)


def conv_transpose(
    xp: ConvArrays,
    x: Any,
    w: Any,
    b: Any = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,  # W's shape says it
    output_padding: Sequence[int] | None = None,
    output_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Any:
    """ConvTranspose: N-d transposed convolution; the output is the window [begin, begin + out)
    of the unpadded result, zero-extended where it reaches past it (output_padding, a larger
    output_shape)."""
    tg = transpose_geometry(
        x.shape, w.shape, group, auto_pad, dilations, output_padding, output_shape, pads, strides
    )
    return xp.conv_transpose(x, w, b, tg, group)


def conv_act(
    xp: ConvArrays,
    x: Any,
    w: Any,
    b: Any = None,
    z: Any = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
    activation: str = "",
    activation_alpha: float | None = None,  # None: the op's default (LeakyRelu 0.01, ...)
    activation_beta: float | None = None,
    activation_min: float | None = None,
    activation_max: float | None = None,
    residual_order: str = "add_act",
) -> Any:
    """tensorkiln.ConvAct: act(conv(x, w) + b + z) (or act(conv(x, w) + b) + z with
    ``residual_order="act_add"``)."""
    b_size = None if b is None else math.prod(b.shape)
    check_conv_act(x.shape, w.shape, b_size, group, activation, residual_order)
    g = xp.geometry(x, w, auto_pad, dilations, kernel_shape, pads, strides)
    act = (activation, activation_alpha, activation_beta, activation_min, activation_max)
    return xp.conv_act(x, w, b, z, g, group, act, residual_order == "act_add")


class IntConvArrays(Protocol):
    """What ConvInteger and QLinearConv need from one backend."""

    float64: Any
    float32: Any
    int32: Any

    def astype(self, x: Any, dtype: Any) -> Any: ...

    def conv(self, x: Any, w: Any, g: Geometry, group: int) -> Any:
        """The float64 convolution of X and W under ``g`` (no bias)."""

    def round(self, x: Any) -> Any:
        """Round half to even."""

    def saturate(self, y: Any, dtype: Any) -> Any:
        """``y`` clipped to the integer ``dtype``'s range and cast to it."""


def _per_channel(v: Any, trailing: int) -> Any:
    # per-output-channel values broadcast against W (M, ...) or a result (N, M, D1, ...)
    return v.reshape(-1, *([1] * trailing))


def _size(v: Any) -> int:
    return math.prod(v.shape)


class IntegerConv:
    """ConvInteger and QLinearConv over one backend's :class:`IntConvArrays`: the checks, the
    zero points, the bias and the requantization, written once. The products are exact: float64
    holds the integer sums."""

    def __init__(self, xp: IntConvArrays) -> None:
        self.xp = xp

    def _int_conv(self, x: Any, w: Any, x_zp: Any, w_zp: Any, group: int, g: Geometry, what: str):
        """Exact integer convolution of (x - x_zp) and (w - w_zp), computed in float64."""
        xp, m = self.xp, w.shape[0]
        xf = xp.astype(x, xp.float64)
        if x_zp is not None:
            if _size(x_zp) != 1:
                raise ValueError(
                    f"{what}: x_zero_point must be a scalar, got shape {tuple(x_zp.shape)}"
                )
            xf = xf - xp.astype(x_zp.reshape(()), xp.float64)
        wf = xp.astype(w, xp.float64)
        if w_zp is not None:
            if _size(w_zp) not in (1, m):
                raise ValueError(
                    f"{what}: w_zero_point has {_size(w_zp)} values, expected 1 or {m}"
                )
            wf = wf - xp.astype(_per_channel(w_zp, w.ndim - 1), xp.float64)
        return xp.conv(xf, wf, g, group)

    def conv_integer(
        self,
        x: Any,
        w: Any,
        x_zero_point: Any = None,
        w_zero_point: Any = None,
        *,
        auto_pad: str = "NOTSET",
        dilations: Sequence[int] | None = None,
        group: int = 1,
        kernel_shape: Sequence[int] | None = None,
        pads: Sequence[int] | None = None,
        strides: Sequence[int] | None = None,
    ) -> Any:
        """Integer convolution with zero points; exact int32 result."""
        check_conv_shapes(x.shape, w.shape, group, "ConvInteger")
        g = conv_geometry(x.shape, w.shape, auto_pad, dilations, kernel_shape, pads, strides)
        y = self._int_conv(x, w, x_zero_point, w_zero_point, group, g, "ConvInteger")
        return self.xp.astype(y, self.xp.int32)

    def qlinear_conv(
        self,
        x: Any,
        x_scale: Any,
        x_zero_point: Any,
        w: Any,
        w_scale: Any,
        w_zero_point: Any,
        y_scale: Any,
        y_zero_point: Any,
        b: Any = None,
        *,
        auto_pad: str = "NOTSET",
        dilations: Sequence[int] | None = None,
        group: int = 1,
        kernel_shape: Sequence[int] | None = None,
        pads: Sequence[int] | None = None,
        strides: Sequence[int] | None = None,
    ) -> Any:
        """Quantized convolution: exact accumulation, float32 requantization, round half to
        even."""
        check_conv_shapes(x.shape, w.shape, group, "QLinearConv")
        g = conv_geometry(x.shape, w.shape, auto_pad, dilations, kernel_shape, pads, strides)
        m = w.shape[0]
        acc = self._int_conv(x, w, x_zero_point, w_zero_point, group, g, "QLinearConv")
        if b is not None:
            if _size(b) != m:
                raise ValueError(
                    f"QLinearConv: bias B has {_size(b)} values but there are {m} output channels"
                )
            acc = acc + self.xp.astype(_per_channel(b, acc.ndim - 2), self.xp.float64)
        if _size(w_scale) not in (1, m):
            raise ValueError(f"QLinearConv: w_scale has {_size(w_scale)} values, expected 1 or {m}")
        return self._requantize(acc, x_scale, w_scale, y_scale, y_zero_point)

    def _requantize(self, acc: Any, x_scale: Any, w_scale: Any, y_scale: Any, y_zp: Any) -> Any:
        """round(acc * x_scale * w_scale / y_scale) + y_zero_point in float32, saturated."""
        xp = self.xp

        def first(v: Any) -> Any:  # a scalar input's value, as float32
            return xp.astype(v.reshape(-1)[0], xp.float32)

        scale = first(x_scale) * xp.astype(w_scale.reshape(-1), xp.float32) / first(y_scale)
        y = xp.round(xp.astype(acc, xp.float32) * _per_channel(scale, acc.ndim - 2)) + first(y_zp)
        return xp.saturate(y, y_zp.dtype)
