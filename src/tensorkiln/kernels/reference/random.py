"""Random generators: RandomUniform(Like), RandomNormal(Like), Bernoulli, Multinomial.

A ``seed`` attribute makes the output deterministic (numpy's default generator seeded from the
float's bits); without one every call draws fresh numbers. Values are drawn in float64 and cast.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.ir.dtypes import DType
from tensorkiln.kernels.registry import register


def _rng(seed: float | None) -> np.random.Generator:
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(int(np.float64(seed).view(np.uint64)))


def _float_dtype(op: str, dtype: int) -> np.dtype:
    try:
        dt = DType(dtype)
    except ValueError:
        raise ValueError(f"{op}: unknown dtype code {dtype}.") from None
    if not dt.is_float:
        raise ValueError(f"{op}: dtype must be a floating-point type, got {dt.name}.")
    return dt.numpy


def _like_dtype(op: str, input: np.ndarray, dtype: int | None) -> np.dtype:
    return input.dtype if dtype is None else _float_dtype(op, dtype)


@register("RandomUniform", since=1)
def random_uniform(
    *,
    shape: list[int],
    dtype: int = 1,
    high: float = 1.0,
    low: float = 0.0,
    seed: float | None = None,
) -> np.ndarray:
    """Samples of U[low, high) of the given shape and dtype."""
    return _rng(seed).uniform(low, high, size=shape).astype(_float_dtype("RandomUniform", dtype))


@register("RandomUniformLike", since=1)
def random_uniform_like(
    input: np.ndarray,
    *,
    dtype: int | None = None,
    high: float = 1.0,
    low: float = 0.0,
    seed: float | None = None,
) -> np.ndarray:
    """Samples of U[low, high) shaped like ``input`` (its dtype unless ``dtype`` is given)."""
    out = _like_dtype("RandomUniformLike", input, dtype)
    return _rng(seed).uniform(low, high, size=input.shape).astype(out)


@register("RandomNormal", since=1)
def random_normal(
    *,
    shape: list[int],
    dtype: int = 1,
    mean: float = 0.0,
    scale: float = 1.0,
    seed: float | None = None,
) -> np.ndarray:
    """Samples of N(mean, scale^2) of the given shape and dtype."""
    return _rng(seed).normal(mean, scale, size=shape).astype(_float_dtype("RandomNormal", dtype))


@register("RandomNormalLike", since=1)
def random_normal_like(
    input: np.ndarray,
    *,
    dtype: int | None = None,
    mean: float = 0.0,
    scale: float = 1.0,
    seed: float | None = None,
) -> np.ndarray:
    """Samples of N(mean, scale^2) shaped like ``input`` (its dtype unless ``dtype`` is given)."""
    out = _like_dtype("RandomNormalLike", input, dtype)
    return _rng(seed).normal(mean, scale, size=input.shape).astype(out)


@register("Bernoulli", since=1)
def bernoulli(
    input: np.ndarray, *, dtype: int | None = None, seed: float | None = None
) -> np.ndarray:
    """1 with probability ``input`` (elementwise), else 0, in ``dtype`` (default: input's)."""
    p = np.asarray(input, dtype=np.float64)
    if ((p < 0) | (p > 1)).any():
        raise ValueError("Bernoulli: probabilities must lie in [0, 1].")
    out = input.dtype if dtype is None else DType(dtype).numpy
    return (_rng(seed).random(size=p.shape) < p).astype(out)


@register("Multinomial", since=1)
def multinomial(
    input: np.ndarray, *, dtype: int = 6, sample_size: int = 1, seed: float | None = None
) -> np.ndarray:
    """``sample_size`` class indexes per row of [batch, classes] unnormalized log-probabilities."""
    if input.ndim != 2:
        raise ValueError(f"Multinomial: input must be [batch, classes], got shape {input.shape}.")
    if dtype not in (DType.INT32, DType.INT64):
        raise ValueError(f"Multinomial: dtype must be int32 (6) or int64 (7), got {dtype}.")
    logits = np.asarray(input, dtype=np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(p, axis=1)
    cdf /= cdf[:, -1:]
    u = _rng(seed).random(size=(input.shape[0], sample_size))
    idx = (u[..., None] >= cdf[:, None, :]).sum(axis=-1)
    return np.minimum(idx, input.shape[1] - 1).astype(DType(dtype).numpy)
