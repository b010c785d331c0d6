"""tensorkiln.ConvAct: convolution + bias + residual + activation in one kernel.

``Y = act(conv(X, W) + B + Z)`` (``residual_order="add_act"``, the ResNet form, the default) or
``Y = act(conv(X, W) + B) + Z`` (``residual_order="act_add"``). The convolution is the reference
im2col + GEMM; the epilogue (bias, residual, activation) then runs in place on the fresh GEMM output,
one block of output channels at a time, so each block is still in cache while it is finished. The
entry (signature, checks, geometry) is kernels/common/conv.py's, as Conv's is.

The activation helpers here are shared with :mod:`fused_gemm`. They reuse the cores of the
elementwise kernels, so a fused activation rounds exactly as the unfused op does.
"""

from __future__ import annotations

import math

import numpy as np

from tensorkiln.kernels.common import bind
from tensorkiln.kernels.common import conv as common_conv
from tensorkiln.kernels.common.window import Geometry
from tensorkiln.kernels.reference._window import compute_dtype
from tensorkiln.kernels.reference.elementwise import (
    _gelu,
    _hard_sigmoid,
    _hard_swish,
    _leaky,
    _swish,
)
from tensorkiln.kernels.reference.nn import NumpyConvArrays, conv_nd
from tensorkiln.kernels.registry import register
from tensorkiln.ops.fused import ACTIVATION_DEFAULTS

# Elements per epilogue block: 64K float32 = 256 KiB, about one core's L2.
_BLOCK = 1 << 16


def _sigmoid_inplace(v: np.ndarray, alpha: float = 1.0) -> None:
    # same steps as elementwise._sigmoid: 1 / (1 + exp(-alpha v))
    np.multiply(v, -alpha, out=v)
    with np.errstate(over="ignore"):
        np.exp(v, out=v)
    v += 1
    np.reciprocal(v, out=v)


def activate(v: np.ndarray, activation: str, alpha, beta, lo, hi) -> None:
    """Apply ``activation`` to the contiguous float32/float64 array ``v`` in place."""
    if activation == "":
        return
    if activation == "Relu":
        np.maximum(v, v.dtype.type(0), out=v)
    elif activation == "Tanh":
        np.tanh(v, out=v)
    elif activation == "Sigmoid":
        _sigmoid_inplace(v)
    elif activation == "Clip":
        _clip_inplace(v, lo, hi)
    else:
        a, b = ACTIVATION_DEFAULTS.get(activation, (None, None))
        alpha = a if alpha is None else alpha
        beta = b if beta is None else beta
        flat = v.reshape(-1)
        flat[...] = _CORES[activation](flat, alpha, beta)


def _clip_inplace(v: np.ndarray, lo, hi) -> None:
    if lo is not None and hi is not None:
        np.clip(v, v.dtype.type(lo), v.dtype.type(hi), out=v)
    elif lo is not None:
        np.maximum(v, v.dtype.type(lo), out=v)
    elif hi is not None:
        np.minimum(v, v.dtype.type(hi), out=v)


_CORES = {
    "LeakyRelu": lambda v, a, b: _leaky(v, a),
    "Swish": lambda v, a, b: _swish(v, a),
    "HardSigmoid": lambda v, a, b: _hard_sigmoid(v, a, b),
    "HardSwish": lambda v, a, b: _hard_swish(v),
    "Gelu": lambda v, a, b: _gelu(v, "none"),
    "GeluTanh": lambda v, a, b: _gelu(v, "tanh"),
}


def _epilogue(
    y: np.ndarray, b: np.ndarray | None, z: np.ndarray | None, act: tuple, after: bool
) -> None:
    """Finish ``y`` (N, M, P) in place, one block of output channels of one image at a time."""
    n, m, p = y.shape
    step = max(1, _BLOCK // max(p, 1))
    for i in range(n):
        for c0 in range(0, m, step):
            blk = y[i, c0 : c0 + step]
            if b is not None:
                blk += b[c0 : c0 + step, None]
            if z is not None and not after:
                blk += z[i, c0 : c0 + step]
            activate(blk, *act)
            if z is not None and after:
                blk += z[i, c0 : c0 + step]


class NumpyConvActArrays(NumpyConvArrays):
    """Conv's numpy arrays with ConvAct's convolution and blocked epilogue."""

    def conv_act(
        self,
        x: np.ndarray,
        w: np.ndarray,
        b: np.ndarray | None,
        z: np.ndarray | None,
        g: Geometry,
        group: int,
        act: tuple,
        after: bool,
    ) -> np.ndarray:
        ct = compute_dtype(x.dtype)
        y = conv_nd(x.astype(ct, copy=False), w.astype(ct, copy=False), g, group)
        m = w.shape[0]
        if z is not None and z.shape != y.shape:
            raise ValueError(
                f"ConvAct: residual Z of shape {z.shape} must have the output's {y.shape}"
            )
        y = np.ascontiguousarray(y).reshape(y.shape[0], m, math.prod(g.out))
        bb = None if b is None else b.astype(ct, copy=False).reshape(m)
        zz = None if z is None else z.astype(ct, copy=False).reshape(y.shape)
        _epilogue(y, bb, zz, act, after)
        return y.reshape(x.shape[0], m, *g.out).astype(x.dtype, copy=False)


conv_act = bind(common_conv.conv_act, NumpyConvActArrays(), __name__)
register("ConvAct", domain="tensorkiln", since=1)(conv_act)
