"""Attention in one Triton pass (FlashAttention's online softmax), masks read where they are.

``softmax(Q K^T * scale + mask) V`` over blocks of keys, with the running maximum and sum kept per
query row in float32, so the [Sq, Sk] scores are never written. What SDPA's fused kernels do not
take without help, this one reads as it is:

* a mask of any broadcast shape ([B, 1, 1, Sk] key padding, [B, 1, Sq, Sk] causal-and-padding,
  [Sq, Sk]) through its strides, a zero stride on the broadcast axes, so it is never expanded to
  [B, H, Sq, Sk]; bool masks hide keys, additive ones are added to the scores;
* causal masking (top-left aligned) with a mask at the same time, skipping the key blocks above
  the diagonal;
* rows that see no key give zeros, the op's rule, with no pass after it;
* Q, K and V as strided views (heads split out of [B, S, H*D] without copies); the output is
  written as [B, Sq, H, D] and returned as its [B, H, Sq, D] view.

float16 and bfloat16 operands (float32 accumulation); head widths up to 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorkiln.kernels.triton import interpreting

DTYPES = (torch.float16, torch.bfloat16)
BLOCKS_M = (64, 128)  # query rows per program: one tactic each
MAX_HEAD = 256
LOG2E = 1.4426950408889634


@triton.jit
def _flash_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, qk_scale, H, SQ, SK, D, DV,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smm, smn, sob, soh, som, sod,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < SQ
    q = tl.load(
        q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=m_ok[:, None] & (offs_d < D)[None, :], other=0.0,
    )  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (start_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < SK
        k = tl.load(
            k_ptr + b * skb + h * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
            mask=n_ok[None, :] & (offs_d < D)[:, None], other=0.0,
        )  # fmt: skip
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k) * qk_scale  # (log2 units: exp2 below)
        visible = n_ok[None, :] & m_ok[:, None]
        if CAUSAL:
            visible = visible & (offs_m[:, None] >= offs_n[None, :])
        if HAS_MASK:
            mt = tl.load(
                m_ptr + b * smb + h * smh + offs_m[:, None] * smm + offs_n[None, :] * smn,
                mask=m_ok[:, None] & n_ok[None, :], other=0,
            )  # fmt: skip
            if MASK_BOOL:
                visible = visible & (mt != 0)
            else:
                s = s + mt.to(tl.float32) * 1.4426950408889634
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (rows with nothing visible yet)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + b * svb + h * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
            mask=n_ok[:, None] & (offs_dv < DV)[None, :], other=0.0,
        )  # fmt: skip
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(
        o_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
        out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_dv < DV)[None, :],
    )  # fmt: skip


def _mask_4d(mask: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """``mask`` as a [B, H, Sq, Sk] view (broadcast axes of stride 0, nothing copied)."""
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)) if mask.ndim < 4 else mask
    return m.expand(shape)


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`attention` takes these [B, H, S, D] operands (and mask)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.dtype not in DTYPES:
        return False
    if k.dtype != q.dtype or v.dtype != q.dtype or q.shape[-1] != k.shape[-1]:
        return False
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        return False
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD or 0 in q.shape or 0 in k.shape:
        return False
    if mask is not None:
        if mask.ndim > 4:
            return False
        try:
            torch.broadcast_shapes(tuple(mask.shape), (*q.shape[:3], k.shape[2]))
        except RuntimeError:
            return False
    sizes = [x.numel() for x in (q, k, v)] + ([mask.numel()] if mask is not None else [])
    return max(sizes) < 2**31


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float,
    causal: bool = False,
    mask_kind: str = "",
    block_m: int = 128,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v of [B, H, Sq, D] / [B, H, Sk, D] / [B, H, Sk, Dv]
    operands; ``mask_kind`` "bool" (True: visible) or anything else (additive); ``block_m``
    query rows per program (64: twice the programs, for small batches). Returns [B, H, Sq, Dv],
    a view of a [B, Sq, H, Dv] tensor. The caller checks :func:`applies`."""
    b, h, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    out = torch.empty((b, sq, h, dv), dtype=q.dtype, device=q.device)
    o = out.permute(0, 2, 1, 3)
    has_mask = mask is not None
    m = _mask_4d(mask, (b, h, sq, sk)) if has_mask else q
    if has_mask and m.dtype == torch.bool:
        m = m.view(torch.uint8)
    block_m = 64 if sq <= 64 else block_m
    block_n = 64
    grid = (triton.cdiv(sq, block_m), b * h)
    mstrides = m.stride() if has_mask else (0, 0, 0, 0)
    _flash_kernel[grid](
        q, k, v, m, o, float(scale) * LOG2E, h, sq, sk, d, dv,
        *q.stride(), *k.stride(), *v.stride(), *mstrides, *o.stride(),
        HAS_MASK=has_mask, MASK_BOOL=mask_kind == "bool", CAUSAL=bool(causal),
        UPCAST=interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        num_warps=4 if block_m == 64 else 8, num_stages=2,
    )  # fmt: skip
    return o
