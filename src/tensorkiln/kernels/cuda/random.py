"""Random generators on the cuda backend: RandomUniform(Like), RandomNormal(Like), Bernoulli,
Multinomial.

Numbers are drawn on the device with torch's generators. A ``seed`` attribute seeds a fresh
generator (from the float's bits, as the reference seeds numpy's), so a seeded node repeats its
output; without one the device's default generator draws fresh numbers. The values differ from the
reference backend's (numpy's generator), only their distribution, dtype and shape agree. Draws are
made in float32 (float64 for float64 outputs) and cast.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tensorkiln.ir.dtypes import DType
from tensorkiln.kernels.cuda.convert import current_device, torch_dtype
from tensorkiln.kernels.reference import random as ref
from tensorkiln.kernels.registry import register


def _generator(seed: float | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(np.float64(seed).view(np.uint64)))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _uniform(shape, dtype, low: float, high: float, seed, device) -> torch.Tensor:
    out = torch.empty(tuple(shape), dtype=_work_dtype(dtype), device=device)
    return out.uniform_(low, high, generator=_generator(seed, device)).to(dtype)


def _normal(shape, dtype, mean: float, scale: float, seed, device) -> torch.Tensor:
    out = torch.empty(tuple(shape), dtype=_work_dtype(dtype), device=device)
    return out.normal_(mean, scale, generator=_generator(seed, device)).to(dtype)


def _float_dtype(op: str, dtype: int) -> torch.dtype:
    return torch_dtype(ref._float_dtype(op, dtype))


def _like_dtype(op: str, input: torch.Tensor, dtype: int | None) -> torch.dtype:
    return input.dtype if dtype is None else _float_dtype(op, dtype)


@register("RandomUniform", since=1, backend="cuda")
def random_uniform(
    *,
    shape: Sequence[int],
    dtype: int = 1,
    high: float = 1.0,
    low: float = 0.0,
    seed: float | None = None,
) -> torch.Tensor:
    """Samples of U[low, high) of the given shape and dtype."""
    out = _float_dtype("RandomUniform", dtype)
    return _uniform(shape, out, low, high, seed, current_device())


@register("RandomUniformLike", since=1, backend="cuda")
def random_uniform_like(
    input: torch.Tensor,
    *,
    dtype: int | None = None,
    high: float = 1.0,
    low: float = 0.0,
    seed: float | None = None,
) -> torch.Tensor:
    """Samples of U[low, high) shaped like ``input`` (its dtype unless ``dtype`` is given)."""
    out = _like_dtype("RandomUniformLike", input, dtype)
    return _uniform(input.shape, out, low, high, seed, input.device)


@register("RandomNormal", since=1, backend="cuda")
def random_normal(
    *,
    shape: Sequence[int],
    dtype: int = 1,
    mean: float = 0.0,
    scale: float = 1.0,
    seed: float | None = None,
) -> torch.Tensor:
    """Samples of N(mean, scale^2) of the given shape and dtype."""
    out = _float_dtype("RandomNormal", dtype)
    return _normal(shape, out, mean, scale, seed, current_device())


@register("RandomNormalLike", since=1, backend="cuda")
def random_normal_like(
    input: torch.Tensor,
    *,
    dtype: int | None = None,
    mean: float = 0.0,
    scale: float = 1.0,
    seed: float | None = None,
) -> torch.Tensor:
    """Samples of N(mean, scale^2) shaped like ``input`` (its dtype unless ``dtype`` is given)."""
    out = _like_dtype("RandomNormalLike", input, dtype)
    return _normal(input.shape, out, mean, scale, seed, input.device)


@register("Bernoulli", since=1, backend="cuda")
def bernoulli(
    input: torch.Tensor, *, dtype: int | None = None, seed: float | None = None
) -> torch.Tensor:
    """1 with probability ``input`` (elementwise), else 0, in ``dtype`` (default: input's).

    Probabilities outside [0, 1] are not reported (that would read them on the host); they act
    as 0 or 1.
    """
    out = input.dtype if dtype is None else torch_dtype(DType(dtype).numpy)
    work = _work_dtype(input.dtype)
    u = _uniform(input.shape, work, 0.0, 1.0, seed, input.device)
    return (u < input.to(work)).to(out)


@register("Multinomial", since=1, backend="cuda")
def multinomial(
    input: torch.Tensor, *, dtype: int = 6, sample_size: int = 1, seed: float | None = None
) -> torch.Tensor:
    """``sample_size`` class indexes per row of [batch, classes] unnormalized log-probabilities."""
    if input.ndim != 2:
        raise ValueError(
            f"Multinomial: input must be [batch, classes], got shape {tuple(input.shape)}."
        )
    if dtype not in (DType.INT32, DType.INT64):
        raise ValueError(f"Multinomial: dtype must be int32 (6) or int64 (7), got {dtype}.")
    probs = torch.softmax(input.to(torch.float64), dim=1)
    gen = _generator(seed, input.device)
    idx = torch.multinomial(probs, sample_size, replacement=True, generator=gen)
    return idx.to(torch_dtype(DType(dtype).numpy))
