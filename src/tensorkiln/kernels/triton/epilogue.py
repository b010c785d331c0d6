"""A fused op's epilogue in one pass over its fresh output, in place: ``y = act(y + b + z)``;
and a quantized layer's, from its integer or float32 sums to its output: ``act(acc * s + b + z)``.

cuDNN and cuBLAS compute ConvAct's convolution; what follows it (the per-channel bias, the
residual, the activation) ran as up to three more kernels, each reading and writing the whole
output: in ResNet-50 at batch 256 in fp16 on an H200, torch's broadcast bias add after cuDNN alone
took 2.1 ms of a 12.5 ms batch, the residual adds 2.0 ms and the ReLUs 2.4 ms. This kernel reads
the output (and the residual) once, adds in float32 and rounds once, as the Triton convolution's
own epilogue does (:func:`tensorkiln.kernels.triton.gemm.finish`).

The output is dense in row-major (NCHW) or channels-last (NHWC) order; a channel's index is
``(i // inner) % C`` of the flat index ``i`` (``inner`` is 1 for NHWC, H*W for NCHW). The residual
must have the output's shape, dtype and strides (it comes from the layer before, in the same
layout); :func:`applies` says when the kernel takes a pair.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tensorkiln.kernels.triton.gemm import Epilogue, finish, load_residual
from tensorkiln.kernels.triton.quantize import qout, requantize, storable

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_RESIDUALS = (*FLOATS, torch.int8, torch.float8_e4m3fn)  # (8-bit ones read with a scale)
BLOCK = 2048


@triton.jit
def _epilogue_kernel(
    x_ptr, s_ptr, b_ptr, z_ptr, zs_ptr, q_ptr, y_ptr, n, C, inner, p0, p1, lo, hi,
    HAS_S: tl.constexpr, HAS_B: tl.constexpr, HAS_Z: tl.constexpr, Z_SCALED: tl.constexpr,
    Z_AFTER: tl.constexpr, ACT: tl.constexpr, NHWC: tl.constexpr, QOUT: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.float32)
    if HAS_S or HAS_B:
        channel = offs % C if NHWC else (offs // inner) % C
    if HAS_S:  # (integer or float32 sums of quantized products, times X_scale * W_scale)
        v = v * tl.load(s_ptr + channel, mask=mask, other=0.0)
    bias = 0.0
    if HAS_B:
        bias = tl.load(b_ptr + channel, mask=mask, other=0.0).to(tl.float32)
    z = 0.0
    if HAS_Z:
        z = load_residual(z_ptr + offs, mask, zs_ptr, Z_SCALED)
    v = finish(v, bias, z, HAS_B, HAS_Z, Z_AFTER, ACT, p0, p1, lo, hi)
    if QOUT != 0:  # (the next layer's input quantization, fused)
        v = requantize(v, tl.load(q_ptr), QOUT)
    tl.store(y_ptr + offs, v.to(y_ptr.dtype.element_ty), mask=mask)


def channel_stride(y: torch.Tensor) -> int | None:
    """``inner`` of a dense (N, C, ...) tensor ``y``: 1 channels-last, the spatial size row-major;
    None for any other layout."""
    if y.ndim < 2:
        return None
    if y.is_contiguous():
        return math.prod(y.shape[2:])
    if y.ndim == 4 and y.is_contiguous(memory_format=torch.channels_last):
        return 1
    return None


def applies(y: torch.Tensor, z: torch.Tensor | None) -> bool:
    """Whether :func:`epilogue_` takes output ``y`` and residual ``z``."""
    if y.dtype not in FLOATS or y.numel() == 0 or channel_stride(y) is None:
        return False
    return z is None or (z.shape == y.shape and z.dtype == y.dtype and z.stride() == y.stride())


def epilogue_(
    y: torch.Tensor,
    b: torch.Tensor | None,
    z: torch.Tensor | None,
    epilogue: Epilogue,
    residual_after: bool = False,
) -> torch.Tensor:
    """``y = act(y + b + z)`` in place (``residual_after``: ``act(y + b) + z``); ``b`` holds one
    value per channel (axis 1). The caller checks :func:`applies` first."""
    _launch(y, None, b, z, y, epilogue, residual_after)
    return y


def _launch(
    x, scale, b, z, y, epilogue: Epilogue, residual_after: bool, y_scale=None, z_scale=None
) -> None:
    inner = channel_stride(x)
    channels = x.shape[1]
    for what, v in (("bias", b), ("scale", scale)):
        if v is not None and v.numel() != channels:
            raise ValueError(f"epilogue: {what} of {v.numel()} values for {channels} channels")
    bias = None if b is None else b.reshape(channels).contiguous()
    n = x.numel()
    code = qout(y.dtype) if y_scale is not None else 0
    _epilogue_kernel[(triton.cdiv(n, BLOCK),)](
        x, scale if scale is not None else x, bias if bias is not None else x,
        z if z is not None else x, z_scale if z_scale is not None else x,
        y_scale if y_scale is not None else x, storable(y),
        n, channels, inner, epilogue.alpha, epilogue.beta, epilogue.lo, epilogue.hi,
        HAS_S=scale is not None, HAS_B=bias is not None, HAS_Z=z is not None,
        Z_SCALED=z_scale is not None, Z_AFTER=bool(residual_after), ACT=epilogue.code,
        NHWC=inner == 1, QOUT=code,
        BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip


def dequantize_applies(acc: torch.Tensor, z: torch.Tensor | None) -> bool:
    """Whether :func:`dequantize` takes sums ``acc`` (int32 or a float type, dense (N, C, ...)
    or (rows, C)) and residual ``z`` (the output's shape and strides, any float type, or int8
    or float8 E4M3 read with a scale)."""
    if acc.dtype not in (torch.int32, *FLOATS) or acc.numel() == 0:
        return False
    if channel_stride(acc) is None or acc.numel() >= 2**31:
        return False
    if z is None:
        return True
    return z.shape == acc.shape and z.dtype in _RESIDUALS and z.stride() == acc.stride()


def dequantize(
    acc: torch.Tensor,
    scale: torch.Tensor,
    b: torch.Tensor | None,
    z: torch.Tensor | None,
    epilogue: Epilogue,
    residual_after: bool,
    out_dtype: torch.dtype,
    y_scale: torch.Tensor | None = None,
    z_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A quantized layer's epilogue in one pass: ``act(acc * scale + b + z)`` (or
    ``act(acc * scale + b) + z``) in float32, written once in ``out_dtype`` and ``acc``'s layout;
    ``scale`` (float32) and ``b`` hold one value per channel (axis 1); with ``y_scale`` (float32,
    one value) the result is quantized to it (``out_dtype`` int8 or float8 E4M3). The caller
    checks :func:`dequantize_applies` first. ``z_scale`` (float32, one value): ``z`` is int8 or
    E4M3, read as ``z * z_scale``; an 8-bit ``z`` needs one."""
    if y_scale is not None and not qout(out_dtype):
        raise ValueError(f"a quantized output is int8 or float8_e4m3fn, not {out_dtype}")
    if z is not None and (z.dtype in FLOATS) != (z_scale is None):
        raise ValueError(f"a residual of {z.dtype} is read with a scale only when 8-bit")
    y = torch.empty_like(acc, dtype=out_dtype)
    scale = scale.to(torch.float32).contiguous()
    _launch(acc, scale, b, z, y, epilogue, residual_after, y_scale, z_scale)
    return y
