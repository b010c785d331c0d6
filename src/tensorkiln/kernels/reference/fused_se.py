"""Reference kernel and shape rule of tensorkiln.SqueezeExcite, made by passes/fuse_se.py.

``SqueezeExcite(X, W1, B1?, W2, B2?)`` of a 4-D ``X`` (N, C, H, W) is the squeeze-and-excitation
block of MobileNetV3 and EfficientNet as the graph writes it: the spatial mean of ``X`` (ReduceMean
over axes 2, 3 with keepdims, or GlobalAveragePool), a 1x1 convolution by ``W1`` (S, C, 1, 1) with
bias ``B1`` and activation ``activation`` (with its ``activation_*`` scalars, as ConvAct's), a 1x1
convolution by ``W2`` (C, S, 1, 1) with bias ``B2`` and activation ``gate`` (``gate_*``), and ``X``
times that gate, broadcast over the spatial axes. The kernel is the composition of the reference
kernels of those nodes, so the fused op gives the unfused graph's numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorkiln.kernels.common.fused import check_se_shapes
from tensorkiln.kernels.reference.fused_conv import conv_act
from tensorkiln.kernels.reference.reduce import reduce_mean
from tensorkiln.kernels.registry import register

DOMAIN = "tensorkiln"


def squeeze_attrs(attrs: dict[str, Any], prefix: str) -> dict[str, Any]:
    """ConvAct's activation keywords from SqueezeExcite's ``activation*`` or ``gate*`` ones."""
    out = {"activation": attrs.get(prefix, "")}
    for key in ("alpha", "beta", "min", "max"):
        out[f"activation_{key}"] = attrs.get(f"{prefix}_{key}")
    return out


@register("SqueezeExcite", domain=DOMAIN, since=1)
def squeeze_excite(
    x: np.ndarray,
    w1: np.ndarray,
    b1: np.ndarray | None = None,
    w2: np.ndarray | None = None,
    b2: np.ndarray | None = None,
    **attrs: Any,
) -> np.ndarray:
    """``X * gate(conv1x1(act(conv1x1(mean_hw(X), W1, B1)), W2, B2))``."""
    if w2 is None:
        raise ValueError("SqueezeExcite: W2 (input 3) is required")
    check_se_shapes(x.shape, w1.shape, w2.shape)
    pooled = reduce_mean(x, axes=[2, 3], keepdims=1)
    hidden = conv_act(pooled, w1, b1, **squeeze_attrs(attrs, "activation"))
    gate = conv_act(hidden, w2, b2, **squeeze_attrs(attrs, "gate"))
    return np.multiply(x, gate).astype(x.dtype, copy=False)
