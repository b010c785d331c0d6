"""The fused normalizations and activations of :mod:`tensorkiln.passes.fuse_norm` on the cuda backend.

* ``LayerNorm(X, scale, bias?, residual?) {axis, epsilon}`` -> ``Y[, S]``: F.layer_norm over the axes
  from ``axis`` on, of ``S = X + residual`` when there is a residual (S is the second output).
* ``RMSNorm(X, scale) {axis, epsilon}``: ``X / sqrt(mean(X^2) + epsilon) * scale``.
* ``Gelu(X) {approximate}`` and ``SiLU(X)``: F.gelu and F.silu.

As in :mod:`tensorkiln.kernels.reference.fused_norm`, float16/bfloat16 inputs compute their
statistics and the affine step in float32 and return the input's dtype (float64 stays float64).
F.layer_norm does so inside one kernel when scale and bias span exactly the normalized axes; a
scale or bias that broadcasts differently (a 1 inside the normalized axes, or values that vary
along the leading ones) is applied after the normalization, in the compute dtype. The LayerNorm
and RMSNorm entries (residual sum, axis check, outputs) are kernels/common/norm.py's FusedNorm,
shared with the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tensorkiln.kernels.common.norm import FusedNorm
from tensorkiln.kernels.cuda.quant import quantize_linear
from tensorkiln.kernels.registry import register

DOMAIN = "tensorkiln"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_normalized(p: torch.Tensor | None, s: torch.Tensor, axis: int) -> torch.Tensor | None:
    """``p`` laid out as the normalized shape ``s.shape[axis:]`` (for F.layer_norm's weight or
    bias), or None when it does not broadcast to one value per normalized element."""
    shape = tuple(s.shape[axis:])
    if p.ndim > s.ndim:
        return None
    padded = (1,) * (s.ndim - p.ndim) + tuple(p.shape)
    if any(d != 1 for d in padded[:axis]):
        return None
    if any(d not in (1, n) for d, n in zip(padded[axis:], shape)):
        return None
    return p.reshape(padded[axis:]).expand(shape).to(s.dtype).contiguous()


def _layer_norm_fused(s, axis, scale, bias, epsilon) -> torch.Tensor | None:
    """F.layer_norm with the affine step inside it, or None when scale or bias do not fit."""
    w = _as_normalized(scale, s, axis)
    b = None if bias is None else _as_normalized(bias, s, axis)
    if w is None or (bias is not None and b is None):
        return None
    return F.layer_norm(s, tuple(s.shape[axis:]), w, b, epsilon)


def _layer_norm_broadcast(s, axis, scale, bias, epsilon) -> torch.Tensor:
    """Normalization, then scale and bias broadcast against the whole tensor, in the compute
    dtype (the reference's order)."""
    ct = _compute_dtype(s.dtype)
    y = F.layer_norm(s.to(ct), tuple(s.shape[axis:]), None, None, epsilon)
    y.mul_(scale.to(ct))
    if bias is not None:
        y.add_(bias.to(ct))
    return y.to(s.dtype)


class TorchFusedNormArrays:
    """:class:`tensorkiln.kernels.common.norm.FusedNormArrays` on torch tensors."""

    def layer_norm(
        self,
        s: torch.Tensor,
        axis: int,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        epsilon: float,
    ) -> torch.Tensor:
        if s.numel() == 0:
            return torch.empty_like(s)
        y = _layer_norm_fused(s, axis, scale, bias, epsilon)
        return _layer_norm_broadcast(s, axis, scale, bias, epsilon) if y is None else y

    def rms_norm(
        self, x: torch.Tensor, axis: int, scale: torch.Tensor, epsilon: float
    ) -> torch.Tensor:
        if x.numel() == 0:
            return torch.empty_like(x)
        ct = _compute_dtype(x.dtype)
        dims = tuple(range(axis, x.ndim))
        count = max(math.prod(x.shape[axis:]), 1)
        # the sum of squares reduced in the compute dtype straight from x (no widened copy of x)
        ss = torch.linalg.vector_norm(x, 2, dim=dims, keepdim=True, dtype=ct)
        inv = ss.square_().div_(count).add_(epsilon).rsqrt_()
        y = x.to(ct) * inv
        y.mul_(scale.to(ct))
        return y.to(x.dtype)

    def quantize(self, y: torch.Tensor, scale: torch.Tensor, q_dtype: int) -> torch.Tensor:
        return quantize_linear(y, scale, output_dtype=q_dtype)


_NORMS = FusedNorm(TorchFusedNormArrays())
layer_norm = register("LayerNorm", domain=DOMAIN, since=1, backend="cuda")(_NORMS.layer_norm)
rms_norm = register("RMSNorm", domain=DOMAIN, since=1, backend="cuda")(_NORMS.rms_norm)


@register("Gelu", domain=DOMAIN, since=1, backend="cuda")
def gelu(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    """GELU as ONNX Gelu (opset 20) defines it, for models of older opsets."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"Gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return F.gelu(x, approximate=approximate)


@register("SiLU", domain=DOMAIN, since=1, backend="cuda")
def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``."""
    return F.silu(x)
