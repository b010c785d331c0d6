"""An 8-bit convolution of an image: few input channels (an RGB image's 3) and a wide window
(ResNet's 7 x 7 stem at stride 2), as an implicit GEMM whose K steps are the window's rows.

The implicit-GEMM kernel of ``conv.py`` reduces over (tap, channel block), or for inputs of few
channels gathers the reduction in im2col order one element at a time: ResNet-50's 7 x 7 stem ran
at 3.6-3.9 ms a batch of 256 on an H200 that way, where cuDNN's float16 convolution took 0.75
with its widening and requantizing passes. Here:

1. The image is packed once (:func:`pack_image`): channels-last, padded to ``CP`` = 4 channels
   and spatially by the convolution's padding and a margin, all zeros, in its own 8-bit type (a
   quarter of the bytes of cuDNN's float16 copy).
2. For output pixel (n, oh, ow) and window row kh, the ``TAPS`` (8) consecutive input pixels from
   the window's left edge, 4 channels each, are ``TAPS * CP`` = 32 consecutive values of the
   packed image: one K step of 32, what the 8-bit tensor-core instructions take. A 7-wide window
   reads an eighth tap and a fourth channel whose weights are zero. KH steps in all, and no masks
   but the last rows' (the padding is in the packed image).
3. The weight is packed to match once per constant (``(KH, TAPS * CP, BN)``, zeros past the window,
   the channels and the output channels); the sums are int8's exact int32 or E4M3's float32, and
   the epilogue multiplies them by X_scale * W_scale per output channel, adds the bias, applies
   the activation and writes the output type, quantized to Y_scale where one is given, as
   ``conv.py``'s does. No residual.

It runs where the window is at most ``TAPS`` wide, the input has at most ``CP`` channels and the
convolution has one group and no dilation (:func:`applies`).

:func:`conv_stem_pool` is the same convolution with ResNet's 3 x 3 max pool of stride 2 (padded
by 1) after it, in one kernel: the stem's output (four times the pool's) is never written. A
program takes one image's band of pooled rows; stem rows are computed once each, in order, the
pool's shared row carried from one pooled row to the next (one more stem row a band). Each stem
row is two tiles, its even and its odd columns: pooled column c is the maximum of odd column
c - 1, even column c and odd column c, the first a gather of the odd tile one place along. The
activation must be ReLU, so that every value is at least 0 and the pool's padding (minus
infinity) can be zeros, and the maximum is taken before the output's quantization (which keeps
order, so it is the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tensorkiln.kernels.common.stem import CP, POOL, TAPS
from tensorkiln.kernels.common.window import Geometry, geometry
from tensorkiln.kernels.triton import interpreting, quantize
from tensorkiln.kernels.triton.gemm import (
    ACT_CODES,
    NO_ACTIVATION,
    Epilogue,
    channel_scale,
    dot_step,
    finish,
    scale_operands,
)
from tensorkiln.kernels.triton.quantize import qout, requantize, storable

MAX_OUT = 256  # output channels one tile covers
FLAT_K = 256  # the longest window (KH * TAPS * CP values) a flat configuration takes as one K step
_LIMIT = 2**31  # int32 element offsets
_EIGHT_BIT = (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class StemConfig:
    """Output pixels a tile, warps, pipeline stages."""

    block_m: int
    warps: int
    stages: int

    @property
    def name(self) -> str:
        return f"{self.block_m}_w{self.warps}_s{self.stages}"


CONFIGS = (StemConfig(128, 4, 3), StemConfig(256, 8, 3), StemConfig(64, 4, 4))


def pack_image(x: torch.Tensor, top: int, left: int, height: int, width: int) -> torch.Tensor:
    """``x`` (N, C, H, W, int8 or E4M3, any strides, C <= CP) as an (N, height, width, CP)
    contiguous tensor of its type, the image past ``top`` rows and ``left`` columns, zeros
    elsewhere (:func:`quantize.pad_image`)."""
    return quantize.pad_image(x, CP, top, left, height, width)


def pack_weight(w: torch.Tensor, block_n: int) -> torch.Tensor:
    """The (OC, C, KH, KW) 8-bit weight as the kernel reads it: (KH, TAPS * CP, block_n)
    contiguous, ``w[o, c, kh, kw]`` at ``[kh, kw * CP + c, o]``, zeros elsewhere."""
    oc, c, kh, kw = w.shape
    packed = torch.zeros((kh, TAPS, CP, block_n), dtype=torch.uint8, device=w.device)
    packed[:, :kw, :c, :oc] = w.view(torch.uint8).permute(2, 3, 1, 0)
    return packed.reshape(kh, TAPS * CP, block_n).view(w.dtype)


def block_n(oc: int) -> int:
    """The tile's output channels: ``oc`` rounded up to a power of two, at least 16."""
    return max(16, triton.next_power_of_2(oc))


def applies(x_shape, w_shape, dtype: torch.dtype, geom: Geometry, group: int) -> bool:
    """Whether the kernel takes this convolution: 2-D, one group, no dilation, 8-bit, at most
    CP input channels, a window at most TAPS wide, at most MAX_OUT output channels, and sizes
    within int32 offsets."""
    if len(x_shape) != 4 or len(w_shape) != 4 or group != 1 or dtype not in _EIGHT_BIT:
        return False
    if any(d != 1 for d in geom.dilations) or len(geom.kernel) != 2:
        return False
    nb, c = x_shape[:2]
    oc, _, _, kw = w_shape
    if c > CP or kw > TAPS or oc > MAX_OUT:
        return False
    height, width = padded_size(x_shape, w_shape, geom)
    return nb * height * width * CP < _LIMIT and nb * oc * geom.out[0] * geom.out[1] < _LIMIT


def padded_size(x_shape, w_shape, geom: Geometry) -> tuple[int, int]:
    """The packed image's height and width: the image and its padding, and every row and
    column the last output pixels' windows read (TAPS wide); the width a multiple of 16, which
    Triton then knows it is (an integer argument divisible by 16 is compiled as such), so that
    the kernel's loads are vectorized (8 bytes at stride 2)."""
    _, _, h, w = x_shape
    kh = w_shape[2]
    (oh, ow), (sh, sw), (top, left) = geom.out, geom.strides, geom.begin
    height = max(top + h, (oh - 1) * sh + kh)
    width = max(left + w, (ow - 1) * sw + TAPS)
    return height, -(-width // 16) * 16


@triton.jit
def _stem_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, xs_ptr, ws_ptr, q_ptr,
    M, OC, OH, OW, HP, WP, KH, s_ws, sy_n, sy_c, sy_h, sy_w, p0, p1, lo, hi,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, CPK: tl.constexpr,
    HAS_B: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr, QOUT: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    ow = rm % OW
    oh = (rm // OW) % OH
    n = rm // (OW * OH)
    # the window's top-left corner in the packed image (its padding included): the K step of
    # row kh reads BLOCK_K consecutive values from there, kh rows down
    corner = x_ptr + ((n * HP + oh * STRIDE_H) * WP + ow * STRIDE_W) * CPK
    if QUANT == 1:  # int8 operands: exact int32 sums
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kh in range(0, KH):
        a = tl.load(corner[:, None] + kh * WP * CPK + rk[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(w_ptr + (kh * BLOCK_K + rk)[:, None] * BLOCK_N + rn[None, :])
        acc = dot_step(a, b, acc, QUANT, UPCAST, "ieee", BLOCK_K)
    co = tl.minimum(rn, OC - 1)  # (columns past the output channels: computed, not stored)
    acc = acc.to(tl.float32) * channel_scale(xs_ptr, ws_ptr, s_ws, co)[None, :]
    bias = 0.0
    if HAS_B:
        bias = tl.load(b_ptr + co).to(tl.float32)[None, :]
    acc = finish(acc, bias, 0.0, HAS_B, False, False, ACT, p0, p1, lo, hi)
    if QOUT != 0:  # the next layer's input quantization, fused (int8, or E4M3 bytes)
        acc = requantize(acc, tl.load(q_ptr), QOUT)
    y_ptrs = y_ptr + (n * sy_n + oh * sy_h + ow * sy_w)[:, None] + rn[None, :] * sy_c
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (rn < OC)[None, :])


def _check(name: str, x: torch.Tensor, w: torch.Tensor, geom: Geometry) -> None:
    """ValueError naming ``name`` unless :func:`applies` takes ``x`` and ``w``, of one type."""
    if not applies(tuple(x.shape), tuple(w.shape), x.dtype, geom, 1) or w.dtype != x.dtype:
        raise ValueError(
            f"{name}: takes an 8-bit 2-D convolution of at most {CP} channels and a window at "
            f"most {TAPS} wide: X {x.dtype} {tuple(x.shape)}, W {w.dtype} {tuple(w.shape)}"
        )


def _output(x: torch.Tensor, shape: tuple, dtype: torch.dtype, channels_last: bool):
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(shape, dtype=dtype, device=x.device, memory_format=layout)


def _packed(x: torch.Tensor, w: torch.Tensor, geom: Geometry, w_packed: torch.Tensor | None):
    """(the packed image, its height and width, the packed weight, the tile's output channels)."""
    bn = block_n(w.shape[0])
    height, width = padded_size(tuple(x.shape), tuple(w.shape), geom)
    xp = pack_image(x, geom.begin[0], geom.begin[1], height, width)
    wk = pack_weight(w, bn) if w_packed is None else w_packed
    return xp, height, width, wk, bn


def conv_stem(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    *,
    geom: Geometry,
    scale: tuple[torch.Tensor, torch.Tensor],
    epilogue: Epilogue = NO_ACTIVATION,
    out_dtype: torch.dtype = torch.float32,
    y_scale: torch.Tensor | None = None,
    channels_last: bool = True,
    w_packed: torch.Tensor | None = None,
    config: StemConfig = CONFIGS[0],
) -> torch.Tensor:
    """act(conv(x, w) * X_scale * W_scale + b) of an 8-bit image ``x`` (N, C, H, W, any strides)
    and weight ``w`` (OC, C, KH, KW) of the same type, for a case :func:`applies` takes; the
    output in ``out_dtype`` (with ``y_scale``: int8 or E4M3, quantized to it), channels-last or
    contiguous. ``w_packed``: :func:`pack_weight`'s result, where the caller keeps it."""
    _check("conv_stem", x, w, geom)
    nb = x.shape[0]
    oc, _, kh, _ = w.shape
    oh, ow = geom.out
    y = _output(x, (nb, oc, oh, ow), out_dtype, channels_last)
    if y.numel() == 0:
        return y
    xp, height, width, wk, bn = _packed(x, w, geom, w_packed)
    xs, ws, s_ws = scale_operands(scale, y)
    m = nb * oh * ow
    _stem_kernel[(triton.cdiv(m, config.block_m),)](
        xp, wk, b if b is not None else y, storable(y), xs, ws,
        y_scale if y_scale is not None else y,
        m, oc, oh, ow, height, width, kh, s_ws, *y.stride(),
        epilogue.alpha, epilogue.beta, epilogue.lo, epilogue.hi,
        STRIDE_H=geom.strides[0], STRIDE_W=geom.strides[1], CPK=CP,
        HAS_B=b is not None, ACT=epilogue.code, QUANT=1 if x.dtype == torch.int8 else 2,
        QOUT=qout(y.dtype) if y_scale is not None else 0,
        UPCAST=interpreting() and x.dtype == torch.float8_e4m3fn,
        BLOCK_M=config.block_m, BLOCK_N=bn, BLOCK_K=TAPS * CP,
        num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return y


# ---------------------------------------------------------------- the stem and its max pool


@dataclass(frozen=True)
class StemPoolConfig:
    """Pooled rows a program, pooled columns a tile (the first a halo), warps, stages."""

    rows: int
    block_p: int
    warps: int
    stages: int
    flat: bool = False  # the whole window one K step (one load and one dot a tile), not KH

    @property
    def name(self) -> str:
        flat = "_flat" if self.flat else ""
        return f"r{self.rows}_p{self.block_p}_w{self.warps}_s{self.stages}{flat}"


# (best first: the autotuner times the first 4 of a group at the default optimization level. On
# an H100 at ResNet-50's batch 256, int8 / E4M3: r14 flat w4 0.464 / 0.571 ms, r14 0.733 /
# 0.743, r7 0.753 / 0.771, r4 0.786 / 0.807; flat w8 not yet timed)
POOL_CONFIGS = (
    StemPoolConfig(14, 64, 4, 1, flat=True),
    StemPoolConfig(14, 64, 4, 3),
    StemPoolConfig(14, 64, 8, 1, flat=True),
    StemPoolConfig(7, 64, 4, 3),
    StemPoolConfig(4, 64, 4, 3),
)


def fits(config: StemPoolConfig, w_shape) -> bool:
    """Whether ``config`` takes a weight of ``w_shape``: a flat one a window of at most FLAT_K
    values."""
    return not config.flat or w_shape[2] * TAPS * CP <= FLAT_K


@triton.jit
def _activated(acc, ok, scale, bias, p0, p1, lo, hi, HAS_B: tl.constexpr, ACT: tl.constexpr):
    """A tile's sums scaled, biased and activated, zeros where ``ok`` is False."""
    v = finish(acc.to(tl.float32) * scale, bias, 0.0, HAS_B, False, False, ACT, p0, p1, lo, hi)
    return tl.where(ok[:, None], v, 0.0)


@triton.jit
def _windows(at, ok, WP, KH, CPK: tl.constexpr, BLOCK_K: tl.constexpr, KPAD: tl.constexpr):
    """The windows whose top-left corners are ``at`` (masked by ``ok``) as one (rows, KPAD)
    tile: window row kh's BLOCK_K values at columns kh * BLOCK_K on, zeros past KH of them."""
    rk = tl.arange(0, KPAD)
    step = (rk // BLOCK_K) * (WP * CPK) + rk % BLOCK_K
    ok = ok[:, None] & (rk < KH * BLOCK_K)[None, :]
    return tl.load(at[:, None] + step[None, :], mask=ok, other=0.0)


@triton.jit
def _pooled_row(
    x_ptr, w_ptr, wt, n, oh, c, shift, scale, bias, OH, OW, HP, WP, KH, p0, p1, lo, hi,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, CPK: tl.constexpr, HAS_B: tl.constexpr,
    ACT: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KPAD: tl.constexpr,
):  # fmt: skip
    """Stem row ``oh`` of image ``n`` pooled along the row for pooled columns ``c``: the
    maximum of its columns 2c - 1, 2c and 2c + 1 (``shift``: each tile row's predecessor, for
    the first). The even and the odd columns are two tiles of one loop over the window's rows,
    each K step's weight loaded once for both; ``KPAD`` > 0: the whole window one K step of
    KPAD, against the weight ``wt`` (KPAD, BLOCK_N) the program loaded once. Outputs outside
    the stem's rows and columns are zeros (the pool's padding, as every output is at least 0)."""
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = (oh >= 0) & (oh < OH)
    even_ok = (2 * c >= 0) & (2 * c < OW) & row_ok
    odd_ok = (2 * c + 1 >= 0) & (2 * c + 1 < OW) & row_ok
    # (the odd column's window starts STRIDE_W pixels past the even one's)
    even_at = x_ptr + ((n * HP + oh * STRIDE_H) * WP + 2 * c * STRIDE_W) * CPK
    odd_at = even_at + STRIDE_W * CPK
    if QUANT == 1:
        even = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.int32)
        odd = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.int32)
    else:
        even = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        odd = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if KPAD > 0:
        # (E4M3's narrower accumulator still folded into float32 every BLOCK_K)
        a = _windows(even_at, even_ok, WP, KH, CPK, BLOCK_K, KPAD)
        even = dot_step(a, wt, even, QUANT, UPCAST, "ieee", BLOCK_K)
        a = _windows(odd_at, odd_ok, WP, KH, CPK, BLOCK_K, KPAD)
        odd = dot_step(a, wt, odd, QUANT, UPCAST, "ieee", BLOCK_K)
    else:
        for kh in range(0, KH):
            step = kh * WP * CPK + rk[None, :]
            b = tl.load(w_ptr + (kh * BLOCK_K + rk)[:, None] * BLOCK_N + rn[None, :])
            a = tl.load(even_at[:, None] + step, mask=even_ok[:, None], other=0.0)
            even = dot_step(a, b, even, QUANT, UPCAST, "ieee", BLOCK_K)
            a = tl.load(odd_at[:, None] + step, mask=odd_ok[:, None], other=0.0)
            odd = dot_step(a, b, odd, QUANT, UPCAST, "ieee", BLOCK_K)
    even = _activated(even, even_ok, scale, bias, p0, p1, lo, hi, HAS_B, ACT)
    odd = _activated(odd, odd_ok, scale, bias, p0, p1, lo, hi, HAS_B, ACT)
    before = tl.gather(odd, shift, 0)  # (odd column c - 1; the halo row's is never stored)
    return tl.maximum(tl.maximum(even, odd), before)


@triton.jit
def _stem_pool_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, xs_ptr, ws_ptr, q_ptr,
    OC, OH, OW, PH, PW, HP, WP, KH, s_ws, sy_n, sy_c, sy_h, sy_w, p0, p1, lo, hi,
    STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, CPK: tl.constexpr,
    HAS_B: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr, QOUT: tl.constexpr,
    UPCAST: tl.constexpr, ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, KPAD: tl.constexpr,
):  # fmt: skip
    bands = tl.cdiv(PH, ROWS)
    n = tl.program_id(0) // bands
    r0 = (tl.program_id(0) % bands) * ROWS
    i = tl.arange(0, BLOCK_P)
    # pooled columns: the tile's first is the previous tile's last (a halo, not stored)
    c = tl.program_id(1) * (BLOCK_P - 1) - 1 + i
    shift = tl.maximum(i - 1, 0)[:, None] + tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.int32)
    rn = tl.arange(0, BLOCK_N)
    co = tl.minimum(rn, OC - 1)  # (columns past the output channels: computed, not stored)
    scale = channel_scale(xs_ptr, ws_ptr, s_ws, co)[None, :]
    bias = 0.0
    if HAS_B:
        bias = tl.load(b_ptr + co).to(tl.float32)[None, :]
    wt = 0
    if KPAD > 0:  # the whole packed weight, once: (KH * BLOCK_K rows, zeros to KPAD)
        rk = tl.arange(0, KPAD)
        wt = tl.load(w_ptr + rk[:, None] * BLOCK_N + rn[None, :], mask=(rk < KH * BLOCK_K)[:, None],
                     other=0.0)  # fmt: skip
    # stem row 2 r0 - 1, the first pooled row's top (zeros above the image)
    prev = _pooled_row(x_ptr, w_ptr, wt, n, 2 * r0 - 1, c, shift, scale, bias, OH, OW, HP, WP,
                       KH, p0, p1, lo, hi, STRIDE_H, STRIDE_W, CPK, HAS_B, ACT, QUANT, UPCAST,
                       BLOCK_P, BLOCK_N, BLOCK_K, KPAD)  # fmt: skip
    store_ok = ((i > 0) & (c < PW))[:, None] & (rn < OC)[None, :]
    y_cols = y_ptr + n * sy_n + c[:, None] * sy_w + rn[None, :] * sy_c
    for r in range(r0, tl.minimum(r0 + ROWS, PH)):
        mid = _pooled_row(x_ptr, w_ptr, wt, n, 2 * r, c, shift, scale, bias, OH, OW, HP, WP, KH,
                          p0, p1, lo, hi, STRIDE_H, STRIDE_W, CPK, HAS_B, ACT, QUANT, UPCAST,
                          BLOCK_P, BLOCK_N, BLOCK_K, KPAD)  # fmt: skip
        low = _pooled_row(x_ptr, w_ptr, wt, n, 2 * r + 1, c, shift, scale, bias, OH, OW, HP, WP,
                          KH, p0, p1, lo, hi, STRIDE_H, STRIDE_W, CPK, HAS_B, ACT, QUANT, UPCAST,
                          BLOCK_P, BLOCK_N, BLOCK_K, KPAD)  # fmt: skip
        v = tl.maximum(tl.maximum(prev, mid), low)
        if QOUT != 0:  # (the maximum before the quantization: the same, which keeps order)
            v = requantize(v, tl.load(q_ptr), QOUT)
        tl.store(y_cols + r * sy_h, v.to(y_ptr.dtype.element_ty), mask=store_ok)
        prev = low


def conv_stem_pool(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    *,
    geom: Geometry,
    scale: tuple[torch.Tensor, torch.Tensor],
    epilogue: Epilogue,
    out_dtype: torch.dtype = torch.float32,
    y_scale: torch.Tensor | None = None,
    channels_last: bool = True,
    w_packed: torch.Tensor | None = None,
    config: StemPoolConfig | None = None,
) -> torch.Tensor:
    """MaxPool(act(conv(x, w) * X_scale * W_scale + b)) with :data:`POOL`'s pool, for what
    :func:`applies` takes and a ReLU ``epilogue``: :func:`conv_stem`'s arguments, the output
    (N, OC, PH, PW) the pool's; ``config`` one of :data:`POOL_CONFIGS` (by default the first
    that takes the window)."""
    _check("conv_stem_pool", x, w, geom)
    if config is None:  # (the first that takes the window: a looped one takes any)
        config = next(c for c in POOL_CONFIGS if fits(c, tuple(w.shape)))
    if epilogue.code != ACT_CODES["Relu"]:
        raise ValueError("conv_stem_pool: the convolution's activation must be ReLU")
    if config.block_p < 2 or config.rows < 1 or not fits(config, tuple(w.shape)):
        raise ValueError(f"conv_stem_pool: bad configuration {config} for W {tuple(w.shape)}")
    nb = x.shape[0]
    oc, _, kh, _ = w.shape
    oh, ow = geom.out
    ph, pw = geometry((oh, ow), POOL["kernel_shape"], POOL["strides"], None, POOL["pads"]).out
    y = _output(x, (nb, oc, ph, pw), out_dtype, channels_last)
    if y.numel() == 0:
        return y
    xp, height, width, wk, bn = _packed(x, w, geom, w_packed)
    xs, ws, s_ws = scale_operands(scale, y)
    grid = (nb * triton.cdiv(ph, config.rows), triton.cdiv(pw, config.block_p - 1))
    _stem_pool_kernel[grid](
        xp, wk, b if b is not None else y, storable(y), xs, ws,
        y_scale if y_scale is not None else y,
        oc, oh, ow, ph, pw, height, width, kh, s_ws, *y.stride(),
        epilogue.alpha, epilogue.beta, epilogue.lo, epilogue.hi,
        STRIDE_H=geom.strides[0], STRIDE_W=geom.strides[1], CPK=CP,
        HAS_B=b is not None, ACT=epilogue.code, QUANT=1 if x.dtype == torch.int8 else 2,
        QOUT=qout(y.dtype) if y_scale is not None else 0,
        UPCAST=interpreting() and x.dtype == torch.float8_e4m3fn,
        ROWS=config.rows, BLOCK_P=config.block_p, BLOCK_N=bn, BLOCK_K=TAPS * CP,
        KPAD=triton.next_power_of_2(kh * TAPS * CP) if config.flat else 0,
        num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return y
