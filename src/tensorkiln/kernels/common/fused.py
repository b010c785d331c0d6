"""Backend-neutral attribute and shape checks of the fused ops (Attention, SqueezeExcite), shared
by the reference and cuda trees, and tensorkiln.Attention's entry (checks and head layouts)
written once."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from tensorkiln.kernels.common.norm import quant_scale

LAYOUTS_IN = ("bhsd", "bsd")
LAYOUTS_OUT = ("bhsd", "bshd", "bsd")
MASK_KINDS = ("", "additive", "bool")


def check_attention(mask_kind: str, input_layout: str, output_layout: str, has_mask: bool) -> None:
    """Raise ValueError for an Attention node whose attributes are unknown or do not fit its
    mask input."""
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}")
    if input_layout not in LAYOUTS_IN:
        raise ValueError(f"input_layout must be one of {LAYOUTS_IN}, got {input_layout!r}")
    if output_layout not in LAYOUTS_OUT:
        raise ValueError(f"output_layout must be one of {LAYOUTS_OUT}, got {output_layout!r}")
    if has_mask != (mask_kind != ""):
        raise ValueError(f"mask_kind {mask_kind!r} does not fit the mask input ({has_mask})")


def check_split_heads(shape: Sequence[int], heads: int, name: str) -> None:
    """Raise ValueError unless ``shape`` is [B, S, heads * D] (input_layout 'bsd')."""
    shape = tuple(shape)
    if len(shape) != 3 or heads <= 0 or shape[2] % heads:
        raise ValueError(f"{name} must be [B, S, {heads} * D] for input_layout 'bsd', got {shape}")


def check_attention_rank(
    q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int]
) -> None:
    """Raise ValueError unless Q, K and V are [B, H, S, D]."""
    q, k, v = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    if not len(q) == len(k) == len(v) == 4:
        raise ValueError(f"Q, K, V must be rank 4 [B, H, S, D], got {q}, {k}, {v}")


def check_se_shapes(
    x_shape: Sequence[int], w1_shape: Sequence[int], w2_shape: Sequence[int]
) -> None:
    """Raise ValueError unless X (N, C, H, W), W1 (S, C, 1, 1) and W2 (C, S, 1, 1) fit."""
    x_shape, w1_shape, w2_shape = tuple(x_shape), tuple(w1_shape), tuple(w2_shape)
    if len(x_shape) != 4:
        raise ValueError(f"SqueezeExcite: X must be 4-D (N, C, H, W), got shape {x_shape}")
    c = x_shape[1]
    if len(w1_shape) != 4 or w1_shape[1:] != (c, 1, 1):
        raise ValueError(f"SqueezeExcite: W1 must be (S, {c}, 1, 1), got {w1_shape}")
    if len(w2_shape) != 4 or w2_shape != (c, w1_shape[0], 1, 1):
        raise ValueError(f"SqueezeExcite: W2 must be ({c}, {w1_shape[0]}, 1, 1), got {w2_shape}")


class AttentionArrays(Protocol):
    """What tensorkiln.Attention needs from one backend: its attention math, and a swap of
    axes 1 and 2 (a view in both numpy and torch)."""

    def swap12(self, x: Any) -> Any: ...

    def attend(self, q: Any, k: Any, v: Any, mask: Any, scale: float, causal: int, kind: str):
        """softmax(Q K^T * scale + mask) V on [B, H, S, D] operands (scale 0: 1/sqrt(D)), a query
        row with no visible key giving zeros."""

    def quantize(self, y: Any, scale: Any, q_dtype: int) -> Any:
        """QuantizeLinear of ``y`` to the per-tensor ``scale``, no zero point, of ONNX type
        ``q_dtype`` (int8, float8 E4M3: saturating, half to even): the backend's own kernel."""

    def attend_quantized(
        self, q: Any, k: Any, v: Any, mask: Any, scale: float, causal: int, kind: str,
        y_scale: Any, q_dtype: int,
    ) -> Any:  # fmt: skip
        """:meth:`attend` then :meth:`quantize` in one kernel, bit for bit; None where the
        backend has no such kernel for these operands (the two steps then run)."""


class FusedAttention:
    """tensorkiln.Attention over one backend's :class:`AttentionArrays`: the checks and the
    head layouts, written once."""

    def __init__(self, xp: AttentionArrays) -> None:
        self.xp = xp

    def _split_heads(self, x: Any, heads: int, name: str) -> Any:
        """[B, S, H*D] -> [B, H, S, D] (a view)."""
        check_split_heads(x.shape, heads, name)
        b, s, e = x.shape
        return self.xp.swap12(x.reshape(b, s, heads, e // heads))

    def _arrange_output(self, y: Any, layout: str) -> Any:
        """[B, H, S, Dv] -> the requested output layout; a view where the strides allow (the GPU
        kernels write their output as [B, S, H, Dv], so "bshd" and "bsd" are then free)."""
        if layout == "bhsd":
            return y
        y = self.xp.swap12(y)
        return y if layout == "bshd" else y.reshape(y.shape[0], y.shape[1], -1)

    def fused_attention(
        self,
        q: Any,
        k: Any,
        v: Any,
        mask: Any = None,
        y_scale: Any = None,
        *,
        scale: float = 0.0,
        causal: int = 0,
        mask_kind: str = "",
        num_heads: int = 0,
        input_layout: str = "bhsd",
        output_layout: str = "bhsd",
        q_dtype: int = 0,
    ) -> Any:
        """Scaled dot-product attention with an optional additive or boolean mask and causal
        masking; with ``q_dtype``, the output quantized to ``y_scale`` (as a QuantizeLinear
        reading it would)."""
        check_attention(mask_kind, input_layout, output_layout, mask is not None)
        if q_dtype:
            y_scale = quant_scale(y_scale, q_dtype, "Attention")
        if input_layout == "bsd":
            q, k, v = (
                self._split_heads(x, num_heads, n) for x, n in ((q, "Q"), (k, "K"), (v, "V"))
            )
        check_attention_rank(q.shape, k.shape, v.shape)
        if q_dtype:
            args = (q, k, v, mask, scale, causal, mask_kind, y_scale, int(q_dtype))
            y = self.xp.attend_quantized(*args)
            if y is not None:
                return self._arrange_output(y, output_layout)
        y = self.xp.attend(q, k, v, mask, scale, causal, mask_kind)
        y = self._arrange_output(y, output_layout)
        return self.xp.quantize(y, y_scale, int(q_dtype)) if q_dtype else y


def check_gemm_operands(
    a_shape: Sequence[int], b_shape: Sequence[int], trans_a: int, trans_b: int, op: str = "GemmAct"
) -> None:
    """Raise ValueError unless a tensorkiln.GemmAct (or Gemm, ``op``) node's A (Gemm's 2-D A, or
    MatMul's A of higher rank, then not transposed) and 2-D B fit."""
    # (no tuple() of the shapes before an error: this runs on every Gemm call)
    a, b = a_shape, b_shape
    if len(b) != 2:
        raise ValueError(f"{op}: B must be 2-D, got shape {tuple(b)}")
    if len(a) > 2 and trans_a:
        raise ValueError(f"{op}: transA is only allowed for 2-D A, got shape {tuple(a)}")
    if len(a) < 2 or (len(a) > 2 and op == "Gemm"):  # (MatMul's form is GemmAct's only)
        want = "be 2-D" if op == "Gemm" else "have rank >= 2"
        raise ValueError(f"{op}: A must {want}, got shape {tuple(a)}")
    if (a[0] if trans_a else a[-1]) != (b[1] if trans_b else b[0]):
        raise ValueError(f"{op}: inner dimensions differ: A {tuple(a)}, B {tuple(b)}")


def check_gemm_bias(c_shape: Sequence[int], n: int, rank: int, op: str = "GemmAct") -> None:
    """Raise ValueError unless GemmAct's C broadcasts along the last axis (N values or one) where
    A has rank > 2 (MatMul's form; Gemm's 2-D form broadcasts C as Gemm does)."""
    c = tuple(c_shape)
    size = math.prod(c)
    if rank > 2 and (size not in (1, n) or (c and c[-1] != size)):
        raise ValueError(f"{op}: C of shape {c} must broadcast along the last axis")
