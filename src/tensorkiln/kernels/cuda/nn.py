"""Convolutions on the cuda backend: Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv,
CausalConvWithState.

Convolutions over 1-3 spatial axes are torch's (cuDNN's); asymmetric padding is applied with one
F.pad first, and inputs of more spatial axes are split over the taps of their first axis. The
integer convolutions compute in float64, which holds their sums exactly (cuDNN has no integer
convolution). Shapes and attributes are checked and resolved in kernels/common/conv.py, so both
backends agree on every geometry; DeformConv is kernels/common/deform.py's, over torch operations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tensorkiln.kernels.common import bind
from tensorkiln.kernels.common import conv as common_conv
from tensorkiln.kernels.common.conv import (
    IntegerConv,
    TransposeGeometry,
    check_causal_conv,
)
from tensorkiln.kernels.common.deform import DeformConv
from tensorkiln.kernels.common.window import Geometry
from tensorkiln.kernels.cpu.conv import cpu_layout
from tensorkiln.kernels.cuda.fused_conv import TorchConvArrays
from tensorkiln.kernels.registry import register

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to do arithmetic in: float32 for the narrow floats and bytes, else ``dtype``."""
    if dtype in (torch.float16, torch.bfloat16) or dtype.itemsize == 1:
        return torch.float32
    return dtype


def torch_pads(begin: Sequence[int], end: Sequence[int]) -> list[int]:
    """F.pad's argument (last axis first) for begin/end pads of the trailing axes."""
    out: list[int] = []
    for b, e in zip(reversed(begin), reversed(end)):
        out += [b, e]
    return out


def channel_view(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against (N, C, D1, ...) of rank ``ndim``."""
    return v.reshape(-1, *([1] * (ndim - 2)))


def _split_first_axis(x: torch.Tensor, w: torch.Tensor, g: Geometry, group: int) -> torch.Tensor:
    """Convolution of an already padded ``x`` with 4+ spatial axes: for each tap of the first
    axis, one convolution of the remaining axes with that axis folded into the batch."""
    n, c, o0 = x.shape[0], x.shape[1], g.out[0]
    rest = Geometry(g.kernel[1:], g.strides[1:], g.dilations[1:], (0,) * len(g.out[1:]),
                    (0,) * len(g.out[1:]), g.out[1:])  # fmt: skip
    y = None
    for t in range(g.kernel[0]):
        start = t * g.dilations[0]
        xs = x[:, :, start : start + (o0 - 1) * g.strides[0] + 1 : g.strides[0]]
        xs = xs.movedim(2, 1).reshape(n * o0, c, *xs.shape[3:])
        part = conv_nd(xs, w[:, :, t], None, rest, group)
        part = part.reshape(n, o0, *part.shape[1:]).movedim(1, 2)
        y = part if y is None else y + part
    return y


def conv_nd(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, g: Geometry, group: int
) -> torch.Tensor:
    """Convolution (cross-correlation) of ``x`` (N, C, ...) with ``w`` in ``x``'s dtype."""
    nsp = x.ndim - 2
    padding = tuple(g.begin)
    if tuple(g.begin) != tuple(g.end) or (nsp > 3 and g.padded):
        x, padding = F.pad(x, torch_pads(g.begin, g.end)), (0,) * nsp
    if nsp <= 3:
        x, w = cpu_layout(x, w)
        return _CONV[nsp](x, w, b, g.strides, padding, g.dilations, group)
    y = _split_first_axis(x, w, g, group)
    return y if b is None else y + channel_view(b, y.ndim)


def _bias(b: torch.Tensor | None, m: int, dtype: torch.dtype, what: str) -> torch.Tensor | None:
    if b is None:
        return None
    if b.numel() != m:
        raise ValueError(f"{what}: bias B has {b.numel()} values but there are {m} output channels")
    return b.reshape(-1).to(dtype)


class _TorchConvArrays(TorchConvArrays):
    """ConvAct's torch arrays with Conv's and ConvTranspose's convolutions (any number of
    spatial axes)."""

    def conv(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, g: Geometry, group: int
    ) -> torch.Tensor:
        return conv_nd(x, w.to(x.dtype), _bias(b, w.shape[0], x.dtype, "Conv"), g, group)

    def conv_transpose(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        tg: TransposeGeometry,
        group: int,
    ) -> torch.Tensor:
        kernel, strides, dilations, begin, out = tg
        nsp = x.ndim - 2
        w = w.to(x.dtype)
        bias = _bias(b, group * w.shape[1], x.dtype, "ConvTranspose")
        full = [
            (i - 1) * s + (k - 1) * d + 1
            for i, s, k, d in zip(x.shape[2:], strides, kernel, dilations)
        ]
        # torch crops `begin` from both ends and then appends output_padding zeros (< stride)
        extra = [bg + o - f + bg for bg, o, f in zip(begin, out, full)]
        if nsp <= 3 and all(bg >= 0 and 0 <= e < max(s, d) for bg, e, s, d in
                            zip(begin, extra, strides, dilations)):  # fmt: skip
            return _CONV_T[nsp](x, w, bias, strides, begin, extra, group, dilations)
        y = _transpose_raw(x, w, strides, dilations, group)
        y = F.pad(
            y, torch_pads([-bg for bg in begin], [bg + o - f for bg, o, f in zip(begin, out, full)])
        )
        return y if bias is None else y + channel_view(bias, y.ndim)


conv = bind(common_conv.conv, _TorchConvArrays(), __name__)
register("Conv", since=1, backend="cuda")(conv)
conv_transpose = bind(common_conv.conv_transpose, _TorchConvArrays(), __name__)
register("ConvTranspose", since=1, backend="cuda")(conv_transpose)


def _transpose_raw(
    x: torch.Tensor, w: torch.Tensor, strides: Sequence[int], dilations: Sequence[int], group: int
) -> torch.Tensor:
    """The unpadded transposed convolution (every output position any tap reaches)."""
    nsp = x.ndim - 2
    if nsp <= 3:
        return _CONV_T[nsp](x, w, None, strides, 0, 0, group, dilations)
    # 4+ spatial axes: fold the first input axis into the batch, then place each of its taps
    n, c, i0 = x.shape[:3]
    xs = x.movedim(2, 1).reshape(n * i0, c, *x.shape[3:])
    span = (i0 - 1) * strides[0] + 1
    y = None
    for t in range(w.shape[2]):
        part = _transpose_raw(xs, w[:, :, t], strides[1:], dilations[1:], group)
        part = part.reshape(n, i0, *part.shape[1:]).movedim(1, 2)
        if y is None:
            full = span + (w.shape[2] - 1) * dilations[0]
            y = part.new_zeros(n, part.shape[1], full, *part.shape[3:])
        start = t * dilations[0]
        y[:, :, start : start + span : strides[0]] += part
    return y


class TorchIntConvArrays:
    """:class:`tensorkiln.kernels.common.conv.IntConvArrays` on torch tensors."""

    float64, float32, int32 = torch.float64, torch.float32, torch.int32

    def astype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    def conv(self, x: torch.Tensor, w: torch.Tensor, g: Geometry, group: int) -> torch.Tensor:
        return conv_nd(x, w, None, g, group)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    def saturate(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        info = torch.iinfo(dtype)
        return y.clamp(info.min, info.max).to(dtype)


_INT_CONV = IntegerConv(TorchIntConvArrays())
register("ConvInteger", since=10, backend="cuda")(_INT_CONV.conv_integer)
register("QLinearConv", since=10, backend="cuda")(_INT_CONV.qlinear_conv)


class TorchDeformArrays:
    """:class:`tensorkiln.kernels.common.deform.DeformArrays` on torch tensors."""

    m = torch
    int64 = torch.int64

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return compute_dtype(dtype)

    def astype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    def zeros(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(shape)

    def grid(self, sizes: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        axes = [torch.arange(s, device=like.device) for s in sizes]
        return torch.stack(torch.meshgrid(*axes, indexing="ij")).reshape(len(sizes), -1)

    def take_last(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # torch.gather does not broadcast: the index is expanded over x's leading axes
        shape = torch.broadcast_shapes(x.shape[:-1], index.shape[:-1])
        return torch.gather(x.expand(*shape, x.shape[-1]), -1, index.expand(*shape, -1))


register("DeformConv", since=19, backend="cuda")(DeformConv(TorchDeformArrays()).deform_conv)


@register("CausalConvWithState", since=27, backend="cuda")
def causal_conv_with_state(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    past_state: torch.Tensor | None = None,
    *,
    activation: str = "none",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise 1-D conv over [past_state, x]; returns (output, last k-1 positions)."""
    check_causal_conv(
        x.shape, w.shape, None if past_state is None else past_state.shape, activation
    )
    bsz, c, length = x.shape
    k = w.shape[2]
    if past_state is None:
        past_state = x.new_zeros(bsz, c, k - 1)
    full = torch.cat([past_state.to(x.dtype), x], dim=2)
    ct = compute_dtype(x.dtype)
    bias = _bias(b, c, ct, "CausalConvWithState")
    y = F.conv1d(full.to(ct), w.to(ct), bias, groups=c)
    if activation != "none":
        y = F.silu(y)
    return y.to(x.dtype), full[:, :, length:].clone()
