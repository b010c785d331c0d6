"""Convolutions: Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv, CausalConvWithState.

Every convolution is an im2col (a strided view of the padded input, copied once into a
``(C*k, positions)`` matrix) followed by one GEMM per group; 1x1 convolutions skip the im2col and
depthwise ones accumulate over the kernel taps instead of building the column matrix. Checks and
geometry are kernels/common/conv.py's; DeformConv is kernels/common/deform.py's, over numpy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from tensorkiln.kernels.common import bind
from tensorkiln.kernels.common import conv as common_conv
from tensorkiln.kernels.common.conv import (
    IntegerConv,
    TransposeGeometry,
    check_causal_conv,
    conv_geometry,
)
from tensorkiln.kernels.common.deform import DeformConv
from tensorkiln.kernels.common.window import Geometry, tap_slices
from tensorkiln.kernels.reference._window import compute_dtype, pad, windows
from tensorkiln.kernels.registry import register


def _gemm(w: np.ndarray, cols: np.ndarray, group: int) -> np.ndarray:
    """``(M, C/g*k)`` weights times ``(N, C*k, P)`` columns, per group -> ``(N, M, P)``."""
    n, ck, p = cols.shape
    m = w.shape[0]
    # explicit sizes, never -1: numpy cannot infer one when another axis is 0 (N=0, M=0)
    if group == 1:
        return np.matmul(w.reshape(m, ck), cols)
    wg = w.reshape(group, m // group, ck // group)
    return np.matmul(wg, cols.reshape(n, group, ck // group, p)).reshape(n, m, p)


def _depthwise(xp: np.ndarray, w: np.ndarray, g: Geometry) -> np.ndarray:
    """Depthwise conv (one input channel per group), accumulated over the kernel taps."""
    n, c = xp.shape[:2]
    mult = w.shape[0] // c
    wt = w.reshape(c, mult, math.prod(g.kernel))
    out = np.zeros((n, c, mult, *g.out), dtype=xp.dtype)
    bcast = (slice(None), slice(None)) + (None,) * len(g.out)
    for i, tap in enumerate(itertools.product(*(range(k) for k in g.kernel))):
        view = xp[(Ellipsis, *tap_slices(g, tap))]
        out += wt[:, :, i][bcast] * view[:, :, None]
    return out.reshape(n, c * mult, math.prod(g.out))


def _im2col(x: np.ndarray, g: Geometry) -> np.ndarray:
    """The ``(N, C*prod(kernel), prod(out))`` column matrix of ``x``."""
    n, c = x.shape[:2]
    p = math.prod(g.out)
    if all(k == 1 for k in g.kernel) and not g.padded:
        sl = tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(g.out, g.strides))
        return x[(Ellipsis, *sl)].reshape(n, c, p)
    xp = pad(x, g.begin, g.end)
    return windows(xp, g, kernel_first=True).reshape(n, c * math.prod(g.kernel), p)


def conv_nd(x: np.ndarray, w: np.ndarray, g: Geometry, group: int) -> np.ndarray:
    """Convolution of ``x`` (N, C, ...) with ``w`` in ``x``'s dtype; returns (N, M, *g.out)."""
    n, c = x.shape[:2]
    if group == c and w.shape[1] == 1 and group > 1:
        y = _depthwise(pad(x, g.begin, g.end), w, g)
    else:
        y = _gemm(w, _im2col(x, g), group)
    return y.reshape(n, w.shape[0], *g.out)


def _add_bias(y: np.ndarray, b: np.ndarray | None, m: int, what: str) -> np.ndarray:
    if b is None:
        return y
    if b.size != m:
        raise ValueError(f"{what}: bias B has {b.size} values but there are {m} output channels")
    y += b.astype(y.dtype, copy=False).reshape(m, *([1] * (y.ndim - 2)))
    return y


class NumpyConvArrays:
    """:class:`tensorkiln.kernels.common.conv.ConvArrays` of Conv and ConvTranspose on numpy
    arrays (ConvAct's convolution and epilogue are reference/fused_conv.py's)."""

    def geometry(self, x: np.ndarray, w: np.ndarray, *attrs) -> Geometry:
        return conv_geometry(x.shape, w.shape, *attrs)

    def conv(
        self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, g: Geometry, group: int
    ) -> np.ndarray:
        ct = compute_dtype(x.dtype)
        y = conv_nd(x.astype(ct, copy=False), w.astype(ct, copy=False), g, group)
        return _add_bias(y, b, w.shape[0], "Conv").astype(x.dtype, copy=False)

    def conv_transpose(
        self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, tg: TransposeGeometry, group: int
    ) -> np.ndarray:
        # one GEMM per group, then a col2im scatter-add
        kernel, strides, dilations, begin, out = tg
        n, c = x.shape[:2]
        nsp = x.ndim - 2
        ct = compute_dtype(x.dtype)
        mg = w.shape[1]
        taps, positions = math.prod(kernel), math.prod(x.shape[2:])
        wt = w.astype(ct, copy=False).reshape(group, c // group, mg * taps).transpose(0, 2, 1)
        xs = x.astype(ct, copy=False).reshape(n, group, c // group, positions)
        cols = np.matmul(wt, xs).reshape(n, group * mg, *kernel, *x.shape[2:])
        g = Geometry(kernel, strides, dilations, (0,) * nsp, (0,) * nsp, tuple(x.shape[2:]))
        y = _col2im(cols, g, begin, out)
        return _add_bias(y, b, group * mg, "ConvTranspose").astype(x.dtype, copy=False)


conv = bind(common_conv.conv, NumpyConvArrays(), __name__)
register("Conv", since=1)(conv)
conv_transpose = bind(common_conv.conv_transpose, NumpyConvArrays(), __name__)
register("ConvTranspose", since=1)(conv_transpose)


def _col2im(cols: np.ndarray, g: Geometry, begin: Sequence[int], out: Sequence[int]) -> np.ndarray:
    """Scatter-add ``cols`` (N, M, *kernel, *in) into the (N, M, *out) window at ``begin``."""
    n, m = cols.shape[:2]
    nsp = len(g.kernel)
    in_sizes = cols.shape[2 + nsp :]
    full = [
        (i - 1) * s + (k - 1) * d + 1
        for i, s, k, d in zip(in_sizes, g.strides, g.kernel, g.dilations)
    ]
    off = [max(0, -b) for b in begin]
    size = [o + max(f, b + t) for o, f, b, t in zip(off, full, begin, out)]
    buf = np.zeros((n, m, *size), dtype=cols.dtype)
    for tap in itertools.product(*(range(k) for k in g.kernel)):
        dst = tuple(
            slice(o + t * d, o + t * d + (i - 1) * s + 1, s)
            for o, t, d, i, s in zip(off, tap, g.dilations, in_sizes, g.strides)
        )
        buf[(Ellipsis, *dst)] += cols[(slice(None), slice(None), *tap)]
    crop = tuple(slice(o + b, o + b + t) for o, b, t in zip(off, begin, out))
    return buf[(Ellipsis, *crop)]


class NumpyIntConvArrays:
    """:class:`tensorkiln.kernels.common.conv.IntConvArrays` on numpy arrays."""

    float64, float32, int32 = np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.int32)

    def astype(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return x.astype(dtype)

    def conv(self, x: np.ndarray, w: np.ndarray, g: Geometry, group: int) -> np.ndarray:
        return conv_nd(x, w, g, group)

    def round(self, x: np.ndarray) -> np.ndarray:
        return np.rint(x)

    def saturate(self, y: np.ndarray, dtype: np.dtype) -> np.ndarray:
        info = np.iinfo(dtype)
        return np.clip(y, info.min, info.max).astype(dtype)


_INT_CONV = IntegerConv(NumpyIntConvArrays())
register("ConvInteger", since=10)(_INT_CONV.conv_integer)
register("QLinearConv", since=10)(_INT_CONV.qlinear_conv)


class NumpyDeformArrays:
    """:class:`tensorkiln.kernels.common.deform.DeformArrays` on numpy arrays."""

    m = np
    int64 = np.dtype(np.int64)

    def compute_dtype(self, dtype: np.dtype) -> np.dtype:
        return compute_dtype(dtype)

    def astype(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return x.astype(dtype, copy=False)

    def zeros(self, shape: tuple[int, ...], like: np.ndarray) -> np.ndarray:
        return np.zeros(shape, dtype=like.dtype)

    def grid(self, sizes: Sequence[int], like: np.ndarray) -> np.ndarray:
        return np.indices(sizes).reshape(len(sizes), -1)

    def take_last(self, x: np.ndarray, index: np.ndarray) -> np.ndarray:
        return np.take_along_axis(x, index, axis=-1)


register("DeformConv", since=19)(DeformConv(NumpyDeformArrays()).deform_conv)


@register("CausalConvWithState", since=27)
def causal_conv_with_state(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None = None,
    past_state: np.ndarray | None = None,
    *,
    activation: str = "none",
) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise 1-D conv over [past_state, x]; returns (output, last k-1 positions)."""
    check_causal_conv(
        x.shape, w.shape, None if past_state is None else past_state.shape, activation
    )
    bsz, c, length = x.shape
    k = w.shape[2]
    if past_state is None:
        past_state = np.zeros((bsz, c, k - 1), dtype=x.dtype)
    full = np.concatenate([past_state, x], axis=2)
    ct = compute_dtype(x.dtype)
    fc, wc = full.astype(ct, copy=False), w.astype(ct, copy=False)
    y = np.zeros((bsz, c, length), dtype=ct)
    for j in range(k):
        y += wc[:, 0, j, None] * fc[:, :, j : j + length]
    y = _add_bias(y, b, c, "CausalConvWithState")
    if activation != "none":
        y = y / (1 + np.exp(-y))
    return y.astype(x.dtype, copy=False), full[:, :, full.shape[2] - (k - 1) :].copy()
