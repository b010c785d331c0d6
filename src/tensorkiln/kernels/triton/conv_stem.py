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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tensorkiln.kernels.common.window import Geometry
from tensorkiln.kernels.triton import interpreting, quantize
from tensorkiln.kernels.triton.gemm import (
    NO_ACTIVATION,
    Epilogue,
    channel_scale,
    dot_step,
    finish,
    scale_operands,
)
from tensorkiln.kernels.triton.quantize import qout, requantize, storable

CP = 4  # channels of the packed image
TAPS = 8  # window columns a K step reads
MAX_OUT = 256  # output channels one tile covers
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
    if not applies(tuple(x.shape), tuple(w.shape), x.dtype, geom, 1) or w.dtype != x.dtype:
        raise ValueError(
            f"conv_stem: takes an 8-bit 2-D convolution of at most {CP} channels and a window "
            f"at most {TAPS} wide: X {x.dtype} {tuple(x.shape)}, W {w.dtype} {tuple(w.shape)}"
        )
    nb = x.shape[0]
    oc, _, kh, _ = w.shape
    oh, ow = geom.out
    layout = torch.channels_last if channels_last else torch.contiguous_format
    y = torch.empty((nb, oc, oh, ow), dtype=out_dtype, device=x.device, memory_format=layout)
    if y.numel() == 0:
        return y
    bn = block_n(oc)
    height, width = padded_size(tuple(x.shape), tuple(w.shape), geom)
    xp = pack_image(x, geom.begin[0], geom.begin[1], height, width)
    wk = pack_weight(w, bn) if w_packed is None else w_packed
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
