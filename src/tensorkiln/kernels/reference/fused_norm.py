"""Reference kernels and shape rules of the fused normalization and activation ops.

The ops of the ``tensorkiln`` domain that :mod:`tensorkiln.passes.fuse_norm` makes:

* ``LayerNorm(X, scale, bias?, residual?, Y_scale?) {axis=-1, epsilon=1e-5, q_dtype}`` ->
  ``Y[, S[, Y_q]]``: with a residual, ``S = X + residual`` is normalized, and the optional second
  output returns ``S`` itself (the pre-norm sum a pre-LN transformer reads again for its next
  residual); with Y_scale, ``Y_q = QuantizeLinear(Y, Y_scale)`` to type q_dtype (the next
  quantized layer's input, written by the normalization instead of a pass of its own).
* ``RMSNorm(X, scale) {axis=-1, epsilon=1e-5}``: ``X / sqrt(mean(X^2) + epsilon) * scale``.
* ``Gelu(X) {approximate="none"}``: ONNX Gelu for models below opset 20, where ONNX has none.
* ``SiLU(X)``: ``X * sigmoid(X)`` (ONNX Swish with alpha 1 only exists from opset 24).

Normalizations compute in float32 (float64 stays float64) on a 2-D ``[rows, normalized]`` view, and
write the result back in the input's dtype. Scale and bias broadcast against the normalized axes.
The LayerNorm and RMSNorm entries are kernels/common/norm.py's FusedNorm over the numpy math here.
"""

from __future__ import annotations

import numpy as np

from tensorkiln.kernels.common.norm import FusedNorm
from tensorkiln.kernels.reference.elementwise import gelu as _onnx_gelu
from tensorkiln.kernels.reference.elementwise import sigmoid as _sigmoid
from tensorkiln.kernels.reference.quant import quantize_linear
from tensorkiln.kernels.registry import register

DOMAIN = "tensorkiln"


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _rows(x: np.ndarray, axis: int, ct: np.dtype) -> np.ndarray:
    """``x`` as a contiguous ``[rows, normalized]`` array of the compute dtype (a copy)."""
    cols = int(np.prod(x.shape[axis:], dtype=np.int64))
    return np.array(x, dtype=ct, copy=True).reshape(-1, cols) if cols else x.astype(ct)


def _affine(y: np.ndarray, shape: tuple[int, ...], axis: int, w: np.ndarray | None, add: bool):
    """Apply scale (``add`` False) or bias (``add`` True) in place on the normalized view."""
    if w is None:
        return y
    full = y.reshape(shape)
    if add:
        full += w.astype(y.dtype, copy=False)
    else:
        full *= w.astype(y.dtype, copy=False)
    return y


class NumpyFusedNormArrays:
    """:class:`tensorkiln.kernels.common.norm.FusedNormArrays` on numpy arrays."""

    def layer_norm(
        self, s: np.ndarray, axis: int, scale: np.ndarray, bias: np.ndarray | None, epsilon: float
    ) -> np.ndarray:
        ct = _compute_dtype(s.dtype)
        y = _rows(s, axis, ct)
        y -= y.mean(axis=1, keepdims=True)
        var = np.einsum("ij,ij->i", y, y) / max(y.shape[1], 1)
        y *= (1.0 / np.sqrt(var + ct.type(epsilon))).astype(ct, copy=False)[:, None]
        _affine(y, s.shape, axis, scale, add=False)
        _affine(y, s.shape, axis, bias, add=True)
        return y.reshape(s.shape).astype(s.dtype, copy=False)

    def rms_norm(self, x: np.ndarray, axis: int, scale: np.ndarray, epsilon: float) -> np.ndarray:
        ct = _compute_dtype(x.dtype)
        y = _rows(x, axis, ct)
        ms = np.einsum("ij,ij->i", y, y) / max(y.shape[1], 1)
        y *= (1.0 / np.sqrt(ms + ct.type(epsilon))).astype(ct, copy=False)[:, None]
        _affine(y, x.shape, axis, scale, add=False)
        return y.reshape(x.shape).astype(x.dtype, copy=False)

    def quantize(self, y: np.ndarray, scale: np.ndarray, q_dtype: int) -> np.ndarray:
        return quantize_linear(y, np.asarray(scale), output_dtype=q_dtype)


_NORMS = FusedNorm(NumpyFusedNormArrays())
layer_norm = register("LayerNorm", domain=DOMAIN, since=1)(_NORMS.layer_norm)
rms_norm = register("RMSNorm", domain=DOMAIN, since=1)(_NORMS.rms_norm)


@register("Gelu", domain=DOMAIN, since=1)
def gelu(x: np.ndarray, *, approximate: str = "none") -> np.ndarray:
    """GELU as ONNX Gelu (opset 20) defines it, for models of older opsets."""
    return _onnx_gelu(x, approximate=approximate)


@register("SiLU", domain=DOMAIN, since=1)
def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``."""
    return x * _sigmoid(x)
