"""An 8-bit 3x3 convolution (stride 1, padding 1, one group) of channels-last tensors, as an
implicit GEMM whose tiles come in through TMA.

The NHWC input is seen as a (pixels, channels) matrix whose rows are also the output's pixels
(stride 1, padding 1: the output has the input's height and width). For kernel tap (kh, kw) a
row tile's A operand is the same matrix shifted by (kh - 1) * W + (kw - 1) rows, one TMA load:
rows before the first pixel or past the last come back as zeros, and the rows whose shifted pixel
falls outside its own image (the padding, or a neighbouring image row or image) are zeroed in
registers before the tensor-core instruction. B is the OHWI weight seen as (out channels,
9 x channels), one TMA load a (tap, channel block) step. The epilogue scales the sums per
output channel (X_scale * W_scale), adds the bias, applies the activation and writes the output
type, quantized to Y_scale where one is given.

On Hopper this compiles to TMA loads feeding WGMMA (A from registers). Against the masked
pointer loads of ``conv.py`` it was 6-8x faster on ResNet-50's 3x3 layers at batch 256, still
1.5-1.65x slower than cuDNN's float16 kernel (benchmarks/RESULTS.md); the autotuner times it
where it applies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tensorkiln.kernels.common.window import Geometry
from tensorkiln.kernels.triton import interpreting
from tensorkiln.kernels.triton.gemm import (
    NO_ACTIVATION,
    Epilogue,
    TileConfig,
    channel_scale,
    finish,
    scale_operands,
    swizzle,
)
from tensorkiln.kernels.triton.quantize import qout, requantize, storable

# one tiling a width of output channels: 64 (ResNet's first stage) and wider
CONFIGS = (TileConfig(128, 64, 64, 4, 3), TileConfig(128, 128, 64, 8, 3))
_LIMIT = 2**31  # int32 element offsets


@triton.jit
def _conv3x3_kernel(
    x_desc, w_desc, b_ptr, y_ptr, xs_ptr, ws_ptr, q_ptr, P, H, W, C, OC, s_ws, p0, p1, lo, hi,
    HAS_B: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr, QOUT: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = swizzle(tl.program_id(0), tl.cdiv(P, BLOCK_M), tl.cdiv(OC, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ow = rm % W
    oh = (rm // W) % H
    if QUANT == 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_steps = tl.cdiv(C, BLOCK_K)
    for step in tl.range(0, 9 * c_steps, num_stages=STAGES):
        tap = step // c_steps
        c0 = (step % c_steps) * BLOCK_K
        dh = tap // 3 - 1
        dw = tap % 3 - 1
        a = x_desc.load([pid_m * BLOCK_M + dh * W + dw, c0])
        inside = (oh + dh >= 0) & (oh + dh < H) & (ow + dw >= 0) & (ow + dw < W)
        a = tl.where(inside[:, None], a, tl.zeros_like(a))
        b = w_desc.load([pid_n * BLOCK_N, tap * C + c0])
        if QUANT == 1:  # int8: exact int32 sums
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        elif UPCAST:  # (the interpreter has no E4M3 dot)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc)
        else:  # E4M3: Hopper's narrower sums folded into float32 after every step
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    co = rn % OC  # (columns past the edge read a valid channel; their stores are masked)
    v = acc.to(tl.float32) * channel_scale(xs_ptr, ws_ptr, s_ws, co)[None, :]
    bias = 0.0
    if HAS_B:
        bias = tl.load(b_ptr + co).to(tl.float32)[None, :]
    v = finish(v, bias, 0.0, HAS_B, False, False, ACT, p0, p1, lo, hi)
    if QOUT != 0:  # the next layer's input quantization, fused
        v = requantize(v, tl.load(q_ptr), QOUT)
    y_ptrs = y_ptr + rm[:, None] * OC + rn[None, :]
    tl.store(y_ptrs, v.to(y_ptr.dtype.element_ty), mask=(rm < P)[:, None] & (rn < OC)[None, :])


def applies(x_shape, w_shape, dtype: str, geom: Geometry, group: int) -> bool:
    """Whether the kernel computes this convolution: 2-D, 3x3, stride 1, padding 1 on every
    side, no dilation, one group, int8 or E4M3, channel counts multiples of 16 (TMA's 16-byte
    rows), offsets within int32."""
    if len(x_shape) != 4 or len(w_shape) != 4 or group != 1:
        return False
    if dtype not in ("int8", "float8_e4m3fn") or tuple(geom.kernel) != (3, 3):
        return False
    if tuple(geom.strides) != (1, 1) or tuple(geom.dilations) != (1, 1):
        return False
    if tuple(geom.begin) != (1, 1) or tuple(geom.end) != (1, 1):
        return False
    nb, c, h, w = x_shape
    oc = w_shape[0]
    if c % 16 or oc % 16 or w_shape[1] != c:
        return False
    return nb * h * w * max(c, oc) < _LIMIT and oc * 9 * c < _LIMIT


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as TMA reads it: dense rows from a 16-byte aligned address (a copy otherwise, as
    for a view into the middle of a buffer)."""
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def conv3x3(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    b: torch.Tensor | None,
    *,
    scale: tuple[torch.Tensor, torch.Tensor],
    epilogue: Epilogue = NO_ACTIVATION,
    out_dtype: torch.dtype = torch.float32,
    y_scale: torch.Tensor | None = None,
    config: TileConfig = CONFIGS[0],
) -> torch.Tensor:
    """``act(conv3x3(x_q, w_q) * X_scale * W_scale + b)`` (stride 1, padding 1) in
    ``out_dtype``, quantized to ``y_scale`` when given; x_q (N, C, H, W) and w_q (OC, C, 3, 3)
    int8 or E4M3 (read channels-last: a tensor in another layout is copied first). The output
    is channels-last."""
    nb, c, h, w = x_q.shape
    oc = w_q.shape[0]
    x2 = x_q.permute(0, 2, 3, 1).reshape(nb * h * w, c)  # (a view when channels-last)
    w2 = w_q.permute(0, 2, 3, 1).reshape(oc, 9 * c)
    x2, w2 = aligned(x2), aligned(w2)
    y = torch.empty((nb, oc, h, w), dtype=out_dtype, device=x_q.device,
                    memory_format=torch.channels_last)  # fmt: skip
    if y.numel() == 0:
        return y
    xs, ws, s_ws = scale_operands(scale, y)
    bias = b.reshape(oc).contiguous() if b is not None else None
    x_desc = TensorDescriptor.from_tensor(x2, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(w2, [config.block_n, config.block_k])
    p = nb * h * w
    grid = (triton.cdiv(p, config.block_m) * triton.cdiv(oc, config.block_n),)
    _conv3x3_kernel[grid](
        x_desc, w_desc, bias if bias is not None else y, storable(y), xs, ws,
        y_scale if y_scale is not None else y, p, h, w, c, oc, s_ws,
        epilogue.alpha, epilogue.beta, epilogue.lo, epilogue.hi,
        HAS_B=bias is not None, ACT=epilogue.code, QUANT=1 if x_q.dtype == torch.int8 else 2,
        QOUT=qout(y.dtype) if y_scale is not None else 0,
        UPCAST=interpreting() and x_q.dtype == torch.float8_e4m3fn,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        STAGES=config.stages, GROUP_M=config.group_m, num_warps=config.warps,
    )  # fmt: skip
    return y
