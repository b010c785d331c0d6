"""Activation kernels of the cuda backend, in torch: Relu and its variants, the sigmoid family,
Softplus, Softsign, Mish, Gelu, Swish and SwiGLU. They match ``kernels/reference/elementwise.py``
op for op.

Composite activations compute float16/bfloat16 in float32 and round once, as the reference does;
single torch functions (sigmoid, gelu, mish...) take float16 as is (torch computes them in float32
internally). Where a formula needs floats, float8 inputs compute in float32 and integers in
float64 (see :func:`tensorkiln.kernels.cuda.elementwise.compute`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tensorkiln.kernels.common.elementwise import (
    PRELU_BROADCASTS,
    check_prelu_slope,
    prelu_slope_shape,
)
from tensorkiln.kernels.cuda.elementwise import FLOAT8, UNSIGNED, compute
from tensorkiln.kernels.registry import register

Tensor = torch.Tensor


def _cuda(name: str, since: int = 1) -> Callable[[Callable], Callable]:
    return register(name, since=since, backend="cuda")


def _in_float(fn: Callable[..., Tensor], x: Tensor, *args: object) -> Tensor:
    """A multi-step formula ``fn(v, *args)`` on ``x`` in its compute dtype, rounded back once."""
    v = compute(x)
    y = fn(v, *args)
    return y if v is x else y.to(x.dtype)


def _native(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """A single torch function: float16/bfloat16 as is, float8 and integers through a float."""
    if x.dtype in FLOAT8 or not x.is_floating_point():
        return fn(compute(x)).to(x.dtype)
    return fn(x)


@_cuda("Sigmoid")
def sigmoid(x: Tensor, *, consumed_inputs: list[int] | None = None) -> Tensor:
    """Logistic sigmoid."""
    return _native(torch.sigmoid, x)


def _swish(v: Tensor, alpha: float) -> Tensor:
    return v * torch.sigmoid(v * alpha)


@_cuda("Swish", since=24)
def swish(x: Tensor, *, alpha: float = 1.0) -> Tensor:
    """x * sigmoid(alpha x)."""
    if alpha == 1.0:
        return _native(F.silu, x)
    return _in_float(_swish, x, alpha)


@_cuda("SwiGLU", since=28)
def swiglu(a: Tensor, b: Tensor, *, alpha: float = 1.0) -> Tensor:
    """Swish(a) * b, for same-shaped gate ``a`` and value ``b``."""
    if a.shape != b.shape:
        raise ValueError(
            f"SwiGLU needs A and B of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    return _in_float(lambda v: _swish(v, alpha) * compute(b), a)


@_cuda("Relu")
def relu(x: Tensor, *, consumed_inputs: list[int] | None = None) -> Tensor:
    """max(x, 0); NaN stays NaN."""
    if x.dtype in UNSIGNED:
        return x
    return _native(torch.relu, x) if x.dtype in FLOAT8 else torch.relu(x)


@_cuda("LeakyRelu")
def leaky_relu(
    x: Tensor,
    *,
    alpha: float = 0.009999999776482582,
    consumed_inputs: list[int] | None = None,
) -> Tensor:
    """x where x >= 0, alpha x elsewhere."""
    return _native(lambda v: F.leaky_relu(v, alpha), x)


@_cuda("PRelu")
def prelu(
    x: Tensor,
    slope: Tensor,
    *,
    consumed_inputs: list[int] | None = None,
    _opset: int = PRELU_BROADCASTS,
) -> Tensor:
    """x where x >= 0, slope x elsewhere; ``slope`` broadcasts to ``x`` (before opset 7 a 1-D
    slope of length C is laid along axis 1)."""
    view = prelu_slope_shape(slope.shape, x.shape, _opset)
    if view is not None:
        slope = slope.reshape(view)
    check_prelu_slope(slope.shape, x.shape)
    if x.dtype in UNSIGNED:
        return x.clone()
    if x.dtype in FLOAT8:
        return prelu(x.float(), slope.float()).to(x.dtype)
    return torch.where(x < 0, x * slope.to(x.dtype), x)


@_cuda("Elu")
def elu(x: Tensor, *, alpha: float = 1.0, consumed_inputs: list[int] | None = None) -> Tensor:
    """x where x > 0, alpha (exp(x) - 1) elsewhere."""
    return _native(lambda v: F.elu(v, alpha), x)


@_cuda("Celu", since=12)
def celu(x: Tensor, *, alpha: float = 1.0) -> Tensor:
    """max(0, x) + min(0, alpha (exp(x / alpha) - 1))."""
    return _native(lambda v: F.celu(v, alpha), x)


@_cuda("Selu")
def selu(
    x: Tensor,
    *,
    alpha: float = 1.67326319217681884765625,
    gamma: float = 1.05070102214813232421875,
    consumed_inputs: list[int] | None = None,
) -> Tensor:
    """gamma x where x > 0, gamma alpha (exp(x) - 1) elsewhere."""
    # aten's elu takes the output scale: gamma (x > 0 ? x : alpha (exp(x) - 1)) in one pass
    return _native(lambda v: torch.ops.aten.elu(v, alpha, gamma, 1.0), x)


def _hard_sigmoid(v: Tensor, alpha: float, beta: float) -> Tensor:
    return (v * alpha + beta).clamp_(0.0, 1.0)


@_cuda("HardSigmoid")
def hard_sigmoid(
    x: Tensor,
    *,
    alpha: float = 0.20000000298023224,
    beta: float = 0.5,
    consumed_inputs: list[int] | None = None,
) -> Tensor:
    """max(0, min(1, alpha x + beta))."""
    return _in_float(_hard_sigmoid, x, alpha, beta)


@_cuda("HardSwish", since=14)
def hard_swish(x: Tensor) -> Tensor:
    """x * max(0, min(1, x / 6 + 1 / 2))."""
    return _native(F.hardswish, x)


@_cuda("ThresholdedRelu", since=10)
def thresholded_relu(x: Tensor, *, alpha: float = 1.0) -> Tensor:
    """x where x > alpha, 0 elsewhere (compared in float32 at least: a scalar compared with a
    half tensor is rounded to half first, and bfloat16(0.4) > 0.4 would let through 0.4004)."""
    v = x.float() if x.dtype in FLOAT8 or x.dtype in (torch.float16, torch.bfloat16) else x
    return torch.where(v > alpha, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _shrink(v: Tensor, bias: float, lambd: float) -> Tensor:
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    return torch.where(v < -lambd, v + bias, torch.where(v > lambd, v - bias, zero))


@_cuda("Shrink", since=9)
def shrink(x: Tensor, *, bias: float = 0.0, lambd: float = 0.5) -> Tensor:
    """x + bias below -lambd, x - bias above lambd, 0 between (integer inputs too)."""
    return _in_float(_shrink, x, bias, lambd)


@_cuda("Softplus")
def softplus(x: Tensor) -> Tensor:
    """log(1 + exp(x))."""
    # above the threshold torch returns x; log1p(exp(x)) rounds to x there in float32 from 17 on,
    # in float64 only from 37 on
    threshold = 40.0 if x.dtype == torch.float64 else 20.0
    return _native(lambda v: F.softplus(v, threshold=threshold), x)


@_cuda("Softsign")
def softsign(x: Tensor) -> Tensor:
    """x / (1 + |x|)."""
    return _in_float(F.softsign, x)


@_cuda("Mish", since=18)
def mish(x: Tensor) -> Tensor:
    """x * tanh(softplus(x))."""
    return _native(F.mish, x)


@_cuda("Gelu", since=20)
def gelu(x: Tensor, *, approximate: str = "none") -> Tensor:
    """x Phi(x) with the exact erf form (``none``) or the tanh approximation (``tanh``)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"Gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return _native(lambda v: F.gelu(v, approximate=approximate), x)
