"""tensorkiln.SqueezeExcite on the cuda backend: the composition of its nodes' own kernels.

``X * gate(conv1x1(act(conv1x1(mean_hw(X), W1, B1)), W2, B2))`` (kernels/reference/fused_se.py
defines it): the cuda backend's ReduceMean and ConvAct kernels in sequence, so the GPU runs what it
ran before the fusion. On the cpu backend a layer at a known input shape runs the native kernel
(cpu_native.squeeze_excite: one pass over X for the mean, one for the product) where it is
faster, measured on the first inputs of that shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tensorkiln.kernels.common.fused import check_se_shapes
from tensorkiln.kernels.cpu import native as cpu_native
from tensorkiln.kernels.cuda.fused_conv import conv_act
from tensorkiln.kernels.cuda.reduce import reduce_mean
from tensorkiln.kernels.registry import register

Tensor = torch.Tensor


@register("SqueezeExcite", domain="tensorkiln", since=1, backend="cuda")
def squeeze_excite(
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None = None,
    w2: Tensor | None = None,
    b2: Tensor | None = None,
    *,
    activation: str = "",
    activation_alpha: float | None = None,
    activation_beta: float | None = None,
    activation_min: float | None = None,
    activation_max: float | None = None,
    gate: str = "",
    gate_alpha: float | None = None,
    gate_beta: float | None = None,
    gate_min: float | None = None,
    gate_max: float | None = None,
) -> Tensor:
    """``X * gate(conv1x1(act(conv1x1(mean_hw(X), W1, B1)), W2, B2))``."""
    if w2 is None:
        raise ValueError("SqueezeExcite: W2 (input 3) is required")
    check_se_shapes(tuple(x.shape), tuple(w1.shape), tuple(w2.shape))
    pooled = reduce_mean(x, axes=[2, 3], keepdims=1)
    hidden = conv_act(
        pooled, w1, b1, activation=activation, activation_alpha=activation_alpha,
        activation_beta=activation_beta, activation_min=activation_min,
        activation_max=activation_max,
    )  # fmt: skip
    g = conv_act(
        hidden, w2, b2, activation=gate, activation_alpha=gate_alpha, activation_beta=gate_beta,
        activation_min=gate_min, activation_max=gate_max,
    )  # fmt: skip
    return x * g


def _specialize(
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None = None,
    w2: Tensor | None = None,
    b2: Tensor | None = None,
    **attrs: object,
) -> Callable[..., Tensor] | None:
    """The native kernel for these shapes and weights, where it applies and is the faster
    (cpu_native.squeeze_excite); None otherwise. Called after :func:`squeeze_excite` ran (and
    checked) these arguments."""
    if x.device.type != "cpu" or x.ndim != 4 or w2 is None:
        return None
    a = attrs.get
    act1 = cpu_native.activation(
        a("activation", ""), a("activation_alpha"), a("activation_beta"), a("activation_min"),
        a("activation_max"),
    )  # fmt: skip
    act2 = cpu_native.activation(
        a("gate", ""), a("gate_alpha"), a("gate_beta"), a("gate_min"), a("gate_max")
    )
    native = cpu_native.squeeze_excite(x, w1, b1, w2, b2, act1, act2)
    if native is None:
        return None
    generic = functools.partial(squeeze_excite, **attrs)
    return cpu_native.specialized(native, generic, (x, w1, b1, w2, b2))


# the executor asks for it on the cpu backend
squeeze_excite.specialize = _specialize  # type: ignore[attr-defined]
