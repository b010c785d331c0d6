"""An 8-bit convolution for Hopper written in Gluon, Triton's layout-explicit dialect: 1x1
and 3x3 windows padded by half the window, stride 1 or 2, one group (every convolution of
ResNet-50 but its stem), with tiles of output pixels that are blocks of the image.

A program computes a tile of ``BB x BH x BW`` output pixels (BB images, BH rows, BW columns:
128 pixels) by ``BLOCK_N`` output channels. For each kernel tap (dy, dx) and block of
``BLOCK_K`` input channels, its A operand is ONE TMA load of a box of the NHWC input,
``[BB, BH, BW, BLOCK_K]`` at ``[n0, h0 + dy, w0 + dx, c0]``: TMA fills the parts of the box
outside the tensor (row or column -1, H or W; an image past the last) with zeros, which is
exactly the convolution's zero padding, so nothing is masked or copied. Stride 2 reads the
``(N, H/2, 2, W/2, 2C)`` view of the same bytes, where input row ``2 * oh + dy`` is row
``oh + floor(dy / 2)`` of phase ``dy mod 2`` (and the column's phase picks which C channels of
the last dimension): one five-dimensional box a tap, again with TMA's zeros as the padding. In
shared memory the box is ``BB * BH * BW`` rows of ``BLOCK_K`` bytes, the layout of a
``[128, BLOCK_K]`` tile, handed to WGMMA as one (a shared-memory reshape, no data moved): both
operands go from shared memory to the tensor cores. (``conv_tma.py``'s Triton kernel has to
zero the padding's rows in registers, so A goes through registers; Triton's own language cannot
reshape a loaded four-dimensional block without doing the same.) B is the OHWI weight seen as
``(out channels, taps x channels)``, one TMA load a step. Loads run ``STAGES - 1`` steps ahead
of the WGMMAs, one WGMMA in flight.

The epilogue scales the sums per output channel (X_scale * W_scale), adds the bias and a
residual (a float tensor, or an 8-bit one times its scale, whose tile TMA brings in while the
sums are formed), applies the activation (the fused layers' own, ``gemm.finish``) and quantizes
to Y_scale (int8 or E4M3, the project's rounding) or writes a float type, then stores the tile
through shared memory with one four-dimensional TMA store, which drops the pixels outside the
output. E4M3 sums: Hopper's FP8 WGMMA keeps fewer bits than float32, so with ``promote`` each
step's sums (``BLOCK_K`` channels of one tap) go into a float32 accumulator of their own
(CUTLASS's promotion), at the cost of the WGMMAs of consecutive steps overlapping; a 1x1
convolution of 1,024 channels would otherwise sum them all in the narrower accumulator.

This kernel only compiles for sm_90 (no interpreter): the tests compile it on any machine and
check its PTX; its results are checked on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tensorkiln.kernels.common.window import Geometry
from tensorkiln.kernels.triton.conv_tma import aligned
from tensorkiln.kernels.triton.gemm import (
    NO_ACTIVATION,
    Epilogue,
    channel_scale,
    finish,
    scale_operands,
)
from tensorkiln.kernels.triton.quantize import qout, requantize

# the tensor types the kernel reads and writes, as Gluon names them
TYPES = {
    torch.int8: gl.int8,
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.float16: gl.float16,
    torch.bfloat16: gl.bfloat16,
    torch.float32: gl.float32,
}


@dataclass(frozen=True)
class GluonTile:
    """A tiling: 128 output pixels (a block of BB images x BH rows x BW columns, chosen per
    shape by :func:`blocks` with columns at least ``min_bw`` wide) by ``block_n`` output
    channels, ``block_k`` input channels a step, ``stages`` buffers, ``warps`` (4: one
    warpgroup; 8: two, each taking 64 of the pixels), ``promote`` (E4M3 only: each step's sums
    added into float32)."""

    block_n: int
    block_k: int
    stages: int
    warps: int
    promote: bool = True
    min_bw: int = 4

    @property
    def name(self) -> str:
        p = "p" if self.promote else ""
        return f"128x{self.block_n}x{self.block_k}_w{self.warps}_s{self.stages}_c{self.min_bw}{p}"


def blocks(nb: int, h: int, w: int, min_bw: int = 4, bm: int = 128) -> tuple[int, int, int]:
    """(BB, BH, BW), powers of two whose product is ``bm``, for ``nb`` images of ``h x w``:
    the block that wastes the fewest tensor-core rows on pixels outside the images (tiles
    run past the last row, column or image), columns at least ``min_bw`` (or the whole row)
    wide; ties to the wider block (longer runs of contiguous bytes for TMA)."""
    best = None
    bw = 1
    while bw <= bm:
        bh = 1
        while bw * bh <= bm:
            bb = bm // (bw * bh)
            if bw >= min(min_bw, 1 << max(0, (w - 1).bit_length())):
                covered = (-(-nb // bb) * bb) * (-(-h // bh) * bh) * (-(-w // bw) * bw)
                key = (covered, -bw, -bh)
                if best is None or key < best[0]:
                    best = (key, (bb, bh, bw))
            bh *= 2
        bw *= 2
    return best[1]


@gluon.jit
def _issue_load(x_desc, w_desc, bars, a_bufs, b_bufs, step, c_steps, C, n0, h0, w0, oc0,
                KW: gl.constexpr, PAD: gl.constexpr, STRIDE: gl.constexpr, STAGES: gl.constexpr,
                BLOCK_K: gl.constexpr):  # fmt: skip
    """Step ``step``'s A and B tiles into buffer ``step % STAGES``: the tap's block of input
    pixels (output pixels h0.., w0.. of images n0..) and the weights of that tap and channel
    block. Stride 2 reads the (N, H/2, 2, W/2, 2C) view of the input: input row 2 * oh + dy is
    row oh + a of phase b, a = floor(dy / 2), b = dy - 2a (columns likewise, the phase
    selecting which C channels of the last dimension)."""
    slot = step % STAGES
    tap = step // c_steps
    c0 = (step % c_steps) * BLOCK_K
    dy = tap // KW - PAD
    dx = tap % KW - PAD
    bar = bars.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    if STRIDE == 1:
        tma.async_copy_global_to_shared(x_desc, [n0, h0 + dy, w0 + dx, c0], bar,
                                        a_bufs.index(slot))  # fmt: skip
    else:
        ay = (dy + 2) // 2 - 1  # (floor division of a value down to -2, in non-negatives)
        ax = (dx + 2) // 2 - 1
        tma.async_copy_global_to_shared(x_desc, [n0, h0 + ay, dy - 2 * ay, w0 + ax,
                                                 (dx - 2 * ax) * C + c0], bar,
                                        a_bufs.index(slot))  # fmt: skip
    tma.async_copy_global_to_shared(w_desc, [oc0, tap * C + c0], bar, b_bufs.index(slot))


@gluon.jit
def _conv_kernel(
    x_desc, w_desc, y_desc, z_desc, b_ptr, xs_ptr, ws_ptr, q_ptr, zs_ptr, C, OC, s_ws,
    tiles_h, tiles_w, p0, p1, lo, hi,
    KH: gl.constexpr, KW: gl.constexpr, PAD: gl.constexpr, STRIDE: gl.constexpr,
    HAS_B: gl.constexpr, ACT: gl.constexpr, HAS_Z: gl.constexpr, Z_AFTER: gl.constexpr,
    Z_SCALED: gl.constexpr, QUANT: gl.constexpr, QOUT: gl.constexpr, PROMOTE: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    BB: gl.constexpr = y_desc.block_type.shape[0]
    BH: gl.constexpr = y_desc.block_type.shape[1]
    BW: gl.constexpr = y_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[3]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = BB * BH * BW

    pid = gl.program_id(0)
    tiles_n = gl.cdiv(OC, BLOCK_N)
    pid_n = pid % tiles_n  # (the channel tiles of one pixel tile run side by side: A stays in L2)
    pix = pid // tiles_n
    w0 = (pix % tiles_w) * BW
    h0 = ((pix // tiles_w) % tiles_h) * BH
    n0 = (pix // (tiles_w * tiles_h)) * BB
    oc0 = pid_n * BLOCK_N

    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape,  # noqa: RUF005
                                       x_desc.layout)  # fmt: skip
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,  # noqa: RUF005
                                       w_desc.layout)  # fmt: skip
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    if HAS_Z:  # (the residual's tile comes in while the sums are formed)
        z_smem = gl.allocate_shared_memory(z_desc.dtype, z_desc.block_type.shape, z_desc.layout)
        z_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(z_bar, count=1)
        mbarrier.expect(z_bar, z_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(z_desc, [n0, h0, w0, oc0], z_bar, z_smem)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
    )
    if QUANT == 1:
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.int32, layout=mma_layout)
    else:
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)

    c_steps = C // BLOCK_K
    steps = KH * KW * c_steps
    for i in gl.static_range(STAGES - 1):
        if i < steps:
            _issue_load(x_desc, w_desc, bars, a_bufs, b_bufs, i, c_steps, C, n0, h0, w0, oc0,
                        KW, PAD, STRIDE, STAGES, BLOCK_K)  # fmt: skip

    if PROMOTE:
        part = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        for step in range(steps):
            slot = step % STAGES
            mbarrier.wait(bars.index(slot), (step // STAGES) & 1)
            a = a_bufs.index(slot).reshape([BLOCK_M, BLOCK_K])
            part = warpgroup_mma(a, b_bufs.index(slot).permute((1, 0)), part, use_acc=False,
                                 is_async=True)  # fmt: skip
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            nxt = step + STAGES - 1
            if nxt < steps:
                _issue_load(x_desc, w_desc, bars, a_bufs, b_bufs, nxt, c_steps, C, n0, h0, w0,
                            oc0, KW, PAD, STRIDE, STAGES, BLOCK_K)  # fmt: skip
            acc = acc + part  # (each step's sums, promoted to float32)
    else:
        for step in range(steps):
            slot = step % STAGES
            mbarrier.wait(bars.index(slot), (step // STAGES) & 1)
            a = a_bufs.index(slot).reshape([BLOCK_M, BLOCK_K])
            acc = warpgroup_mma(a, b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            nxt = step + STAGES - 1  # (its buffer's WGMMA, the previous step's, is done)
            if nxt < steps:
                _issue_load(x_desc, w_desc, bars, a_bufs, b_bufs, nxt, c_steps, C, n0, h0, w0,
                            oc0, KW, PAD, STRIDE, STAGES, BLOCK_K)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    cols = oc0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    co = cols % OC  # (columns past the edge read a valid channel; the TMA store drops them)
    v = acc.to(gl.float32) * gl.expand_dims(channel_scale(xs_ptr, ws_ptr, s_ws, co), 0)
    bias = 0.0
    if HAS_B:
        bias = gl.expand_dims(gl.load(b_ptr + co).to(gl.float32), 0)
    r = 0.0
    if HAS_Z:
        mbarrier.wait(z_bar, 0)
        mbarrier.invalidate(z_bar)
        r = z_smem.reshape([BLOCK_M, BLOCK_N]).load(mma_layout).to(gl.float32)
        if Z_SCALED:  # (an int8 or E4M3 residual times its scale: its DequantizeLinear)
            r = r * gl.load(zs_ptr)
    v = finish(v, bias, r, HAS_B, HAS_Z, Z_AFTER, ACT, p0, p1, lo, hi)
    if QOUT != 0:  # (the project's quantization: correctly rounded quotient, half to even)
        out = requantize(v, gl.load(q_ptr), QOUT)
        if QOUT == 1:
            out = out.to(gl.int8)
        else:
            out = out.to(gl.uint8).to(gl.float8e4nv, bitcast=True)
    else:
        out = v.to(y_desc.dtype)

    y_smem = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
    y_smem.reshape([BLOCK_M, BLOCK_N]).store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(y_desc, [n0, h0, w0, oc0], y_smem)
    tma.store_wait(pendings=0)


# the tactics' tilings: 64 output channels (ResNet's first stage) and 128, narrow and wide
# column blocks; E4M3 sums promoted every step, and (the last two) not, where the autotuner's
# check of the result allows it
CONFIGS = (
    GluonTile(64, 64, 4, 4),
    GluonTile(64, 64, 4, 4, min_bw=16),
    GluonTile(128, 64, 4, 8),
    GluonTile(128, 128, 3, 8),
    GluonTile(64, 64, 4, 4, promote=False),
    GluonTile(128, 64, 4, 8, promote=False),
)


def applies(x_shape, w_shape, dtype: str, geom: Geometry, group: int, block_k: int = 64) -> bool:
    """Whether the kernel computes this convolution: 2-D, one group, no dilation, a 1x1 or
    3x3 window padded by half of it on every side, stride 1 or 2 (2: an even height and
    width), int8 or E4M3, input channels a multiple of ``block_k`` (a step stays within one
    tap), output channels of 16, offsets within int32."""
    if len(x_shape) != 4 or len(w_shape) != 4 or group != 1:
        return False
    if dtype not in ("int8", "float8_e4m3fn") or tuple(geom.dilations) != (1, 1):
        return False
    k = tuple(geom.kernel)
    if k not in ((1, 1), (3, 3)) or tuple(geom.begin) != tuple(geom.end):
        return False
    if tuple(geom.begin) != (k[0] // 2, k[1] // 2):
        return False
    nb, c, h, w = x_shape
    stride = tuple(geom.strides)
    if stride not in ((1, 1), (2, 2)) or (stride == (2, 2) and (h % 2 or w % 2)):
        return False
    oc = w_shape[0]
    if c % block_k or oc % 16 or w_shape[1] != c:
        return False
    return nb * h * w * max(c, oc) < 2**31 and oc * k[0] * k[1] * c < 2**31


def _layout(block: list[int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(block, TYPES[dtype])


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) ``t`` as the dense NHWC tensor TMA reads (a view when channels-last and
    16-byte aligned, else a copy)."""
    return aligned(t.permute(0, 2, 3, 1))


def descriptors(x_q, w_q, y, tile: GluonTile, block: tuple[int, int, int], stride: int = 1,
                z: torch.Tensor | None = None):  # fmt: skip
    """The TMA descriptors of input (NHWC, box BB x BH x BW x BLOCK_K; stride 2: its
    (N, H/2, 2, W/2, 2C) view, box BB x BH x 1 x BW x BLOCK_K), weight (OC x KH*KW*C, box
    BLOCK_N x BLOCK_K), output and residual (NHWC, box BB x BH x BW x BLOCK_N; without a
    residual, the output's descriptor stands in for it)."""
    bb, bh, bw = block
    x4 = _nhwc(x_q)
    oc, c = w_q.shape[0], w_q.shape[1]
    w2 = aligned(w_q.permute(0, 2, 3, 1).reshape(oc, -1))
    y4 = y.permute(0, 2, 3, 1)
    if stride == 1:
        xt, xb = x4, [bb, bh, bw, tile.block_k]
    else:
        n, h, w, _ = x4.shape
        xt, xb = x4.view(n, h // 2, 2, w // 2, 2 * c), [bb, bh, 1, bw, tile.block_k]
    wb = [tile.block_n, tile.block_k]
    yb = [bb, bh, bw, tile.block_n]
    x_desc = TensorDescriptor.from_tensor(xt, xb, _layout(xb, x_q.dtype))
    w_desc = TensorDescriptor.from_tensor(w2, wb, _layout(wb, w_q.dtype))
    y_desc = TensorDescriptor.from_tensor(y4, yb, _layout(yb, y.dtype))
    z4 = None if z is None else _nhwc(z)
    z_desc = y_desc if z4 is None else TensorDescriptor.from_tensor(z4, yb, _layout(yb, z.dtype))
    return x_desc, w_desc, y_desc, z_desc, (xt, w2, z4)


def conv(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    b: torch.Tensor | None,
    z: torch.Tensor | None = None,
    *,
    scale: tuple[torch.Tensor, torch.Tensor],
    stride: int = 1,
    epilogue: Epilogue = NO_ACTIVATION,
    residual_after: bool = False,
    out_dtype: torch.dtype = torch.float32,
    y_scale: torch.Tensor | None = None,
    z_scale: torch.Tensor | None = None,
    config: GluonTile = CONFIGS[0],
) -> torch.Tensor:
    """``act(conv(x_q, w_q) * X_scale * W_scale + b + z)`` (``residual_after``: the residual
    after the activation) of a 1x1 or 3x3 window padded by half of it, stride 1 or 2, in
    ``out_dtype``, quantized to ``y_scale`` when given; x_q (N, C, H, W) and w_q (OC, C, K, K)
    int8 or E4M3, read channels-last (a tensor in another layout is copied first); the residual
    ``z`` of the output's shape, float, or int8/E4M3 read as ``z * z_scale``. The output is
    channels-last. Hopper only (:func:`applies` says which convolutions)."""
    nb, c, h, w = x_q.shape
    oc, kh, kw = w_q.shape[0], w_q.shape[2], w_q.shape[3]
    if c % config.block_k or kh != kw or kh not in (1, 3) or stride not in (1, 2):
        raise ValueError(f"conv_gluon: not a convolution it takes ({list(w_q.shape)}, "
                         f"stride {stride}, K step {config.block_k})")  # fmt: skip
    if stride == 2 and (h % 2 or w % 2):
        raise ValueError(f"conv_gluon: stride 2 takes an even height and width, not {h} x {w}")
    oh, ow = h // stride, w // stride
    y = torch.empty((nb, oc, oh, ow), dtype=out_dtype, device=x_q.device,
                    memory_format=torch.channels_last)  # fmt: skip
    if z is not None and tuple(z.shape) != tuple(y.shape):
        raise ValueError(
            f"conv_gluon: residual of shape {list(z.shape)}, the output's {list(y.shape)}"
        )
    scaled = z is not None and z.dtype in (torch.int8, torch.float8_e4m3fn)
    if scaled and z_scale is None:
        raise ValueError("conv_gluon: an 8-bit residual needs z_scale")
    if y.numel() == 0:
        return y
    block = blocks(nb, oh, ow, config.min_bw)
    x_desc, w_desc, y_desc, z_desc, keep = descriptors(x_q, w_q, y, config, block, stride, z)
    xs, ws, s_ws = scale_operands(scale, y)
    bias = b.reshape(oc).to(torch.float32).contiguous() if b is not None else xs
    tiles_h, tiles_w = triton.cdiv(oh, block[1]), triton.cdiv(ow, block[2])
    grid = (triton.cdiv(nb, block[0]) * tiles_h * tiles_w * triton.cdiv(oc, config.block_n),)
    quant = 1 if x_q.dtype == torch.int8 else 2
    quantized = qout(out_dtype)
    if quantized and y_scale is None:
        raise ValueError("conv_gluon: an 8-bit output needs y_scale")
    zs = z_scale.reshape(-1).to(torch.float32) if scaled else xs
    _conv_kernel[grid](
        x_desc, w_desc, y_desc, z_desc, bias, xs, ws, y_scale if y_scale is not None else xs, zs,
        c, oc, s_ws, tiles_h, tiles_w,
        epilogue.alpha, epilogue.beta, epilogue.lo, epilogue.hi,
        KH=kh, KW=kw, PAD=kh // 2, STRIDE=stride, HAS_B=b is not None, ACT=epilogue.code,
        HAS_Z=z is not None, Z_AFTER=residual_after, Z_SCALED=scaled, QUANT=quant, QOUT=quantized,
        PROMOTE=config.promote and quant == 2, STAGES=config.stages, num_warps=config.warps,
    )  # fmt: skip
    del keep
    return y
