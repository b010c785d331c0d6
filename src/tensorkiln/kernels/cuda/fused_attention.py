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
  GPU, arbitrary values there), so with a mask the rows with no visible key are zeroed after SDPA
  (on the GPU by one Triton kernel over the mask rows, kernels/triton/attention_rows.py).

The checks and head layouts are kernels/common/fused.py's (FusedAttention), shared with the
reference; this module supplies the attention math.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from tensorkiln.kernels.common.fused import FusedAttention
from tensorkiln.kernels.cuda.attention import sdpa_mask
from tensorkiln.kernels.cuda.quant import quantize_linear
from tensorkiln.kernels.registry import register
from tensorkiln.kernels.triton import available as triton_available

rows = None
if triton_available():
    from tensorkiln.kernels.triton import attention_rows as rows
_ROWS_KERNEL = rows is not None  # (off for the process after a failure to compile or launch)


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


def prepare_mask(mask: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The op's mask as the kernels take it: bool, or additive in ``dtype`` (clamped); at least
    2-D (a scalar or per-key mask gets the [Sq, Sk] axes)."""
    mask = mask.to(torch.bool) if kind == "bool" else _additive(mask, dtype)
    return mask.reshape(1, -1) if mask.ndim < 2 else mask


def _attend(q, k, v, mask, scale: float, causal: int, mask_kind: str) -> torch.Tensor:
    """SDPA on [B, H, S, D] tensors, with the op's mask and empty-row rules (see above)."""
    q, k, v = _broadcast_heads(q, k, v)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if mask is not None:
        mask = prepare_mask(mask, mask_kind, q.dtype)
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
        if _ROWS_KERNEL and y.is_cuda and rows.applies(y, mask):
            try:
                return rows.zero_empty_rows_(y, mask, mask_kind)  # (one kernel over the mask)
            except Exception as exc:  # (a Triton that cannot compile it: the torch rule below)
                _rows_kernel_failed(exc)
        y = torch.where(_visible_rows(mask, mask_kind), y, 0)
    return y


def _rows_kernel_failed(exc: Exception) -> None:
    global _ROWS_KERNEL
    _ROWS_KERNEL = False
    warnings.warn(
        f"attention: the Triton empty-row kernel failed ({type(exc).__name__}: "
        f"{str(exc)[:200]}); using torch's kernels for the rule from now on",
        RuntimeWarning,
        stacklevel=3,
    )


class TorchAttentionArrays:
    """:class:`tensorkiln.kernels.common.fused.AttentionArrays` on torch tensors."""

    attend = staticmethod(_attend)

    def swap12(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)

    def quantize(self, y: torch.Tensor, scale: torch.Tensor, q_dtype: int) -> torch.Tensor:
        return quantize_linear(y, scale, output_dtype=q_dtype)

    def attend_quantized(self, *args):
        return None  # (attend, then quantize)


fused_attention = FusedAttention(TorchAttentionArrays()).fused_attention
register("Attention", domain="tensorkiln", since=1, backend="cuda")(fused_attention)
