"""Normalizations on the cuda backend: BatchNormalization, InstanceNormalization,
LayerNormalization, GroupNormalization, RMSNormalization, LpNormalization,
MeanVarianceNormalization, LRN; and Dropout.

As in the reference, statistics are computed in float32 (float64 for float64 inputs, or the
``stash_type`` where the op has one) and the result is narrowed once. Dropout's ratio and
training_mode inputs are read on the host (scalars that decide what runs). BatchNormalization's and
Dropout's opset forms and outputs are kernels/common/norm.py's, shared with the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from onnx import helper

from tensorkiln.kernels.common.norm import (
    BatchNorm,
    Dropout,
    check_lrn,
    group_norm_layout,
    norm_axis,
)
from tensorkiln.kernels.cuda.convert import host_list, to_torch, torch_dtype
from tensorkiln.kernels.cuda.nn import compute_dtype
from tensorkiln.kernels.registry import register


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    """Broadcast shape of a per-channel vector against (N, C, D1, ...)."""
    return (-1,) + (1,) * (x.ndim - 2)


def _param(v: torch.Tensor, x: torch.Tensor, what: str, op: str, ct, flat=False) -> torch.Tensor:
    if v.numel() != x.shape[1]:
        raise ValueError(f"{op}: {what} has {v.numel()} values but X has {x.shape[1]} channels")
    return v.to(ct).reshape(-1 if flat else _channel_shape(x))


def _bn_apply(x, scale, bias, mean, var, epsilon: float, ct) -> torch.Tensor:
    """y = x * a + b with the per-channel a = scale / sqrt(var + eps), b = bias - mean * a."""
    if scale.ndim == 1:
        if x.dtype.is_floating_point:
            # torch's kernel: float32 arithmetic for narrow inputs, one pass
            return F.batch_norm(x, mean, var, scale, bias, False, 0.0, epsilon)
        scale, bias, mean, var = (v.reshape(_channel_shape(x)) for v in (scale, bias, mean, var))
    a = scale / torch.sqrt(var + epsilon)
    return torch.addcmul(bias - mean * a, x.to(ct), a).to(x.dtype)


def _bn_params(x, scale, bias, mean, var, spatial: int = 1):
    ct = compute_dtype(x.dtype)
    if not spatial and scale.numel() == x[0].numel() and x.ndim > 2:
        return ct, [v.to(ct).reshape(x.shape[1:]) for v in (scale, bias, mean, var)]
    names = ("scale", "B", "input_mean", "input_var")
    params = [
        _param(v, x, n, "BatchNormalization", ct, flat=True)
        for v, n in zip((scale, bias, mean, var), names)
    ]
    return ct, params


def _batch_stats(x: torch.Tensor, ct, spatial: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    axes = (0,) if not spatial else (0, *range(2, x.ndim))
    var, mean = torch.var_mean(x.to(ct), dim=axes, correction=0, keepdim=True)
    return mean, var


class TorchBatchNormArrays:
    """:class:`tensorkiln.kernels.common.norm.BatchNormArrays` on torch tensors."""

    params = staticmethod(_bn_params)
    apply = staticmethod(_bn_apply)
    batch_stats = staticmethod(_batch_stats)

    def astype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)


register("BatchNormalization", backend="cuda")(
    BatchNorm(TorchBatchNormArrays()).batch_normalization
)


def _standardize(xc: torch.Tensor, axes: tuple[int, ...], epsilon: float):
    """(x - mean) / sqrt(var + eps) over ``axes``; also returns mean and 1/sqrt(var + eps)."""
    var, mean = torch.var_mean(xc, dim=axes, correction=0, keepdim=True)
    inv_std = 1 / torch.sqrt(var + epsilon)
    return (xc - mean) * inv_std, mean, inv_std


@register("InstanceNormalization", since=1, backend="cuda")
def instance_normalization(
    x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, *, epsilon: float = 1e-5
) -> torch.Tensor:
    """Normalize each (n, c) plane over its spatial axes, then scale and shift per channel."""
    if x.ndim < 3:
        raise ValueError(
            f"InstanceNormalization: X must be (N, C, D1, ...), got shape {tuple(x.shape)}"
        )
    ct = compute_dtype(x.dtype)
    y, _, _ = _standardize(x.to(ct), tuple(range(2, x.ndim)), epsilon)
    y = y * _param(scale, x, "scale", "InstanceNormalization", ct)
    y = y + _param(bias, x, "B", "InstanceNormalization", ct)
    return y.to(x.dtype)


def _stash_dtype(stash_type: int) -> torch.dtype:
    return torch_dtype(helper.tensor_dtype_to_np_dtype(stash_type))


_FUSED_LN = (torch.float32, torch.float16, torch.bfloat16)


@register("LayerNormalization", since=17, backend="cuda")
def layer_normalization(
    x: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    axis: int = -1,
    epsilon: float = 1e-5,
    stash_type: int = 1,
    _n_outputs: int = 1,
):
    """Normalize over the axes from ``axis`` on; optional outputs Mean and InvStdDev."""
    axis = norm_axis(axis, x.ndim, "LayerNormalization")
    st = _stash_dtype(stash_type)
    shape = tuple(x.shape[axis:])
    fused = _n_outputs == 1 and st == torch.float32 and x.dtype in _FUSED_LN
    if fused and tuple(scale.shape) == shape and (bias is None or tuple(bias.shape) == shape):
        # torch's kernel keeps float32 statistics for narrow inputs, as the stash type asks
        b = None if bias is None else bias.to(x.dtype)
        return F.layer_norm(x, shape, scale.to(x.dtype), b, epsilon)
    y, mean, inv_std = _standardize(x.to(st), tuple(range(axis, x.ndim)), epsilon)
    y = y * scale.to(st)
    if bias is not None:
        y = y + bias.to(st)
    y = y.to(x.dtype)
    if _n_outputs == 1:
        return y
    return (y, mean, inv_std)[:_n_outputs]


def _group_norm(x, scale, bias, num_groups: int, epsilon: float, ct, per_channel: bool):
    args = (num_groups, scale.numel(), bias.numel(), per_channel)
    y_shape, shape = group_norm_layout(x.shape, *args)
    y, _, _ = _standardize(x.to(ct).reshape(x.shape[0], num_groups, -1), (2,), epsilon)
    y = y.reshape(y_shape) * scale.to(ct).reshape(shape) + bias.to(ct).reshape(shape)
    return y.reshape(x.shape).to(x.dtype)


# GroupNormalization-18 has one scale and bias value per group and no stash_type (statistics in
# float32, float64 for float64); from 21 on, one per channel.
_GN_PER_CHANNEL = 21


@register("GroupNormalization", backend="cuda")
def group_normalization(
    x: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    *,
    epsilon: float = 1e-5,
    num_groups: int,
    stash_type: int = 1,
    _opset: int = _GN_PER_CHANNEL,
) -> torch.Tensor:
    """Normalize each group of channels; scale and bias have one value per channel (per group
    before opset 21)."""
    if _opset < _GN_PER_CHANNEL:
        ct = compute_dtype(x.dtype)
        return _group_norm(x, scale, bias, num_groups, epsilon, ct, per_channel=False)
    st = _stash_dtype(stash_type)
    return _group_norm(x, scale, bias, num_groups, epsilon, st, per_channel=True)


@register("RMSNormalization", since=23, backend="cuda")
def rms_normalization(
    x: torch.Tensor,
    scale: torch.Tensor,
    *,
    axis: int = -1,
    epsilon: float = 1e-5,
    stash_type: int = 1,
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the axes from ``axis`` on, times scale."""
    axis = norm_axis(axis, x.ndim, "RMSNormalization")
    st = _stash_dtype(stash_type)
    shape = tuple(x.shape[axis:])
    if st == torch.float32 and x.dtype in _FUSED_LN and tuple(scale.shape) == shape:
        # torch's kernel keeps float32 statistics for narrow inputs, as the stash type asks
        return F.rms_norm(x, shape, scale.to(x.dtype), epsilon)
    xs = x.to(st)
    ms = (xs * xs).mean(dim=tuple(range(axis, x.ndim)), keepdim=True)
    return (xs * (1 / torch.sqrt(ms + epsilon)) * scale.to(st)).to(x.dtype)


@register("LpNormalization", since=1, backend="cuda")
def lp_normalization(x: torch.Tensor, *, axis: int = -1, p: int = 2) -> torch.Tensor:
    """x divided by its L1 or L2 norm along ``axis`` (zero where the norm is zero)."""
    if p not in (1, 2):
        raise ValueError(f"LpNormalization: p must be 1 or 2, got {p}")
    axis = norm_axis(axis, x.ndim, "LpNormalization")
    xc = x.to(compute_dtype(x.dtype))
    if p == 1:
        norm = xc.abs().sum(dim=axis, keepdim=True)
    else:
        norm = torch.sqrt((xc * xc).sum(dim=axis, keepdim=True))
    y = torch.where(norm == 0, 0, xc / norm)
    return y.to(x.dtype)


@register("MeanVarianceNormalization", since=9, backend="cuda")
def mean_variance_normalization(
    x: torch.Tensor, *, axes: Sequence[int] = (0, 2, 3)
) -> torch.Tensor:
    """(x - mean) / (sqrt(variance) + 1e-9) over ``axes``; the variance as E[(x - mean)^2], as
    the reference computes it (not the spec body's cancelling E[x^2] - mean^2)."""
    axes = tuple(norm_axis(a, x.ndim, "MeanVarianceNormalization") for a in axes)
    xc = x.to(compute_dtype(x.dtype))
    centred = xc - xc.mean(dim=axes, keepdim=True)
    std = torch.sqrt((centred * centred).mean(dim=axes, keepdim=True)) + 1e-9
    return (centred / std).to(x.dtype)


@register("LRN", since=1, backend="cuda")
def lrn(
    x: torch.Tensor,
    *,
    alpha: float = 1e-4,
    beta: float = 0.75,
    bias: float = 1.0,
    size: int,
) -> torch.Tensor:
    """x / (bias + alpha / size * sum of x^2 over a window of ``size`` channels) ** beta."""
    check_lrn(x.shape, size)
    xc = x.to(compute_dtype(x.dtype))
    lo = (size - 1) // 2  # channel c sums the squares of channels c - lo .. c - lo + size - 1
    sq = F.pad((xc * xc).movedim(1, -1), (lo, size - 1 - lo))
    window = sq.unfold(-1, size, 1).sum(dim=-1).movedim(-1, 1)
    return (xc / (bias + (alpha / size) * window) ** beta).to(x.dtype)


class TorchDropoutArrays:
    """:class:`tensorkiln.kernels.common.norm.DropoutArrays` on torch tensors."""

    def ratio(self, ratio: torch.Tensor | None, training: bool) -> float:
        # read back only when it matters: in inference the ratio changes nothing
        return 0.5 if ratio is None or not training else float(np.ravel(host_list(ratio))[0])

    def flag(self, v: torch.Tensor) -> bool:
        return bool(np.ravel(host_list(v))[0])

    def ones(self, x: torch.Tensor, boolean: bool) -> torch.Tensor:
        return torch.ones_like(x, dtype=torch.bool if boolean else x.dtype)

    def keep(self, x: torch.Tensor, ratio: float, seed: int | None) -> torch.Tensor:
        if seed is None:
            return torch.rand(x.shape, device=x.device) >= ratio
        # a seeded mask is drawn as the reference draws it, so that both backends agree
        rng = np.random.RandomState(seed)
        return to_torch(rng.uniform(0.0, 1.0, tuple(x.shape)) >= ratio, x.device)

    def astype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)


register("Dropout", backend="cuda")(Dropout(TorchDropoutArrays()).dropout)
