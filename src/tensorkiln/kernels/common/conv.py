"""Backend-neutral checks and geometry of the convolutions (Conv, ConvTranspose, ConvInteger,
QLinearConv, DeformConv, ConvAct): every kernel tree takes them from here."""

from __future__ import annotations

from collections.abc import Sequence

# The window geometry itself (Geometry, geometry, ints) is shared with the pools.
from tensorkiln.kernels.common.window import Geometry, geometry, ints


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
