"""tensorkiln.QConvAct and QGemmAct on the cuda backend: exact sums of the quantized products.

The products of int8 or float8 (E4M3) operands are summed in float64 here, where every such sum
is exact (the reference kernels' contract; an int32 accumulator holds the same values), then
scaled per output channel and finished in float32 with ConvAct's and GemmAct's epilogues. These
are the kernels every graph with quantized layers can run with; the tensor-core tactics (int8
GEMMs through torch._int_mm, FP8 through torch._scaled_mm, Triton implicit-GEMM convolutions)
are timed against them by the autotuner.

Every quantized kernel and tactic of this tree goes through :func:`qconv` / :func:`qgemm`, which
read the attributes with the op record's defaults (ops/fused.py), check the operands, and hand
the sums to one function the caller picks; only that function differs between them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tensorkiln.kernels.common.conv import check_conv_act
from tensorkiln.kernels.common.gemm import gemm_layout
from tensorkiln.kernels.common.quant import check_quantized_output, check_quantized_residual
from tensorkiln.kernels.common.window import Geometry
from tensorkiln.kernels.cuda.convert import kept
from tensorkiln.kernels.cuda.fused_conv import activate_, conv_epilogue_, geometry_of
from tensorkiln.kernels.cuda.nn import conv_nd
from tensorkiln.kernels.cuda.pool import max_pool
from tensorkiln.kernels.cuda.quant import quantize_linear
from tensorkiln.kernels.registry import register
from tensorkiln.kernels.triton import available as triton_available
from tensorkiln.kernels.triton import interpreting
from tensorkiln.ops import attribute_defaults
from tensorkiln.ops.fused import conv_attrs, pool_attrs

if triton_available():
    from tensorkiln.kernels.triton import epilogue
    from tensorkiln.kernels.triton.gemm import ACT_CODES, Epilogue
else:  # (no Triton: the epilogues run as torch's ops)
    epilogue, ACT_CODES, Epilogue = None, {}, None

_QUANTIZED = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def _exact(q: torch.Tensor, what: str) -> torch.Tensor:
    if q.dtype not in _QUANTIZED:
        raise ValueError(f"{what} must be int8 or float8, got {q.dtype}")
    return q.to(torch.float64)


def _scales(
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    n: int,
    what: str,
    dtype: torch.dtype = torch.float64,
    alpha: float = 1.0,
) -> torch.Tensor:
    """alpha * X_scale * W_scale per output channel in ``dtype``, shape (n,), contiguous. In
    float32 it is one multiplication of float32 scales (a CUDA graph replays every kernel a
    layer launches: no widening copies), rounded once as the float64 product would be where
    alpha is 1."""
    ws = _check_scales(x_scale, w_scale, n, what)
    s = x_scale.reshape(()).to(dtype) * ws.to(dtype)
    if alpha != 1.0:
        s = s * alpha
    return s.expand(n).contiguous()


def _check_scales(x_scale: torch.Tensor, w_scale: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """W_scale as a vector, after checking both scales' sizes."""
    if x_scale.numel() != 1:
        raise ValueError(
            f"{what}: the activation's scale must be one value, got {tuple(x_scale.shape)}"
        )
    ws = w_scale.reshape(-1)
    if ws.numel() not in (1, n):
        raise ValueError(
            f"{what}: the weight's scale has {ws.numel()} values; it needs 1 or one per output "
            f"channel ({n})"
        )
    return ws


_OUT = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16}
_REQUANTIZED = {3: torch.int8, 17: torch.float8_e4m3fn}  # (with Y_scale)


def out_type(out_dtype: int, y_scale: torch.Tensor | None = None) -> torch.dtype:
    """The torch type of a quantized layer's output (``out_dtype``: ONNX's code): a float type,
    or with ``y_scale`` int8 or E4M3."""
    check_quantized_output(int(out_dtype), None if y_scale is None else y_scale.numel())
    if y_scale is not None:
        return _REQUANTIZED[int(out_dtype)]
    want = _OUT.get(int(out_dtype))
    if want is None:
        raise ValueError(
            f"quantized layers output float32, float16 or bfloat16 (int8 or E4M3 with Y_scale), "
            f"not type {out_dtype}"
        )
    return want


def as_out(y: torch.Tensor, out_dtype: int, y_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` (float32) in the layer's output type (ONNX's code); with ``y_scale``, quantized to
    it as QuantizeLinear does (saturating, zero point 0)."""
    want = out_type(out_dtype, y_scale)
    if y_scale is not None:
        return quantize_linear(y, y_scale.reshape(()).to(torch.float32), output_dtype=out_dtype)
    return y if y.dtype == want else y.to(want)


def _attrs(op: str, given: dict[str, Any]) -> dict[str, Any]:
    return {**attribute_defaults(op, "tensorkiln", 1), **given}


def _activation(a: dict[str, Any]) -> tuple:
    return (a["activation_alpha"], a["activation_beta"], a["activation_min"], a["activation_max"])


@dataclass(frozen=True)
class QConv:
    """A checked QConvAct call: its geometry, group, per-channel scale (float32) and epilogue."""

    geometry: Geometry
    group: int
    channels: int  # output channels
    activation: str
    act: tuple  # (alpha, beta, min, max)
    after: bool  # residual_order == "act_add"
    out: torch.dtype  # the layer's output type (sums that finish the epilogue write it)
    x_scale: torch.Tensor  # X_scale (float32, one value) and W_scale (float32, one per output
    w_scale: torch.Tensor  # channel or one for all)
    y_scale: torch.Tensor | None  # float32, one value: ``out`` is int8 or E4M3, quantized to it
    z_scale: torch.Tensor | None = None  # float32, one value: the residual is int8 or E4M3

    def scale(self) -> torch.Tensor:
        """X_scale * W_scale per output channel, float32 (formed only where a kernel needs it)."""
        return _scales(self.x_scale, self.w_scale, self.channels, "QConvAct", torch.float32)

    def residual(self, z: torch.Tensor | None) -> torch.Tensor | None:
        """The residual as float32: a quantized one times Z_scale, as DequantizeLinear reads it
        (for the kernels that do not read it quantized)."""
        if z is None:
            return None
        z32 = z.to(torch.float32)
        return z32 if self.z_scale is None else z32 * self.z_scale.reshape(())


# the sums of one QConvAct: (x_q, w_q, bias, z, call) -> the convolution times the scale, float32,
# or with the epilogue applied (then ``True`` second, in ``call.out``); z as the layer has it
ConvSums = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, QConv],
                    tuple[torch.Tensor, bool]]  # fmt: skip


def qconv(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    b: torch.Tensor | None,
    z: torch.Tensor | None,
    y_scale: torch.Tensor | None,
    attrs: dict[str, Any],
    sums: ConvSums,
    z_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """QConvAct: ``sums`` computes the scaled convolution; the epilogue (bias, residual,
    activation, and with ``y_scale`` the quantization) runs here unless ``sums`` did it; the
    result in ``out_dtype``. With ``z_scale`` the residual ``z`` is int8 or float8 (the sums
    get it as it is and read it through ``call.residual`` or quantized)."""
    a = _attrs("QConvAct", attrs)
    b_size = None if b is None else b.numel()
    check_conv_act(tuple(x_q.shape), tuple(w_q.shape), b_size, a["group"], a["activation"],
                   a["residual_order"])  # fmt: skip
    g = geometry_of(x_q, w_q, a["auto_pad"], a["dilations"], a["kernel_shape"], a["pads"],
                    a["strides"])  # fmt: skip
    m = w_q.shape[0]
    ws = _check_scales(x_scale, w_scale, m, "QConvAct").to(torch.float32)
    ys = None if y_scale is None else y_scale.reshape(1).to(torch.float32)
    zs = None
    if z_scale is not None:
        eight_bit = z is not None and z.dtype in _QUANTIZED
        check_quantized_residual(eight_bit, str(None if z is None else z.dtype), z_scale.numel())
        zs = z_scale.reshape(1).to(torch.float32)
    call = QConv(g, a["group"], m, a["activation"], _activation(a),
                 a["residual_order"] == "act_add", out_type(a["out_dtype"], y_scale),
                 x_scale.reshape(()).to(torch.float32), ws, ys, zs)  # fmt: skip
    # (kept per constant: a float16 engine's bias would otherwise be widened on every call)
    bias = None if b is None else kept(b, ("float32", m), lambda: b.reshape(m).to(torch.float32))
    y, finished = sums(x_q, w_q, bias, z, call)
    if not finished:
        y = conv_epilogue_(y, bias, call.residual(z), call.activation, call.act, call.after)
        return as_out(y, a["out_dtype"], ys)
    return y


def channels_last_like(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a convolution of ``x`` and ``w`` writes channels-last: when either is (the rule of
    torch's fp16 and fp32 convolutions, and of every tactic here)."""
    return x.ndim == 4 and any(t.stride(1) == 1 and not t.is_contiguous() for t in (x, w))


def _exact_conv(x_q, w_q, bias, z, call: QConv) -> tuple[torch.Tensor, bool]:
    acc = conv_nd(_exact(x_q, "QConvAct's X"), _exact(w_q, "QConvAct's W"), None, call.geometry,
                  call.group)  # fmt: skip
    # cuDNN runs float64 convolutions NCHW whatever the operands' layout; the tactics write
    # channels-last. A layer's output layout must not depend on which kernel ran it: the
    # autotuner times each layer on what the defaults before it wrote, and the engine runs it
    # on what the chosen tactics write.
    if channels_last_like(x_q, w_q) and not acc.is_contiguous(memory_format=torch.channels_last):
        acc = acc.contiguous(memory_format=torch.channels_last)
    m = acc.shape[1]
    scale = (call.x_scale.to(torch.float64) * call.w_scale.to(torch.float64)).expand(m)
    scale = scale.reshape(1, m, *(1,) * (acc.ndim - 2))
    return (acc * scale).to(torch.float32), False


@register("QConvAct", domain="tensorkiln", since=1, backend="cuda")
def qconv_act(
    x_q, x_scale, w_q, w_scale, b=None, z=None, y_scale=None, z_scale=None, **attrs
) -> torch.Tensor:
    """act(conv(X_q, W_q) * X_scale * W_scale + B + Z) (or act(...) + Z), computed in float32,
    returned in ``out_dtype`` (quantized to ``y_scale`` when given; Z quantized with
    ``z_scale``); attributes as ops/fused.py records them."""
    return qconv(x_q, x_scale, w_q, w_scale, b, z, y_scale, attrs, _exact_conv, z_scale)


def qconv_pool_with(
    conv: Callable[..., torch.Tensor], pool: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """QConvPool as two kernels: ``conv`` (a QConvAct kernel or tactic) on the layer's inputs
    and convolution attributes, then ``pool`` (a MaxPool kernel or tactic) on its output."""

    def run(x_q, x_scale, w_q, w_scale, b=None, z=None, y_scale=None, **attrs) -> torch.Tensor:
        if z is not None:
            raise ValueError("QConvPool takes no residual Z")
        y = conv(x_q, x_scale, w_q, w_scale, b, None, y_scale, **conv_attrs(attrs))
        return pool(y, **pool_attrs(attrs))

    return run


_exact_conv_then_pool = qconv_pool_with(qconv_act, max_pool)


@register("QConvPool", domain="tensorkiln", since=1, backend="cuda")
def qconv_pool(*inputs: torch.Tensor | None, **attrs) -> torch.Tensor:
    """MaxPool(QConvAct(...)) (ops/fused.py): the exact convolution, then the pool."""
    return _exact_conv_then_pool(*inputs, **attrs)


@dataclass(frozen=True)
class QGemm:
    """A checked QGemmAct call: A as (M, K), B (the packed (N, K) weight when ``packed``, else
    (K, N)), the bias broadcasting to (M, N) (times ``beta``) or None, the scales, the epilogue,
    and the output type."""

    a2: torch.Tensor
    b: torch.Tensor
    packed: bool
    bias: torch.Tensor | None
    beta: float
    x_scale: torch.Tensor
    w_scale: torch.Tensor
    alpha: float
    activation: str
    act: tuple  # (alpha, beta, min, max)
    out: torch.dtype
    y_scale: torch.Tensor | None  # float32, one value: ``out`` is int8 or E4M3, quantized to it
    out_dtype: int  # ONNX's code of ``out``
    shape: tuple[int, ...]  # the output's

    def scale(self, dtype: torch.dtype) -> torch.Tensor:
        """alpha * A_scale * B_scale per column, (N,), in ``dtype``."""
        n = self.b.shape[0] if self.packed else self.b.shape[1]
        return _scales(self.x_scale, self.w_scale, n, "QGemmAct", dtype, self.alpha)


def qgemm_call(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    c: torch.Tensor | None,
    y_scale: torch.Tensor | None,
    attrs: dict[str, Any],
) -> QGemm:
    """QGemmAct's operands and attributes (the op record's defaults filled in), checked."""
    a = _attrs("QGemmAct", attrs)
    ys = None if y_scale is None else y_scale.reshape(1).to(torch.float32)
    out = out_type(a["out_dtype"], ys)  # (checked before the product)
    a2, b2, bias = gemm_layout(a_q, b_q, c, a["beta"], a["transA"], a["transB"], "QGemmAct")
    packed = bool(a["transB"])
    n = b2.shape[1]
    _check_scales(a_scale, b_scale, n, "QGemmAct")  # (before the product)
    shape = (a2.shape[0], n) if a_q.ndim == 2 else (*a_q.shape[:-1], n)
    return QGemm(a2, b_q if packed else b2, packed, bias, float(a["beta"]), a_scale, b_scale,
                 float(a["alpha"]), a["activation"], _activation(a), out, ys, int(a["out_dtype"]),
                 shape)  # fmt: skip


def qgemm(
    call: QGemm, product: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]
) -> torch.Tensor:
    """QGemmAct: ``product(A (M, K), B, packed)`` gives the sums, float32 or int32 or float64
    (``packed``: B is the (N, K) weight fuse_quantized stores, else (K, N)); scale, bias and
    activation (and with ``y_scale`` the quantization) run here; the result in ``out_dtype``."""
    acc = product(call.a2, call.b, call.packed)
    # (int32 or float32 sums: the scale in float32 too)
    scale = call.scale(torch.float64 if acc.dtype == torch.float64 else torch.float32)
    y = one_pass(acc, scale, call)
    if y is not None:
        return y.reshape(call.shape)
    y = (acc * scale).to(torch.float32)
    if call.bias is not None:
        y.add_(call.bias.to(torch.float32), alpha=call.beta)
    if call.activation and math.prod(y.shape):
        activate_(y, call.activation, *call.act)
    return as_out(y, call.out_dtype, call.y_scale).reshape(call.shape)


def one_pass(acc: torch.Tensor, scale: torch.Tensor, call: QGemm) -> torch.Tensor | None:
    """QGemmAct's scale, bias and activation on tensor-core sums (int32 or float32, (M, N)) in one
    Triton pass writing the output type; None where it does not apply (then torch's ops run)."""
    if not one_pass_epilogue(acc, None, call.activation):
        return None
    n = acc.shape[1]
    bias = call.bias
    if bias is not None:
        if bias.numel() != n or (bias.ndim == 2 and bias.shape[0] != 1):
            return None  # (a bias of more than one row: Gemm's (M, N) C)
        bias = bias.reshape(n).to(torch.float32)
        bias = bias * call.beta if call.beta != 1.0 else bias
    ep = Epilogue.of(call.activation, *call.act)
    return epilogue.dequantize(acc, scale, bias, None, ep, False, call.out, call.y_scale)


def one_pass_epilogue(acc: torch.Tensor, z: torch.Tensor | None, activation: str) -> bool:
    """Whether kernels/triton/epilogue.py's dequantize takes these sums, residual and
    activation here (on the GPU, or through Triton's interpreter)."""
    if epilogue is None or activation not in ACT_CODES:
        return False
    return (acc.is_cuda or interpreting()) and epilogue.dequantize_applies(acc, z)


def _exact_product(a2: torch.Tensor, b: torch.Tensor, packed: bool) -> torch.Tensor:
    b64 = _exact(b, "QGemmAct's B")
    return torch.mm(_exact(a2, "QGemmAct's A"), b64.t() if packed else b64)


@register("QGemmAct", domain="tensorkiln", since=1, backend="cuda")
def qgemm_act(a_q, a_scale, b_q, b_scale, c=None, y_scale=None, **attrs) -> torch.Tensor:
    """act(alpha * (A_q' @ B_q') * A_scale * B_scale + beta * C), computed in float32, returned
    in ``out_dtype`` (quantized to ``y_scale`` when given); attributes as ops/fused.py records
    them."""
    return qgemm(qgemm_call(a_q, a_scale, b_q, b_scale, c, y_scale, attrs), _exact_product)
