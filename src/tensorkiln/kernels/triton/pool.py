"""2-D max pooling in one Triton pass, for channels-last (NHWC) tensors.

torch's channels-last max_pool2d reached 615 GB/s on an H200 (ResNet-50's 3x3/2 pool after the
first convolution, fp16, batch 256: 0.84 ms, 8% of the batch). Here each program takes a block of
output positions by a block of channels, so every load of a tap is a run of contiguous channels,
and keeps the running maximum in registers: the input is read once from memory (the overlap of
neighbouring windows comes from the cache) and the output written once, in the input's layout.

The kernel reads through the input's strides, so any layout gives the right answer; only a
channels-last input gets coalesced loads. Windows follow :class:`tensorkiln.kernels.common.window.Geometry`
(pads before each axis, strides, dilations, the output size), so ``ceil_mode`` and ``auto_pad``
are the geometry's business; taps that fall on padding are skipped. NaN propagates, as in the
reference kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorkiln.kernels.common.window import Geometry

# the types it pools: float ones, and the 8-bit ones of quantized engines (whose max commutes
# with the quantization: a quantized layer writes 8 bits and the pool reads them)
TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn)
BLOCK_P = 32  # output positions per program


@triton.jit
def _max_pool2d_kernel(
    x_ptr, y_ptr, P, C, OH, OW, H, W,
    sxn, sxc, sxh, sxw, syn, syc, syh, syw,
    SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = p < P
    c_ok = c < C
    ow = p % OW
    t = p // OW
    oh = t % OH
    n = t // OH
    acc = tl.full((BLOCK_P, BLOCK_C), float("-inf"), tl.float32)
    for kh in tl.static_range(KH):
        ih = oh * SH - PH + kh * DH
        h_ok = (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = ow * SW - PW + kw * DW
            ok = p_ok & h_ok & (iw >= 0) & (iw < W)
            rows = n * sxn + ih * sxh + iw * sxw
            ptrs = x_ptr + rows[:, None] + (c * sxc)[None, :]
            inside = ok[:, None] & c_ok[None, :]
            v = tl.load(ptrs, mask=inside).to(tl.float32)  # (exact for every type it takes)
            v = tl.where(inside, v, float("-inf"))
            acc = tl.maximum(acc, v, propagate_nan=tl.PropagateNan.ALL)
    out = y_ptr + (n * syn + oh * syh + ow * syw)[:, None] + (c * syc)[None, :]
    kept = p_ok[:, None] & c_ok[None, :]
    acc = tl.where(kept, acc, 0.0)  # (no -inf left to convert to an integer type)
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=kept)


def applies(x: torch.Tensor, g: Geometry) -> bool:
    """Whether :func:`max_pool2d` takes ``x`` (N, C, H, W) of one of :data:`TYPES`, windows
    ``g``."""
    return x.ndim == 4 and x.dtype in TYPES and len(g.kernel) == 2 and x.numel() > 0


def max_pool2d(
    x: torch.Tensor, g: Geometry, *, block_p: int = BLOCK_P, warps: int = 4
) -> torch.Tensor:
    """The maximum over each window of ``g``; the output in ``x``'s layout (channels-last stays
    channels-last). A window that covers only padding gives -inf. ``block_p`` output positions
    (a power of two) a program of ``warps`` warps. The caller checks :func:`applies`."""
    n, c, h, w = x.shape
    oh, ow = g.out
    fmt = (
        torch.channels_last
        if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        else torch.contiguous_format
    )
    y = torch.empty((n, c, oh, ow), dtype=x.dtype, device=x.device, memory_format=fmt)
    if y.numel() == 0:
        return y
    block_c = min(triton.next_power_of_2(c), 64)
    positions = n * oh * ow
    grid = (triton.cdiv(positions, block_p), triton.cdiv(c, block_c))
    _max_pool2d_kernel[grid](
        x, y, positions, c, oh, ow, h, w, *x.stride(), *y.stride(),
        SH=g.strides[0], SW=g.strides[1], PH=g.begin[0], PW=g.begin[1],
        DH=g.dilations[0], DW=g.dilations[1], KH=g.kernel[0], KW=g.kernel[1],
        BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    return y
