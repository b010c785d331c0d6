"""Triton implicit-GEMM convolution with the ConvAct epilogue: ``Y = act(conv(X, W) + B + Z)``.

The convolution is a GEMM whose rows are the output pixels (n, oh, ow), whose columns are the output
channels and whose reduction runs over (kh, kw, input channel): each step gathers one kernel tap's
block of input channels straight from the NCHW input (padding is a masked load, nothing is
unfolded in memory) and multiplies it with the matching OIHW weight block. Groups run along grid
axis 1. The epilogue adds the bias and the residual and applies the activation on the float32
accumulator (``residual_order="act_add"`` adds the residual after), as the reference does.

1-D convolutions run as 2-D ones of height 1. A 1x1 convolution (unit strides, no padding, one
group) of a channels-last input runs as the plain GEMM of its (pixels, channels) view, with the
same epilogue (:func:`_pointwise_gemm`). Each :class:`~tensorkiln.kernels.triton.gemm.TileConfig`
of :data:`CONFIGS` is a separate tactic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorkiln.kernels.common.window import Geometry
from tensorkiln.kernels.triton import interpreting
from tensorkiln.kernels.triton.gemm import (
    NO_ACTIVATION,
    Epilogue,
    TileConfig,
    channel_scale,
    dot_precision,
    dot_step,
    finish,
    launch,
    load_residual,
    scale_operands,
    swizzle,
)
from tensorkiln.kernels.triton.quantize import qout, requantize, storable


@triton.jit
def _tap_tiles(
    step, c_steps, x_rows, w_cols, ih0, iw0, m_ok, rk, C, H, W, KW,
    sx_c, sx_h, sx_w, sw_c, sw_h, sw_w, dil_h, dil_w, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Step ``step`` of the (tap, channel block) loop: A (BLOCK_M, BLOCK_K), B (BLOCK_K, BLOCK_N)."""
    tap = step // c_steps
    cc = (step % c_steps) * BLOCK_K + rk
    kh = tap // KW
    kw = tap % KW
    ih = ih0 + kh * dil_h
    iw = iw0 + kw * dil_w
    row_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    c_ok = cc < C
    x_ptrs = x_rows[:, None] + (ih * sx_h + iw * sx_w)[:, None] + cc[None, :] * sx_c
    a = tl.load(x_ptrs, mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    w_ptrs = w_cols[None, :] + cc[:, None] * sw_c + (kh * sw_h + kw * sw_w)
    b = tl.load(w_ptrs, mask=c_ok[:, None], other=0.0)
    return a, b


@triton.jit
def _flat_tiles(
    k0, x_rows, w_cols, ih0, iw0, m_ok, rk, C, H, W, KH, KW,
    sx_c, sx_h, sx_w, sw_c, sw_h, sw_w, dil_h, dil_w,
):  # fmt: skip
    """The reduction index k0 + rk split into (channel, kh, kw), as im2col orders it: for inputs
    of few channels (an RGB stem), where channel blocks would be mostly padding."""
    kk = k0 + rk
    c = kk // (KH * KW)
    kh = (kk // KW) % KH
    kw = kk % KW
    k_ok = kk < C * KH * KW
    ih = ih0[:, None] + (kh * dil_h)[None, :]
    iw = iw0[:, None] + (kw * dil_w)[None, :]
    ok = m_ok[:, None] & k_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    a = tl.load(x_rows[:, None] + c[None, :] * sx_c + ih * sx_h + iw * sx_w, mask=ok, other=0.0)
    w_ptrs = w_cols[None, :] + (c * sw_c + kh * sw_h + kw * sw_w)[:, None]
    b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
    return a, b


# Triton compiles a variant for every pattern of integer arguments equal to 1 or divisible by 16;
# over a network's layers the geometry takes many such patterns, and compiling them dominated the
# autotuner's time. Only the strides that are the innermost ones in some layout stay specialized:
# the width's (1 in NCHW) and the channels' of the input and the weight (1 channels-last, the
# layout of the cuda backend's convolutions), so that the compiler sees contiguous channel reads
# and vectorizes them (8-bit operands read byte by byte otherwise).
_GENERIC = [
    "NB", "C", "H", "W", "OC", "OH", "OW", "KH", "KW",
    "sx_n", "sx_h", "sw_o", "sw_h", "sz_n", "sz_c", "sz_h", "sy_n", "sy_c", "sy_h",
    "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w",
]  # fmt: skip


@triton.jit(do_not_specialize=_GENERIC)
def _conv_kernel(
    x_ptr, w_ptr, b_ptr, z_ptr, y_ptr, xs_ptr, ws_ptr, q_ptr, zs_ptr,
    NB, C, H, W, OC, OH, OW, KH, KW, s_ws,
    sx_n, sx_c, sx_h, sx_w, sw_o, sw_c, sw_h, sw_w,
    sz_n, sz_c, sz_h, sz_w, sy_n, sy_c, sy_h, sy_w,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    p0, p1, lo, hi,
    HAS_B: tl.constexpr, HAS_Z: tl.constexpr, Z_AFTER: tl.constexpr, ACT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, FLAT_K: tl.constexpr, QUANT: tl.constexpr,
    QOUT: tl.constexpr, Z_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # C and OC are the input and output channels of one group
    M = NB * OH * OW
    pid_m, pid_n = swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(OC, BLOCK_N), GROUP_M)
    g = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ow = rm % OW
    oh = (rm // OW) % OH
    n = rm // (OW * OH)
    m_ok = rm < M
    ih0 = oh * stride_h - pad_h
    iw0 = ow * stride_w - pad_w
    x_rows = x_ptr + n * sx_n + g * C * sx_c
    co = g * OC + rn % OC  # columns past the edge read a valid channel again (wrapped)
    w_cols = w_ptr + co * sw_o
    if QUANT == 1:  # int8 operands: exact int32 sums
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_steps = tl.cdiv(C, BLOCK_K)
    steps = tl.cdiv(C * KH * KW, BLOCK_K) if FLAT_K else KH * KW * c_steps
    for step in range(0, steps):
        if FLAT_K:
            a, b = _flat_tiles(
                step * BLOCK_K, x_rows, w_cols, ih0, iw0, m_ok, rk, C, H, W, KH, KW,
                sx_c, sx_h, sx_w, sw_c, sw_h, sw_w, dil_h, dil_w,
            )  # fmt: skip
        else:
            a, b = _tap_tiles(
                step, c_steps, x_rows, w_cols, ih0, iw0, m_ok, rk, C, H, W, KW,
                sx_c, sx_h, sx_w, sw_c, sw_h, sw_w, dil_h, dil_w, BLOCK_K,
            )  # fmt: skip
        acc = dot_step(a, b, acc, QUANT, UPCAST, PRECISION, BLOCK_K)
    mask = m_ok[:, None] & (rn < OC)[None, :]
    if QUANT != 0:  # quantized operands: the sums times X_scale * W_scale per output channel
        acc = acc.to(tl.float32) * channel_scale(xs_ptr, ws_ptr, s_ws, co)[None, :]
    bias = 0.0
    if HAS_B:
        bias = tl.load(b_ptr + co).to(tl.float32)[None, :]
    z = 0.0
    if HAS_Z:
        z_ptrs = z_ptr + (n * sz_n + oh * sz_h + ow * sz_w)[:, None] + co[None, :] * sz_c
        z = load_residual(z_ptrs, mask, zs_ptr, Z_SCALED)
    acc = finish(acc, bias, z, HAS_B, HAS_Z, Z_AFTER, ACT, p0, p1, lo, hi)
    if QOUT != 0:  # the next layer's input quantization, fused (int8, or E4M3 bytes)
        acc = requantize(acc, tl.load(q_ptr), QOUT)
    y_ptrs = y_ptr + (n * sy_n + oh * sy_h + ow * sy_w)[:, None] + co[None, :] * sy_c
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# Implicit-GEMM tilings for Hopper: wide pixel tiles for early layers (many pixels, few channels),
# wide channel tiles for late ones.
CONFIGS = (
    TileConfig(128, 128, 64, 8, 3),
    TileConfig(128, 128, 32, 4, 3),
    TileConfig(128, 64, 32, 4, 4),
    TileConfig(64, 128, 32, 4, 4),
    TileConfig(64, 64, 32, 4, 4),
)


FLAT_BELOW = 16  # input channels per group under which the reduction runs in im2col order


def _pointwise_gemm(
    x, w, bias, z, y, epilogue, residual_after, config, scale=None, y_scale=None, z_scale=None
) -> torch.Tensor:
    """A 1x1 convolution of channels-last ``x`` as the GEMM it is: the (pixels, C) view of ``x``
    times the (C, OC) view of ``w``, bias, residual and activation in the GEMM's epilogue, written
    into channels-last ``y`` through its (pixels, OC) view. The implicit-GEMM kernel's generic
    addressing reads such an input a channel at a time; the GEMM reads whole rows. ``scale`` and
    ``y_scale``: 8-bit operands and output, as :func:`conv_act` takes them."""
    nb, c, h, wd = x.shape
    oc = w.shape[0]
    rows = nb * h * wd
    a = x.permute(0, 2, 3, 1).reshape(1, rows, c)  # (views: x and y are channels-last)
    bt = w.reshape(oc, c).t().unsqueeze(0)
    y2 = y.permute(0, 2, 3, 1).reshape(1, rows, oc)
    c2 = None if bias is None else bias.reshape(1, oc).expand(rows, oc)
    r2 = None if z is None else z.permute(0, 2, 3, 1).reshape(rows, oc)
    launch(
        a, bt, y2, c2, r2, alpha=1.0, beta=1.0, epilogue=epilogue,
        residual_after=residual_after, config=config, scale=scale, y_scale=y_scale,
        r_scale=z_scale,
    )  # fmt: skip
    return y


def _as_2d(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.dim() == 4 else t.unsqueeze(2)


def conv_act(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    *,
    geom: Geometry,
    group: int = 1,
    epilogue: Epilogue = NO_ACTIVATION,
    residual_after: bool = False,
    config: TileConfig = CONFIGS[1],
    scale: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype = torch.float32,
    y_scale: torch.Tensor | None = None,
    z_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(conv(x, w) + b + z) for 1-D and 2-D NCHW convolutions with OIHW weights; with
    ``scale`` (X_scale, W_scale: float32, one value and one per output channel or one), x and w
    are int8 or float8 E4M3 and the sums are multiplied by their product before the epilogue
    (tensorkiln.QConvAct), the output in ``out_dtype``
    (with ``y_scale``: int8 or E4M3, the result quantized to it; with ``z_scale``: z is int8 or
    E4M3, read as z * z_scale).
    Any strides: the weights of the cuda backend's convolutions are channels-last (OHWI), the
    layout whose channel reads are contiguous."""
    if x.dim() not in (3, 4) or w.dim() != x.dim():
        raise ValueError(f"ConvAct: 1-D or 2-D convolutions only: X {tuple(x.shape)}")
    if x.dim() == 3:  # height 1
        g1 = Geometry(
            (1, *geom.kernel), (1, *geom.strides), (1, *geom.dilations),
            (0, *geom.begin), (0, *geom.end), (1, *geom.out),
        )  # fmt: skip
        y = conv_act(
            _as_2d(x), _as_2d(w), b, _as_2d(z), geom=g1, group=group, epilogue=epilogue,
            residual_after=residual_after, config=config, scale=scale, out_dtype=out_dtype,
            y_scale=y_scale, z_scale=z_scale,
        )  # fmt: skip
        return y.squeeze(2)
    nb, c, h, wd = x.shape
    oc = w.shape[0]
    oh, ow = geom.out
    # The output is channels-last when the input or the weight is, as torch's convolutions decide
    # (the cuda backend uploads weights channels-last): a layer's output layout must not depend
    # on which tactic ran it, or the autotuner times the next layer in one layout and the engine
    # runs it in another.
    nhwc = x.stride(1) == 1 and not x.is_contiguous()
    w_nhwc = w.stride(1) == 1 and not w.is_contiguous()
    layout = torch.channels_last if nhwc or w_nhwc else torch.contiguous_format
    y_dtype = x.dtype if scale is None else out_dtype
    y = torch.empty((nb, oc, oh, ow), dtype=y_dtype, device=x.device, memory_format=layout)
    if y.numel() == 0:
        return y
    if z is not None and tuple(z.shape) != tuple(y.shape):
        raise ValueError(f"ConvAct: residual Z {tuple(z.shape)} must have the output's shape")
    bias = None if b is None else b.reshape(oc).contiguous()
    if nhwc and group == 1 and geom.pointwise:
        return _pointwise_gemm(
            x, w, bias, z, y, epilogue, residual_after, config, scale, y_scale, z_scale
        )  # fmt: skip
    quant = 0 if scale is None else (1 if x.dtype == torch.int8 else 2)
    xs, ws, s_ws = scale_operands(scale, y)
    ocg = oc // group
    grid = (triton.cdiv(nb * oh * ow, config.block_m) * triton.cdiv(ocg, config.block_n), group)
    _conv_kernel[grid](
        x, w, bias if bias is not None else y, z if z is not None else y, storable(y),
        xs, ws, y_scale if y_scale is not None else y, z_scale if z_scale is not None else y,
        nb, c // group, h, wd, ocg, oh, ow, w.shape[2], w.shape[3], s_ws,
        *x.stride(), *w.stride(), *(z.stride() if z is not None else (0, 0, 0, 0)), *y.stride(),
        *geom.strides, *geom.begin, *geom.dilations,
        epilogue.alpha, epilogue.beta, epilogue.lo, epilogue.hi,
        HAS_B=bias is not None, HAS_Z=z is not None, Z_AFTER=bool(residual_after),
        ACT=epilogue.code, PRECISION=dot_precision(x.dtype),
        UPCAST=interpreting() and x.dtype in (torch.bfloat16, torch.float8_e4m3fn),
        FLAT_K=c // group < FLAT_BELOW, QUANT=quant,
        QOUT=qout(y.dtype) if y_scale is not None else 0, Z_SCALED=z_scale is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return y
