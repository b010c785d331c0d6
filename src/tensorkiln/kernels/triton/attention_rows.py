"""The attention op's rule for query rows that see no key, in one kernel over the mask.

tensorkiln.Attention gives zeros for a query row whose keys are all hidden (SDPA gives NaN, zeros
or arbitrary values there). On the GPU this was four torch kernels per attention layer (isneginf,
not, any over the keys, a where over the whole output): at batch 1, BERT-base and GPT-2 spent
0.10-0.12 ms of a 0.52-0.68 ms graph replay in them, at large batch a pass over every attention
output. Here one program per mask row (of the mask as it is broadcast: a [B, 1, 1, S] padding
mask has B rows) checks whether any key is visible, and only a row that sees none writes zeros
into the output rows it covers; the output is otherwise not touched.

A key is visible when a bool mask is True there, or an additive mask is not -inf there (NaN counts
as visible: the softmax then propagates it, as the reference does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128
BLOCK_D = 64


@triton.jit
def _empty_rows_kernel(
    m_ptr, y_ptr, SK, D, MH, MQ, CB, CH, CQ,
    smb, smh, smq, smk, syb, syh, syq, syd,
    BOOL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    mq = pid % MQ
    mh = (pid // MQ) % MH
    mb = pid // (MQ * MH)
    row = m_ptr + mb * smb + mh * smh + mq * smq
    seen = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k0 in range(0, SK, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        ok = offs < SK
        if BOOL:
            v = tl.load(row + offs * smk, mask=ok, other=0)
            visible = (v != 0) & ok
        else:
            v = tl.load(row + offs * smk, mask=ok, other=float("-inf")).to(tl.float32)
            visible = (v != float("-inf")) & ok
        seen += visible.to(tl.int32)
    if tl.sum(seen, axis=0) == 0:  # every key hidden: the output rows this row covers are zeros
        # (CB, CH, CQ: the output indices one mask index covers, 1 or the whole broadcast dim)
        d = tl.arange(0, BLOCK_D)
        zero = tl.zeros((BLOCK_D,), dtype=y_ptr.dtype.element_ty)
        for b in range(mb * CB, mb * CB + CB):
            for h in range(mh * CH, mh * CH + CH):
                for q in range(mq * CQ, mq * CQ + CQ):
                    out = y_ptr + b * syb + h * syh + q * syq
                    for d0 in range(0, D, BLOCK_D):
                        tl.store(out + (d0 + d) * syd, zero, mask=d0 + d < D)


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)) if mask.ndim < 4 else mask


def applies(y: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether :func:`zero_empty_rows_` takes output ``y`` [B, H, Sq, D] and ``mask``
    (broadcasting to [B, H, Sq, Sk] with each of its first three dims 1 or ``y``'s)."""
    if y.ndim != 4 or mask.ndim > 4 or mask.ndim < 1 or y.numel() == 0 or mask.numel() == 0:
        return False
    if max(y.numel(), mask.numel()) >= 2**31:  # (offsets are 32-bit)
        return False
    m = _as_4d(mask)
    return all(md in (1, yd) for md, yd in zip(m.shape[:3], y.shape[:3]))


def zero_empty_rows_(y: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """Zero the rows of attention output ``y`` [B, H, Sq, D] (any strides) whose ``mask`` row
    (``kind`` "bool" or additive) hides every key; in place. The caller checks :func:`applies`."""
    m = _as_4d(mask)
    if kind != "bool" and m.dtype == torch.bool:
        raise ValueError("an additive attention mask must be a float tensor")
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)  # (one byte per key either way)
    mb, mh, mq, sk = m.shape
    b, h, q, d = y.shape
    _empty_rows_kernel[(mb * mh * mq,)](
        m, y, sk, d, mh, mq, b // mb, h // mh, q // mq, *m.stride(), *y.stride(),
        BOOL=kind == "bool", BLOCK_K=BLOCK_K, BLOCK_D=BLOCK_D, num_warps=4,
    )  # fmt: skip
    return y
