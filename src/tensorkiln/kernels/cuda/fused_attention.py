"""tensorkiln.Attention on the cuda backend: F.scaled_dot_product_attention.

softmax(Q K^T * scale + mask) V as :mod:`tensorkiln.kernels.reference.fused_attention` defines it:
``mask_kind`` "" / "additive" / "bool", ``causal`` (top-left aligned, as SDPA's is_causal),
``input_layout`` "bhsd" or "bsd" (heads split here as strided views, no copies) and
``output_layout`` "bhsd" / "bshd" / "bsd". SDPA picks the flash or memory-efficient kernel on the GPU;
both accumulate the softmax in float32, so float16 scores do not overflow.

Differences from SDPA that the op's definition fixes:

* SDPA takes no mask together with is_causal: a causal op with a mask folds the causal triangle
  into the mask (False / -inf above the diagonal).
* An additive mask is cast to Q's dtype (SDPA's kernels want that); for float16/bfloat16 its finite
  values are clamped to the dtype's range first, so float32's "very negative" (-3.4e38, -1e9) stays
  a large finite negative instead of becoming -inf.
* A query row whose keys are all hidden gives zeros (SDPA gives NaN, zeros or, in float16 on the
  GPU, arbitrary values there), so with a mask the rows with no visible key are zeroed after SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorkiln.kernels.common.fused import (
    check_attention,
    check_attention_rank,
    check_split_heads,
)
from tensorkiln.kernels.cuda.attention import sdpa_mask
from tensorkiln.kernels.registry import register


def _split_heads(x: torch.Tensor, heads: int, name: str) -> torch.Tensor:
    """[B, S, H*D] -> [B, H, S, D] as a view."""
    check_split_heads(x.shape, heads, name)
    b, s, e = x.shape
    return x.reshape(b, s, heads, e // heads).transpose(1, 2)


def _arrange_output(y: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, H, S, Dv] -> the requested output layout; a view where the strides allow (the GPU
    kernels write their output as [B, S, H, Dv], so "bshd" and "bsd" are then free)."""
    if layout == "bhsd":
        return y
    y = y.transpose(1, 2)
    return y if layout == "bshd" else y.reshape(y.shape[0], y.shape[1], -1)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask in ``dtype``, finite values clamped into its range."""
    if mask.dtype == dtype:
        return mask
    if dtype in (torch.float16, torch.bfloat16) and mask.dtype.itemsize > dtype.itemsize:
        info = torch.finfo(dtype)
        wide = mask.clamp(info.min, info.max).masked_fill_(torch.isneginf(mask), float("-inf"))
        return wide.to(dtype)
    return mask.to(dtype)


def _with_causal(mask: torch.Tensor, kind: str, sq: int, sk: int) -> torch.Tensor:
    """``mask`` with the keys after each query hidden too (top-left aligned)."""
    keep = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).tril_()
    if kind == "bool":
        return mask & keep
    return mask.masked_fill(~keep, float("-inf"))


def _visible_rows(mask: torch.Tensor, kind: str) -> torch.Tensor:
    """[..., Sq, 1]: whether a query row sees at least one key."""
    seen = mask if kind == "bool" else ~torch.isneginf(mask)
    return seen.any(dim=-1, keepdim=True)


def _broadcast_heads(q, k, v):
    """Q, K, V with their batch and head dims broadcast to one shape (as views)."""
    lead = torch.broadcast_shapes(q.shape[:2], k.shape[:2], v.shape[:2])
    return tuple(x.expand(*lead, *x.shape[2:]) if x.shape[:2] != lead else x for x in (q, k, v))


@register("Attention", domain="tensorkiln", since=1, backend="cuda")
def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float = 0.0,
    causal: int = 0,
    mask_kind: str = "",
    num_heads: int = 0,
    input_layout: str = "bhsd",
    output_layout: str = "bhsd",
) -> torch.Tensor:
    """Scaled dot-product attention with an optional additive or boolean mask and causal masking."""
    check_attention(mask_kind, input_layout, output_layout, mask is not None)
    if input_layout == "bsd":
        q, k, v = (_split_heads(x, num_heads, n) for x, n in ((q, "Q"), (k, "K"), (v, "V")))
    check_attention_rank(q.shape, k.shape, v.shape)
    q, k, v = _broadcast_heads(q, k, v)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if mask is not None:
        mask = mask.to(torch.bool) if mask_kind == "bool" else _additive(mask, q.dtype)
        if mask.ndim < 2:  # a scalar or per-key mask: SDPA wants the [Sq, Sk] axes
            mask = mask.reshape(1, -1)
        if causal:
            mask = _with_causal(mask, mask_kind, q.shape[2], k.shape[2])
    y = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=sdpa_mask(mask, q, k.shape[-2]),
        is_causal=bool(causal) and mask is None,
        scale=float(scale) if scale else None,
    )
    if mask is not None:
        y = torch.where(_visible_rows(mask, mask_kind), y, 0)
    return _arrange_output(y, output_layout)
