"""Tensor-core tactics of the quantized layers (tensorkiln.QGemmAct and QConvAct).

* ``cublas_int8_mm`` (QGemmAct, QConvAct 1x1): ``torch._int_mm``, int8 x int8 -> exact int32 sums on the
  tensor cores, the weight read column-major (fuse_quantized stores GEMM weights as (N, K), the
  layout that runs at full speed); then one float32 pass scales, adds the bias and the residual
  and applies the activation.
* ``cublas_fp8_scaled_mm`` (QGemmAct): ``torch._scaled_mm`` of E4M3 operands with float32 sums, the
  scales applied in the same float32 pass.
* ``cublas_fp8_rowwise`` (QGemmAct with no activation and a 16-bit output): ``torch._scaled_mm``
  with the activation's scale per row, the weight's per column and the bias in cuBLASLt's
  epilogue, writing fp16/bf16 directly: no float32 sums written and read back.
* ``cublas_fp8_rowwise_act`` (QGemmAct with an activation or a quantized output): the same
  row-wise GEMM writing 16 bits, then one Triton pass adds the bias, applies the activation and
  quantizes (kernels/triton/epilogue.py): 16-bit results read back where
  ``cublas_fp8_scaled_mm`` writes and reads float32 sums.
* ``triton_qgemm_<config>`` (QGemmAct): the Triton GEMM of kernels/triton/gemm.py with int8
  operands and int32 sums (or E4M3 and float32 sums) on Hopper's 8-bit tensor-core instructions,
  scale, bias, activation and the next layer's quantization in its epilogue: one kernel, 8 bits
  read and (requantized) written, where the library calls write 32-bit sums a second pass reads.
* ``cudnn_fp16`` (QConvAct): cuDNN's float16 convolution of the 8-bit values (exact in float16)
  with the weight's scale folded into it, X_scale, bias, residual and activation in one pass: the
  floor an 8-bit engine keeps where no 8-bit kernel is faster.
* ``gluon_qconv_<config>`` (QConvAct, Hopper): kernels/triton/conv_gluon.py, 1x1 and 3x3
  convolutions (stride 1 or 2) whose taps are four- or five-dimensional TMA loads (the padding
  is TMA's zero fill), both WGMMA operands from shared memory, the scale, bias, residual,
  activation and quantization fused.
* ``triton_qconv_stem_<config>`` (QConvAct of an image: at most 4 channels, a window at most
  8 wide, as ResNet's 7 x 7 stem): kernels/triton/conv_stem.py, the image packed once
  channels-last into 4 channels with its padding, each window row one K step of 32 8-bit values,
  the scale, bias, activation and quantization fused.
* ``triton_qconv_<config>`` (QConvAct): the Triton implicit-GEMM convolution of
  kernels/triton/conv.py with int8 operands and int32 sums (or E4M3 with float32 sums), the
  per-channel scale and the ConvAct epilogue fused; a 1x1 convolution of a channels-last input
  runs as the Triton GEMM of its pixels, the same epilogue and requantization fused (8 bits read
  and written, where torch._int_mm writes int32 sums a second pass must read back).

Each applies only where the kernel computes the op as the reference does (int8 or E4M3 operands
as the layer has them, the shapes the library call takes); the autotuner times them against the
default kernel (exact float64 sums) and checks them against it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch

from tensorkiln.kernels.common.conv import conv_geometry
from tensorkiln.kernels.common.stem import fuses_pool
from tensorkiln.kernels.cuda.convert import kept as _kept
from tensorkiln.kernels.cuda.convert import torch_dtype
from tensorkiln.kernels.cuda.fused_quant import (
    QConv,
    channels_last_like,
    one_pass,
    one_pass_epilogue,
    qconv,
    qconv_pool_with,
    qgemm,
    qgemm_call,
)
from tensorkiln.kernels.cuda.nn import conv_nd
from tensorkiln.kernels.tactics import LayerSpec, get_tactic, tactic
from tensorkiln.kernels.triton import available, interpreting
from tensorkiln.ops.fused import conv_attrs, pool_attrs

if available():
    from tensorkiln.kernels.cuda import tactics_gemm
    from tensorkiln.kernels.triton import conv, conv_stem, conv_tma, epilogue, gemm, quantize
    from tensorkiln.kernels.triton.gemm import Epilogue

    try:  # (Gluon, Triton's layout-explicit dialect: Triton 3.5 and later)
        from tensorkiln.kernels.triton import conv_gluon
    except ImportError:  # pragma: no cover - an older Triton
        conv_gluon = None
else:  # (no Triton: torch's cast widens)
    quantize = None

_ACT = {"activation", "activation_alpha", "activation_beta", "activation_min", "activation_max"}
_GEMM = {"alpha", "beta", "transA", "transB", "out_dtype"} | _ACT
_CONV = {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides", "residual_order"}
_CONV = _CONV | {"out_dtype"}
_INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA takes more than 16 rows
_LIMIT = 2**31 - 1


def _dtypes(spec: LayerSpec) -> tuple[str | None, str | None]:
    return spec.dtypes[0], spec.dtypes[2] if len(spec.dtypes) > 2 else None


def _gemm_dims(spec: LayerSpec) -> tuple[int, int, int] | None:
    """(M, N, K) of a QGemmAct with a packed (N, K) weight and an untransposed A."""
    a, b = spec.shapes[0], spec.shapes[2]
    if a is None or b is None or len(b) != 2 or len(a) < 2:
        return None
    if spec.attrs.get("transA", 0) or not spec.attrs.get("transB", 0) or a[-1] != b[1]:
        return None
    return math.prod(a[:-1]), b[0], b[1]


def _qgemm_ok(kind: str, spec: LayerSpec) -> bool:
    if spec.device != "cuda" or not set(spec.attrs) <= _GEMM or _dtypes(spec) != (kind, kind):
        return False
    dims = _gemm_dims(spec)
    if dims is None:
        return False
    m, n, k = dims
    multiple = 8 if kind == "int8" else 16
    return n % multiple == 0 and k % multiple == 0 and m * max(n, k) <= _LIMIT


def _matmul(kind: str, a2: torch.Tensor, b_nk: torch.Tensor) -> torch.Tensor:
    """(M, K) @ (N, K)^T: int32 sums for int8, float32 for E4M3."""
    a2 = a2.contiguous()
    if kind == "int8":
        m = a2.shape[0]
        if m < _INT_MM_MIN_ROWS and a2.is_cuda:
            padded = a2.new_zeros((_INT_MM_MIN_ROWS, a2.shape[1]))
            padded[:m] = a2
            return torch._int_mm(padded, b_nk.t())[:m]
        return torch._int_mm(a2, b_nk.t())
    one = torch.ones((), dtype=torch.float32, device=a2.device)
    return torch._scaled_mm(a2, b_nk.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)


def _qgemm(kind: str) -> Callable:
    def product(a2: torch.Tensor, b: torch.Tensor, packed: bool) -> torch.Tensor:
        if not packed or (a2.stride(-1) != 1 and a2.stride(0) != 1):
            raise ValueError("QGemmAct's tensor-core tactics take a packed (N, K) weight")
        return _matmul(kind, a2, b)

    def run(a_q, a_scale, b_q, b_scale, c=None, y_scale=None, **attrs) -> torch.Tensor:
        if attrs.get("transA", 0):
            raise ValueError("QGemmAct's tensor-core tactics take an untransposed A")
        return qgemm(qgemm_call(a_q, a_scale, b_q, b_scale, c, y_scale, attrs), product)

    run.__name__ = f"qgemm_{kind}"
    return run


def _triton_qgemm_ok(cfg: Any, spec: LayerSpec) -> bool:
    """A QGemmAct of 8-bit operands with a packed weight, an activation the epilogue has and a
    bias of one row, on a tile that fits the problem."""
    if not (spec.device == "cuda" or interpreting()) or not set(spec.attrs) <= _GEMM:
        return False
    dx, dw = _dtypes(spec)
    if dx not in ("int8", "float8_e4m3fn") or dw != dx:
        return False
    if spec.attrs.get("activation", "") not in gemm.ACT_CODES:
        return False
    dims = _gemm_dims(spec)
    if dims is None:
        return False
    m, n, k = dims
    c = spec.shapes[4] if len(spec.shapes) > 4 else None
    if c is not None and math.prod(c) not in (1, n):
        return False
    return m * max(n, k) <= _LIMIT and tactics_gemm.tile_fits(cfg, m, n, 1)


def _triton_qgemm(cfg: Any) -> Callable:
    def run(a_q, a_scale, b_q, b_scale, c=None, y_scale=None, **attrs) -> torch.Tensor:
        call = qgemm_call(a_q, a_scale, b_q, b_scale, c, y_scale, attrs)
        if not call.packed:
            raise ValueError("QGemmAct's Triton tactic takes a packed (N, K) weight")
        m, n = call.a2.shape[0], call.b.shape[0]
        y = torch.empty((m, n), dtype=call.out, device=a_q.device)
        bias = None  # (read in its own type; beta applied in the kernel)
        if call.bias is not None:
            bias = call.bias.reshape(1, -1).expand(m, n)
        gemm.launch(
            call.a2.unsqueeze(0), call.b.t().unsqueeze(0), y.unsqueeze(0), bias, None,
            alpha=call.alpha, beta=call.beta, epilogue=Epilogue.of(call.activation, *call.act),
            residual_after=False, config=cfg, scale=(call.x_scale, call.w_scale),
            y_scale=call.y_scale,
        )  # fmt: skip
        return y.reshape(call.shape)

    run.__name__ = f"triton_qgemm_{cfg.name}"
    return run


def _rowwise_ok(spec: LayerSpec) -> bool:
    """An E4M3 QGemmAct the row-wise scaled GEMM finishes alone: no activation, no Y_scale, a
    16-bit output, a bias of one row at beta 1."""
    if not _qgemm_ok("float8_e4m3fn", spec) or spec.attrs.get("activation", ""):
        return False
    if spec.attrs.get("out_dtype", 1) not in (10, 16) or len(spec.shapes) > 5:
        return False
    c = spec.shapes[4] if len(spec.shapes) > 4 else None
    n = spec.shapes[2][0]
    return c is None or (math.prod(c) == n and spec.attrs.get("beta", 1.0) == 1.0)


def _rowwise_product(call: Any, bias: torch.Tensor | None, out: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` of a packed E4M3 call, the activation's scale per row and the
    weight's per column (times alpha) applied in cuBLASLt, ``bias`` added there: (M, N) in
    ``out``."""
    m, n = call.a2.shape[0], call.b.shape[0]
    a_s, b_s, alpha = call.x_scale, call.w_scale, call.alpha

    def rows() -> torch.Tensor:
        return a_s.reshape(1, 1).to(torch.float32).expand(m, 1).contiguous()

    def columns() -> torch.Tensor:
        scale = b_s.reshape(1, -1).to(torch.float32).expand(1, n)
        return (scale * alpha if alpha != 1.0 else scale).contiguous()

    # (kept per constant scale: torch's row-wise scaling takes no broadcast scale)
    scale_a = _kept(a_s, ("rows", m), rows)
    scale_b = _kept(b_s, ("columns", n, alpha), columns)
    return torch._scaled_mm(call.a2.contiguous(), call.b.t(), scale_a=scale_a, scale_b=scale_b,
                            bias=bias, out_dtype=out)  # fmt: skip


def _qgemm_fp8_rowwise(a_q, a_scale, b_q, b_scale, c=None, y_scale=None, **attrs) -> torch.Tensor:
    call = qgemm_call(a_q, a_scale, b_q, b_scale, c, y_scale, attrs)
    if call.y_scale is not None or call.activation or not call.packed or call.beta != 1.0:
        raise ValueError("cublas_fp8_rowwise takes a packed weight, no activation, no Y_scale")
    n = call.b.shape[0]
    bias = None
    if c is not None:
        bias = _kept(c, ("bias", n, call.out), lambda: call.bias.reshape(n).to(call.out))
    return _rowwise_product(call, bias, call.out).reshape(call.shape)


def _rowwise_act_ok(spec: LayerSpec) -> bool:
    """An E4M3 QGemmAct with what the row-wise GEMM alone does not finish (an activation the
    one-pass epilogue has, or a quantized output), a bias of one row if any, and no residual."""
    if not available() or not _qgemm_ok("float8_e4m3fn", spec) or len(spec.shapes) > 6:
        return False
    activation = spec.attrs.get("activation", "")
    quantized = len(spec.shapes) > 5 and spec.shapes[5] is not None
    if (not activation and not quantized) or activation not in gemm.ACT_CODES:
        return False
    c = spec.shapes[4] if len(spec.shapes) > 4 else None
    return c is None or math.prod(c) == spec.shapes[2][0]


def _qgemm_fp8_rowwise_act(
    a_q, a_scale, b_q, b_scale, c=None, y_scale=None, **attrs
) -> torch.Tensor:
    call = qgemm_call(a_q, a_scale, b_q, b_scale, c, y_scale, attrs)
    if not call.packed:
        raise ValueError("cublas_fp8_rowwise_act takes a packed (N, K) weight")
    n = call.b.shape[0]
    wide = call.out if call.out in (torch.float16, torch.bfloat16) else torch.float16
    sums = _rowwise_product(call, None, wide)  # (scaled: the epilogue multiplies by one)
    ones = _kept(call.w_scale, ("ones", n), lambda: torch.ones(n, device=sums.device))
    y = one_pass(sums, ones, call)
    if y is None:
        raise ValueError("cublas_fp8_rowwise_act needs the one-pass epilogue kernel")
    return y.reshape(call.shape)


def _conv_geometry(spec: LayerSpec) -> Any:
    x, w = spec.shapes[0], spec.shapes[2]
    if x is None or w is None or len(x) not in (3, 4) or len(w) != len(x):
        return None
    at = spec.attrs
    group = at.get("group", 1)
    if group < 1 or x[1] != w[1] * group or w[0] % group:
        return None
    try:
        return conv_geometry(
            x, w, at.get("auto_pad", "NOTSET"), at.get("dilations"), at.get("kernel_shape"),
            at.get("pads"), at.get("strides"),
        )  # fmt: skip
    except ValueError:
        return None


def _qconv_geometry(spec: LayerSpec, kinds: tuple[str, ...]) -> Any:
    """The geometry of a QConvAct whose operands are of one of ``kinds`` and whose attributes
    the tactics take, else None."""
    if not set(spec.attrs) <= _CONV | _ACT:
        return None
    dx, dw = _dtypes(spec)
    if dx not in kinds or dw != dx:
        return None
    if spec.attrs.get("residual_order", "add_act") not in ("add_act", "act_add"):
        return None
    return _conv_geometry(spec)


def _pointwise_ok(spec: LayerSpec) -> bool:
    """A 1x1 convolution of one group, unit strides, no padding: a GEMM of the pixels."""
    g = _qconv_geometry(spec, ("int8",)) if spec.device == "cuda" else None
    if g is None:
        return False
    x, w = spec.shapes[0], spec.shapes[2]
    if spec.attrs.get("group", 1) != 1 or len(x) != 4 or not g.pointwise:
        return False
    return w[0] % 8 == 0 and x[1] % 8 == 0 and x[0] * x[2] * x[3] * max(x[1], w[0]) <= _LIMIT


def _pointwise_sums(x_q, w_q, bias, z, call: QConv) -> tuple[torch.Tensor, bool]:
    """A 1x1 convolution as torch._int_mm of the (pixels, C) view (a view when x is
    channels-last) and the (M, C) weight; the output a channels-last NCHW view."""
    nb, c, h, wd = x_q.shape
    m = w_q.shape[0]
    rows = x_q.permute(0, 2, 3, 1).reshape(nb * h * wd, c)
    acc = _matmul("int8", rows, w_q.reshape(m, c)).reshape(nb, h, wd, m).permute(0, 3, 1, 2)
    return _scaled(acc, call.scale(), bias, z, call)


def _scaled(acc, scale, bias, z, call: QConv) -> tuple[torch.Tensor, bool]:
    """Sums ``acc`` (int32 or float, any dense layout) times ``scale`` (per output channel),
    with the epilogue, residual and requantization in one Triton pass where it applies
    (``True`` second); else the scaled float32 sums for qconv's epilogue."""
    if z is not None and z.stride() != acc.stride():
        z = torch.empty_like(acc, dtype=z.dtype).copy_(z)  # (the output's layout)
    if one_pass_epilogue(acc, z, call.activation):  # (a quantized residual read as it is)
        ep = Epilogue.of(call.activation, *call.act)
        y = epilogue.dequantize(
            acc, scale, bias, z, ep, call.after, call.out, call.y_scale, call.z_scale
        )
        return y, True
    return acc.to(torch.float32).mul_(scale.reshape(1, -1, *(1,) * (acc.ndim - 2))), False


def _qconv_with(sums: Callable, name: str) -> Callable:
    """QConvAct's kernel signature over ``sums`` (fused_quant.qconv does the rest)."""

    def run(
        x_q, x_scale, w_q, w_scale, b=None, z=None, y_scale=None, z_scale=None, **attrs
    ) -> torch.Tensor:
        return qconv(x_q, x_scale, w_q, w_scale, b, z, y_scale, attrs, sums, z_scale)

    run.__name__ = name
    return run


# a 1x1 QConvAct (one group, unit strides, no padding) as an int8 GEMM
qconv_pointwise_int8 = _qconv_with(_pointwise_sums, "qconv_pointwise_int8")


def _half_ok(spec: LayerSpec) -> bool:
    g = _qconv_geometry(spec, ("int8", "float8_e4m3fn")) if spec.device == "cuda" else None
    return g is not None and len(spec.shapes[0]) in (3, 4)


def _half_sums(
    x_q, w_q, bias, z, call: QConv, *, w_half: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """The convolution in float16 on cuDNN: int8 and E4M3 values are exact in float16; the
    weight (``w_half``) carries its per-channel scale (rounded to float16) so the sums stay in
    float16's range, and X_scale follows in the epilogue's pass."""
    wide = w_half.dtype
    if w_half.shape[1] > x_q.shape[1]:  # (a 3-channel image: widened into 4 channels)
        xh = quantize.widen_padded(x_q, wide, w_half.shape[1])
    else:
        xh = quantize.widen(x_q, wide) if _widens(x_q, wide) else x_q.to(wide)
    acc = conv_nd(xh, w_half, None, call.geometry, call.group)
    return _scaled(acc, call.x_scale.expand(call.channels), bias, z, call)


def _widens(x_q: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether Triton's one-pass widening (kernels/triton/quantize.py) takes ``x_q``: on the GPU
    (or in Triton's interpreter)."""
    return (
        quantize is not None
        and (x_q.is_cuda or interpreting())
        and quantize.widen_applies(x_q, dtype)
    )


def _half_weight(
    x_q: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, group: int = 1
) -> torch.Tensor:
    """The float16 weight (float32 on the CPU), channels-last for a 2-D convolution. A
    3-channel 2-D convolution of one group (an image's stem) gets a fourth, zero input channel:
    cuDNN runs 3-channel images by first copying them into 4 channels, which
    :func:`quantize.widen_padded` does in the widening pass it already makes."""
    half = torch.float16 if x_q.is_cuda else torch.float32  # (CPU tests: float32's rounding)
    layout = w_q.ndim == 4 and x_q.ndim == 4
    pads = (
        quantize is not None
        and (x_q.is_cuda or interpreting())
        and x_q.dtype in (torch.int8, torch.float8_e4m3fn)
    )
    pad = 1 if layout and group == 1 and w_q.shape[1] == 3 and pads else 0

    def make() -> torch.Tensor:
        m = w_q.shape[0]
        scale = w_scale.to(torch.float32).reshape(-1).expand(m)
        w = (w_q.to(torch.float32) * scale.reshape(m, *(1,) * (w_q.ndim - 1))).to(half)
        if pad:
            w = torch.nn.functional.pad(w, (0, 0, 0, 0, 0, pad))
        return w.contiguous(memory_format=torch.channels_last) if layout else w

    return _kept(w_q, ("half", half, layout, pad), make, w_scale)


def qconv_half(
    x_q, x_scale, w_q, w_scale, b=None, z=None, y_scale=None, z_scale=None, **attrs
) -> torch.Tensor:
    """QConvAct through cuDNN's float16 convolution (the tensor-core route where no 8-bit kernel
    wins)."""

    def sums(xq, wq, bias, zz, call: QConv) -> tuple[torch.Tensor, bool]:
        # (after qconv's checks of the operands: a bad scale is named, not a torch error)
        w_half = _half_weight(xq, wq, w_scale, call.group)
        return _half_sums(xq, wq, bias, zz, call, w_half=w_half)

    return qconv(x_q, x_scale, w_q, w_scale, b, z, y_scale, attrs, sums, z_scale)


def _fused_qconv_geometry(spec: LayerSpec, residual: bool = True) -> Any:
    """The geometry of an 8-bit QConvAct a Triton convolution with the fused epilogue takes
    (on the GPU or in Triton's interpreter, an activation the epilogue has, a residual only
    where ``residual``), else None."""
    if not (spec.device == "cuda" or interpreting()):
        return None
    g = _qconv_geometry(spec, ("int8", "float8_e4m3fn"))
    if g is None or spec.attrs.get("activation", "") not in gemm.ACT_CODES:
        return None
    if not residual and len(spec.shapes) > 5 and spec.shapes[5] is not None:
        return None
    return g


def _triton_qconv_ok(cfg: Any, spec: LayerSpec) -> bool:
    g = _fused_qconv_geometry(spec)
    if g is None:
        return False
    x, w = spec.shapes[0], spec.shapes[2]
    group = spec.attrs.get("group", 1)
    if group > 1 and (w[1] < 16 or w[0] // group < 16):
        return False  # thin groups (depthwise) leave the tensor cores idle
    m = x[0] * math.prod(g.out)
    if cfg.smem_bytes(1) > gemm.SMEM_LIMIT or m * w[0] > _LIMIT:
        return False
    return cfg.block_n <= max(64, 1 << max(w[0] // group - 1, 0).bit_length())


def _triton_qconv(cfg: Any) -> Callable:
    def sums(x_q, w_q, bias, z, call: QConv) -> tuple[torch.Tensor, bool]:
        epilogue = gemm.Epilogue.of(call.activation, *call.act)
        y = conv.conv_act(
            x_q, w_q, bias, z, geom=call.geometry, group=call.group, epilogue=epilogue,
            residual_after=call.after, config=cfg, scale=(call.x_scale, call.w_scale),
            out_dtype=call.out,
            y_scale=call.y_scale, z_scale=call.z_scale,  # (a quantized residual read as it is)
        )  # fmt: skip
        return y, True

    return _qconv_with(sums, f"triton_qconv_{cfg.name}")


def _qconv3x3_ok(cfg: Any, spec: LayerSpec) -> bool:
    """conv_tma's convolutions: 3x3, stride 1, padding 1, one group, no residual, 8-bit
    channel counts in multiples of 16; a tile no wider than the output channels need."""
    g = _fused_qconv_geometry(spec, residual=False)
    if g is None:
        return False
    x, w = spec.shapes[0], spec.shapes[2]
    if not conv_tma.applies(x, w, _dtypes(spec)[0], g, spec.attrs.get("group", 1)):
        return False
    return cfg.block_n <= max(64, w[0])


def _qconv3x3(cfg: Any) -> Callable:
    def sums(x_q, w_q, bias, z, call: QConv) -> tuple[torch.Tensor, bool]:
        if z is not None:
            raise ValueError(f"triton_qconv3x3_{cfg.name}: takes no residual")
        y = conv_tma.conv3x3(
            x_q, w_q, bias, scale=(call.x_scale, call.w_scale),
            epilogue=Epilogue.of(call.activation, *call.act), out_dtype=call.out,
            y_scale=call.y_scale, config=cfg,
        )  # fmt: skip
        return y, True

    return _qconv_with(sums, f"triton_qconv3x3_{cfg.name}")


def _stem_ok(spec: LayerSpec) -> bool:
    """conv_stem's convolutions: an 8-bit image of at most 4 channels, a window at most 8
    wide, one group, no dilation, no residual."""
    g = _fused_qconv_geometry(spec, residual=False)
    if g is None:
        return False
    x, w = spec.shapes[0], spec.shapes[2]
    kind = torch_dtype(_dtypes(spec)[0])
    return conv_stem.applies(x, w, kind, g, spec.attrs.get("group", 1))


def _stem(cfg: Any, pooled: bool = False) -> Callable:
    """The stem kernel's QConvAct tactic of configuration ``cfg``; ``pooled``: conv_stem_pool's
    QConvPool tactic (the pool's attributes are what _stem_pool_ok took)."""
    name = f"triton_qconv_stem_{'pool_' if pooled else ''}{cfg.name}"
    kernel = conv_stem.conv_stem_pool if pooled else conv_stem.conv_stem

    def sums(x_q, w_q, bias, z, call: QConv) -> tuple[torch.Tensor, bool]:
        if z is not None:
            raise ValueError(f"{name}: takes no residual")
        bn = conv_stem.block_n(w_q.shape[0])
        packed = _kept(w_q, ("stem", bn), lambda: conv_stem.pack_weight(w_q, bn))
        y = kernel(
            x_q, w_q, bias, geom=call.geometry, scale=(call.x_scale, call.w_scale),
            epilogue=Epilogue.of(call.activation, *call.act), out_dtype=call.out,
            y_scale=call.y_scale, channels_last=channels_last_like(x_q, w_q), w_packed=packed,
            config=cfg,
        )  # fmt: skip
        return y, True

    conv = _qconv_with(sums, name)
    if not pooled:
        return conv

    def run(*inputs, **attrs) -> torch.Tensor:
        return conv(*inputs, **conv_attrs(attrs))

    run.__name__ = name
    return run


def _conv_part(spec: LayerSpec) -> LayerSpec:
    """A QConvPool layer's convolution as the QConvAct it fuses (its pool's attributes left out)."""
    return dataclasses.replace(spec, op="QConvAct", attrs=conv_attrs(spec.attrs))


def _stem_pool_ok(cfg: Any, spec: LayerSpec) -> bool:
    """conv_stem_pool's layers for configuration ``cfg``: the stem kernel's convolution (its
    window within what ``cfg`` takes), then the pool it fuses."""
    conv = _conv_part(spec)
    return (
        _stem_ok(conv)
        and conv_stem.fits(cfg, spec.shapes[2])
        and fuses_pool(pool_attrs(spec.attrs), conv.attrs.get("activation", ""))
    )


# QConvPool's two-kernel tactics: a QConvAct tactic, then this MaxPool tactic on its output
_CHAIN_POOL = "triton_p128"


def _chain_ok(conv_tactic: str, spec: LayerSpec) -> bool:
    found = get_tactic("QConvAct", "tensorkiln", conv_tactic)
    return found is not None and found.applies(_conv_part(spec))


def _chain(conv_tactic: str) -> Callable:
    """QConvPool as ``conv_tactic`` (a QConvAct tactic) and the pool's Triton kernel (both
    looked up on the first call: every tactic has registered by then)."""

    @cache
    def chained() -> Callable[..., torch.Tensor]:
        conv = get_tactic("QConvAct", "tensorkiln", conv_tactic)
        pool = get_tactic("MaxPool", "", _CHAIN_POOL)
        if conv is None or pool is None:
            raise RuntimeError(f"QConvPool: tactic {conv_tactic} or {_CHAIN_POOL} is missing")
        return qconv_pool_with(conv.fn, pool.fn)

    def run(*inputs, **attrs) -> torch.Tensor:
        return chained()(*inputs, **attrs)

    run.__name__ = f"qconv_pool_{conv_tactic}"
    return run


def _hopper() -> bool:
    """Whether the current GPU is sm_90 (Gluon's WGMMA kernels compile for Hopper only)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _gluon_qconv_ok(cfg: Any, spec: LayerSpec) -> bool:
    """conv_gluon's convolutions on Hopper: 1x1 or 3x3 padded by half the window, stride 1 or
    2, one group, an activation the fused epilogue has, a residual (if any) of a type it reads,
    channels a multiple of the K step."""
    if spec.device != "cuda" or conv_gluon is None or not _hopper():
        return False
    g = _qconv_geometry(spec, ("int8", "float8_e4m3fn"))
    if g is None or spec.attrs.get("activation", "") not in gemm.ACT_CODES:
        return False
    if len(spec.shapes) > 5 and spec.shapes[5] is not None:
        try:  # (a residual of a type the kernel reads)
            if torch_dtype(spec.dtypes[5]) not in conv_gluon.TYPES:
                return False
        except TypeError:
            return False
    dx = _dtypes(spec)[0]
    if dx == "int8" and not cfg.promote:  # (int8 sums are exact: the same kernel as promoting)
        return False
    x, w = spec.shapes[0], spec.shapes[2]
    if not conv_gluon.applies(x, w, dx, g, spec.attrs.get("group", 1), cfg.block_k):
        return False
    return cfg.block_n <= max(64, w[0])


def _gluon_estimate(cfg: Any, spec: LayerSpec) -> float:
    """The autotuner's ranking of a tiling (it times the best few of the group): the share of
    the tile's output channels that are the layer's, the wider tile first where both fill, and
    E4M3 sums left unpromoted first (fewer waits; the autotuner's check of the result rejects
    them where Hopper's narrower sums lose too much, and a promoting tiling is among the few)."""
    w = spec.shapes[2]
    oc = w[0] if w else cfg.block_n
    used = oc / (math.ceil(oc / cfg.block_n) * cfg.block_n)
    return used * (1.1 if cfg.block_n == 128 else 1.0) * (1.0 if cfg.promote else 1.05)


def _gluon_qconv(cfg: Any) -> Callable:
    name = f"gluon_qconv_{cfg.name}"

    def sums(x_q, w_q, bias, z, call: QConv) -> tuple[torch.Tensor, bool]:
        if call.out not in conv_gluon.TYPES:
            raise ValueError(f"{name}: an 8, 16 or 32-bit output, not {call.out}")
        y = conv_gluon.conv(
            x_q, w_q, bias, z, scale=(call.x_scale, call.w_scale),
            stride=call.geometry.strides[0], epilogue=Epilogue.of(call.activation, *call.act),
            residual_after=call.after, out_dtype=call.out, y_scale=call.y_scale,
            z_scale=call.z_scale, config=cfg,
        )  # fmt: skip
        return y, True

    return _qconv_with(sums, name)


def _eight_bit_score(cfg: Any, m: int, n: int, k: int) -> float:
    """The autotuner's estimate of a tiling of an M x N output summing K-long runs (a GEMM's K,
    a convolution's channels per tap) for 8-bit operands; it times the best few. The share of
    tile area doing useful work (output and K steps), times the share of the last wave of tiles
    that is busy, times the tile's operand reuse against a 128x256 tile's (8-bit sums are cheap;
    loads are what limits them), halved for K steps under 64 bytes, which feed Hopper's 8-bit
    tensor-core instructions (32 deep) one at a time."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    coverage = tactics_gemm.tile_coverage(cfg, m, n, tactics_gemm.sm_count())
    k_useful = k / (math.ceil(k / bk) * bk)
    reuse = min(1.0, (bm * bn / (bm + bn)) / (128 * 256 / 384))
    return coverage * k_useful * reuse * (1.0 if bk >= 64 else 0.5)


def _qgemm_estimate(cfg: Any, spec: LayerSpec) -> float:
    dims = _gemm_dims(spec)
    return 0.0 if dims is None else _eight_bit_score(cfg, *dims)


def _qconv_estimate(cfg: Any, spec: LayerSpec) -> float:
    g = _conv_geometry(spec)
    if g is None:
        return 0.0
    x, w = spec.shapes[0], spec.shapes[2]
    group = spec.attrs.get("group", 1)
    c = w[1]  # (input channels per group: the run summed at each tap)
    k = c * math.prod(w[2:]) if c < conv.FLAT_BELOW else c
    return _eight_bit_score(cfg, x[0] * math.prod(g.out), w[0] // group, k)


def _quant_configs() -> tuple:
    """Tilings for 8-bit operands besides the fp16 ones: the tensor cores take int8 and E4M3 in
    K steps of 32, and an 8-bit tile of 128 channels costs the shared memory of 64 in fp16."""
    if not available():
        return ()
    tile = gemm.TileConfig
    return (tile(128, 128, 128, 8, 3), tile(128, 256, 128, 8, 3), tile(64, 128, 128, 4, 4))


QUANT_CONFIGS = _quant_configs()


def _register() -> None:
    tactic(
        "QGemmAct", domain="tensorkiln", name="cublas_int8_mm", supports=partial(_qgemm_ok, "int8")
    )(_qgemm("int8"))
    tactic(
        "QGemmAct",
        domain="tensorkiln",
        name="cublas_fp8_scaled_mm",
        supports=partial(_qgemm_ok, "float8_e4m3fn"),
    )(_qgemm("fp8"))
    tactic(
        "QGemmAct", domain="tensorkiln", name="cublas_fp8_rowwise_act", supports=_rowwise_act_ok
    )(_qgemm_fp8_rowwise_act)
    tactic("QGemmAct", domain="tensorkiln", name="cublas_fp8_rowwise", supports=_rowwise_ok)(
        _qgemm_fp8_rowwise
    )
    tactic("QConvAct", domain="tensorkiln", name="cublas_int8_mm", supports=_pointwise_ok)(
        qconv_pointwise_int8
    )
    tactic("QConvAct", domain="tensorkiln", name="cudnn_fp16", supports=_half_ok)(qconv_half)
    if not available():
        return
    triton_families = (
        ("QGemmAct", "triton_qgemm", gemm.CONFIGS, _triton_qgemm_ok, _triton_qgemm, _qgemm_estimate),
        ("QConvAct", "triton_qconv", conv.CONFIGS, _triton_qconv_ok, _triton_qconv, _qconv_estimate),
    )  # fmt: skip
    for cfg in conv_tma.CONFIGS:  # (their own group: timed beside the others where they apply)
        tactic("QConvAct", domain="tensorkiln", name=f"triton_qconv3x3_{cfg.name}",
               supports=partial(_qconv3x3_ok, cfg), group="triton_qconv3x3")(_qconv3x3(cfg))  # fmt: skip
    for cfg in conv_stem.CONFIGS:  # (an image's convolution: their own group too)
        tactic("QConvAct", domain="tensorkiln", name=f"triton_qconv_stem_{cfg.name}",
               supports=_stem_ok, group="triton_qconv_stem")(_stem(cfg))  # fmt: skip
    # a stem and its pool (QConvPool): fused, or the two kernels apart, each group timed whole
    for cfg in conv_stem.POOL_CONFIGS:
        tactic("QConvPool", domain="tensorkiln", name=f"triton_qconv_stem_pool_{cfg.name}",
               supports=partial(_stem_pool_ok, cfg), group="triton_qconv_stem_pool")(_stem(cfg, pooled=True))  # fmt: skip
    for conv_tactic in ("cudnn_fp16", *(f"triton_qconv_stem_{c.name}" for c in conv_stem.CONFIGS)):
        tactic("QConvPool", domain="tensorkiln", name=f"{conv_tactic}+pool",
               supports=partial(_chain_ok, conv_tactic), group="qconv_pool_chain")(
            _chain(conv_tactic)
        )  # fmt: skip
    if conv_gluon is not None:  # (their own group too; Hopper only)
        for cfg in conv_gluon.CONFIGS:
            tactic("QConvAct", domain="tensorkiln", name=f"gluon_qconv_{cfg.name}",
                   supports=partial(_gluon_qconv_ok, cfg), group="gluon_qconv",
                   estimate=partial(_gluon_estimate, cfg))(_gluon_qconv(cfg))  # fmt: skip
    for op, prefix, configs, ok, kernel, estimate in triton_families:
        for cfg in QUANT_CONFIGS + configs:
            tactic(
                op,
                domain="tensorkiln",
                name=f"{prefix}_{cfg.name}",
                supports=partial(ok, cfg),
                estimate=partial(estimate, cfg),
            )(kernel(cfg))


_register()
