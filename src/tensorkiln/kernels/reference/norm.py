"""Normalizations: BatchNormalization, InstanceNormalization, LayerNormalization,
GroupNormalization, RMSNormalization, LpNormalization, MeanVarianceNormalization, LRN; and Dropout.

Statistics are computed in float32 (float64 for float64 inputs, or the ``stash_type`` where the op
has one); float16/bfloat16 inputs are widened once and the result narrowed once.
BatchNormalization's and Dropout's opset forms and outputs are kernels/common/norm.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import helper

from tensorkiln.kernels.common.norm import (
    BatchNorm,
    Dropout,
    check_lrn,
    group_norm_layout,
    norm_axis,
)
from tensorkiln.kernels.reference._window import compute_dtype
from tensorkiln.kernels.registry import register


def _channel_shape(x: np.ndarray) -> tuple[int, ...]:
    """Broadcast shape of a per-channel vector against (N, C, D1, ...)."""
    return (-1,) + (1,) * (x.ndim - 2)


def _param(v: np.ndarray, x: np.ndarray, what: str, op: str, ct) -> np.ndarray:
    if v.size != x.shape[1]:
        raise ValueError(f"{op}: {what} has {v.size} values but X has {x.shape[1]} channels")
    return v.astype(ct, copy=False).reshape(_channel_shape(x))


def _bn_apply(x, scale, bias, mean, var, epsilon, ct) -> np.ndarray:
    """y = x * a + b with the per-channel a = scale / sqrt(var + eps), b = bias - mean * a."""
    a = scale / np.sqrt(var + ct.type(epsilon))
    y = x.astype(ct, copy=False) * a
    y += bias - mean * a
    return y.astype(x.dtype, copy=False)


def _bn_params(x, scale, bias, mean, var, spatial=1):
    ct = compute_dtype(x.dtype)
    if not spatial and scale.size == x[0].size and x.ndim > 2:
        return ct, [v.astype(ct, copy=False).reshape(x.shape[1:]) for v in (scale, bias, mean, var)]
    names = ("scale", "B", "input_mean", "input_var")
    params = [
        _param(v, x, n, "BatchNormalization", ct) for v, n in zip((scale, bias, mean, var), names)
    ]
    return ct, params


def _batch_stats(x: np.ndarray, ct, spatial: int = 1) -> tuple[np.ndarray, np.ndarray]:
    axes = (0,) if not spatial else (0, *range(2, x.ndim))
    xc = x.astype(ct, copy=False)
    mean = xc.mean(axis=axes, keepdims=True)
    var = np.square(xc - mean).mean(axis=axes, keepdims=True)
    return mean, var


class NumpyBatchNormArrays:
    """:class:`tensorkiln.kernels.common.norm.BatchNormArrays` on numpy arrays."""

    params = staticmethod(_bn_params)
    apply = staticmethod(_bn_apply)
    batch_stats = staticmethod(_batch_stats)

    def astype(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return x.astype(dtype)


register("BatchNormalization")(BatchNorm(NumpyBatchNormArrays()).batch_normalization)


def _standardize(xc: np.ndarray, axes: tuple[int, ...], epsilon: float):
    """(x - mean) / sqrt(var + eps) over ``axes``; also returns mean and 1/sqrt(var + eps)."""
    mean = xc.mean(axis=axes, keepdims=True)
    centered = xc - mean
    var = np.mean(centered * centered, axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(var + xc.dtype.type(epsilon))
    centered *= inv_std
    return centered, mean, inv_std


@register("InstanceNormalization", since=1)
def instance_normalization(
    x: np.ndarray, scale: np.ndarray, bias: np.ndarray, *, epsilon: float = 1e-5
) -> np.ndarray:
    """Normalize each (n, c) plane over its spatial axes, then scale and shift per channel."""
    if x.ndim < 3:
        raise ValueError(f"InstanceNormalization: X must be (N, C, D1, ...), got shape {x.shape}")
    ct = compute_dtype(x.dtype)
    y, _, _ = _standardize(x.astype(ct), tuple(range(2, x.ndim)), epsilon)
    y *= _param(scale, x, "scale", "InstanceNormalization", ct)
    y += _param(bias, x, "B", "InstanceNormalization", ct)
    return y.astype(x.dtype, copy=False)


def _stash_dtype(x: np.ndarray, stash_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(stash_type))


@register("LayerNormalization", since=17)
def layer_normalization(
    x: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray | None = None,
    *,
    axis: int = -1,
    epsilon: float = 1e-5,
    stash_type: int = 1,
    _n_outputs: int = 1,
):
    """Normalize over the axes from ``axis`` on; optional outputs Mean and InvStdDev."""
    axis = norm_axis(axis, x.ndim, "LayerNormalization")
    st = _stash_dtype(x, stash_type)
    y, mean, inv_std = _standardize(x.astype(st), tuple(range(axis, x.ndim)), epsilon)
    y *= scale.astype(st, copy=False)
    if bias is not None:
        y += bias.astype(st, copy=False)
    y = y.astype(x.dtype, copy=False)
    if _n_outputs == 1:
        return y
    return (y, mean, inv_std)[:_n_outputs]


def _group_norm(x, scale, bias, num_groups, epsilon, ct, per_channel: bool) -> np.ndarray:
    args = (num_groups, scale.size, bias.size, per_channel)
    y_shape, shape = group_norm_layout(x.shape, *args)
    xg = x.astype(ct).reshape(x.shape[0], num_groups, -1)
    y, _, _ = _standardize(xg, (2,), epsilon)
    y = y.reshape(y_shape)
    y *= scale.astype(ct, copy=False).reshape(shape)
    y += bias.astype(ct, copy=False).reshape(shape)
    return y.reshape(x.shape).astype(x.dtype, copy=False)


# GroupNormalization-18 has one scale and bias value per group and no stash_type (statistics in
# float32, float64 for float64); from 21 on, one per channel.
_GN_PER_CHANNEL = 21


@register("GroupNormalization")
def group_normalization(
    x: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray,
    *,
    epsilon: float = 1e-5,
    num_groups: int,
    stash_type: int = 1,
    _opset: int = _GN_PER_CHANNEL,
) -> np.ndarray:
    """Normalize each group of channels; scale and bias have one value per channel (per group
    before opset 21)."""
    if _opset < _GN_PER_CHANNEL:
        ct = compute_dtype(x.dtype)
        return _group_norm(x, scale, bias, num_groups, epsilon, ct, per_channel=False)
    st = _stash_dtype(x, stash_type)
    return _group_norm(x, scale, bias, num_groups, epsilon, st, per_channel=True)


@register("RMSNormalization", since=23)
def rms_normalization(
    x: np.ndarray,
    scale: np.ndarray,
    *,
    axis: int = -1,
    epsilon: float = 1e-5,
    stash_type: int = 1,
) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the axes from ``axis`` on, times scale."""
    axis = norm_axis(axis, x.ndim, "RMSNormalization")
    st = _stash_dtype(x, stash_type)
    xs = x.astype(st)
    ms = np.mean(xs * xs, axis=tuple(range(axis, x.ndim)), keepdims=True)
    xs *= 1 / np.sqrt(ms + st.type(epsilon))
    xs *= scale.astype(st, copy=False)
    return xs.astype(x.dtype, copy=False)


@register("LpNormalization", since=1)
def lp_normalization(x: np.ndarray, *, axis: int = -1, p: int = 2) -> np.ndarray:
    """x divided by its L1 or L2 norm along ``axis`` (zero where the norm is zero)."""
    if p not in (1, 2):
        raise ValueError(f"LpNormalization: p must be 1 or 2, got {p}")
    axis = norm_axis(axis, x.ndim, "LpNormalization")
    ct = compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    if p == 1:
        norm = np.sum(np.abs(xc), axis=axis, keepdims=True)
    else:
        norm = np.sqrt(np.sum(xc * xc, axis=axis, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(norm == 0, 0, xc / norm)
    return y.astype(x.dtype, copy=False)


@register("MeanVarianceNormalization", since=9)
def mean_variance_normalization(x: np.ndarray, *, axes: Sequence[int] = (0, 2, 3)) -> np.ndarray:
    """(x - mean) / (sqrt(variance) + 1e-9) over ``axes``.

    The spec's function body writes the variance as E[x^2] - mean^2; that cancels badly in
    float32 when the mean is large against the spread (errors of 4e-4 for a spread of 0.06 around
    2), so it is computed as E[(x - mean)^2], equal in exact arithmetic.
    """
    axes = tuple(norm_axis(a, x.ndim, "MeanVarianceNormalization") for a in axes)
    ct = compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    centred = xc - xc.mean(axis=axes, keepdims=True)
    std = np.sqrt(np.mean(centred * centred, axis=axes, keepdims=True)) + ct.type(1e-9)
    return (centred / std).astype(x.dtype, copy=False)


@register("LRN", since=1)
def lrn(
    x: np.ndarray,
    *,
    alpha: float = 1e-4,
    beta: float = 0.75,
    bias: float = 1.0,
    size: int,
) -> np.ndarray:
    """x / (bias + alpha / size * sum of x^2 over a window of ``size`` channels) ** beta."""
    check_lrn(x.shape, size)
    ct = compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    c, lo = x.shape[1], (size - 1) // 2
    sq = np.zeros((x.shape[0], c + size - 1, *x.shape[2:]), dtype=ct)
    np.square(xc, out=sq[:, lo : lo + c])
    window = sq[:, :c].copy()
    for j in range(1, size):  # channel c sums the squares of channels c - lo .. c - lo + size - 1
        window += sq[:, j : j + c]
    base = ct.type(bias) + ct.type(alpha / size) * window
    return (xc / base ** ct.type(beta)).astype(x.dtype, copy=False)


class NumpyDropoutArrays:
    """:class:`tensorkiln.kernels.common.norm.DropoutArrays` on numpy arrays."""

    def ratio(self, ratio: np.ndarray | None, training: bool) -> float:
        return 0.5 if ratio is None else float(np.asarray(ratio).reshape(-1)[0])

    def flag(self, v: np.ndarray) -> bool:
        return bool(np.asarray(v).reshape(-1)[0])

    def ones(self, x: np.ndarray, boolean: bool) -> np.ndarray:
        return np.ones(x.shape, dtype=bool if boolean else x.dtype)

    def keep(self, x: np.ndarray, ratio: float, seed: int | None) -> np.ndarray:
        rng = np.random.RandomState(seed) if seed is not None else np.random.RandomState()
        return rng.uniform(0.0, 1.0, x.shape) >= ratio

    def astype(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return x.astype(dtype, copy=False)


register("Dropout")(Dropout(NumpyDropoutArrays()).dropout)
